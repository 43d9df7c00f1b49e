"""GPU-only properties of the kernels (issue 30), which the device axis (devices.py) cannot check.

The device axis already runs every `backend` test on "cuda:cuda" and "cuda:triton" against the
reference. This file holds the GPU kernels to what only a GPU shows:

1. test_cuda_graph_replay_matches_eager: every public op, forward and backward, captured in a CUDA
   graph and replayed on new input values gives bitwise the eager result on those values; an op
   that synchronises with the host (which no graph can capture) fails, named.
2. test_two_runs_bitwise_equal: two runs on the same inputs give bitwise equal outputs and
   gradients (no atomics-order or uninitialised-memory nondeterminism).
3. test_dispatch_combine_beyond_int32_offsets: dispatch / combine on a bf16 x with T * d > 2**31
   elements put sampled rows, the last ones included, in the right slots.
4. test_routers_agree_deepseek_v3: the Triton, CUDA and C++ routers pick the same experts at
   T = 65536, E = 256, k = 8 with DeepSeek-V3's grouped sigmoid router.
5. test_ops_on_second_device: inputs on cuda:1 while cuda:0 is current: outputs on cuda:1, equal
   to the same op on cuda:0 (in a subprocess: a kernel launched on the wrong device can leave a
   sticky CUDA error that would fail every later test of the process).

Every GPU test is marked `gpu` (`make gpu-check` runs `pytest -m gpu`) and skipped with the reason
where no CUDA device is present or under TRITON_INTERPRET=1. The helpers take a device and a
backend, so the `smoke` tests at the end run their graph-free parts on CPU tensors with the
kernel backend of the pass ("cpu"; "triton" in the interpreter pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from devices import gpu_skip_reason
from tolerances import assert_close

import moe_kernels
from moe_kernels import backends, ops, reference

HERE = Path(__file__).resolve().parent
INTERPRETING = backends.triton_interpreting()
GPU_SKIP = gpu_skip_reason(INTERPRETING)
GPU_BACKENDS = ("triton", "cuda")


def gpu(test):
    """Mark a GPU-only test: `gpu` for `make gpu-check`, skipped with the reason without a GPU."""
    return pytest.mark.gpu(pytest.mark.skipif(GPU_SKIP is not None, reason=GPU_SKIP or "")(test))


# ----------------------------------------------------------------------------------------------
# The ops under test: each case builds its inputs from a seed (on the CPU with a generator, then
# copied: the same values on every device) and calls the public op.


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, seed, device, dtype=torch.float32, *, scale=1.0, shift=0.0, grad=False) -> torch.Tensor:
    t = (torch.randn(shape, generator=_gen(seed)) * scale + shift).to(dtype).to(device)
    return t.requires_grad_(grad)


def _experts(seed: int, T: int, E: int, k: int) -> torch.Tensor:
    """[T, k] distinct experts per token (CPU), every 7th token's last choice empty (-1)."""
    experts = torch.randn(T, E, generator=_gen(seed)).topk(k, dim=1).indices
    experts[::7, -1] = -1
    return experts


E_CAP, K_CAP, D = 16, 2, 64  # the capacity-routing cases: experts, choices per token, hidden size


def _capacity(T: int) -> int:
    return ops.capacity_for(T, E_CAP, K_CAP, 1.0)  # factor 1: some choices overflow and drop


def _routed(seed: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    experts = _experts(seed, T, E_CAP, K_CAP)
    positions, _ = reference.capacity_positions(experts, E_CAP, _capacity(T))
    return experts.to(device), positions.to(device)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    op: str  # the registered op whose backend runs it (noisy_topk_gate: load_probabilities)
    make: Callable  # (seed, device, T) -> {name: tensor}
    run: Callable  # (**inputs) -> tuple of outputs
    grad: tuple[str, ...] = ()  # the inputs differentiated (every float output gets a cotangent)


def _deepseek_bias(seed: int, E: int, device) -> torch.Tensor:
    # Quantised to 1/64: with bf16 logits, equal logits and equal biases make exact ties.
    return (torch.round(0.05 * torch.randn(E, generator=_gen(seed + 7)) * 64) / 64).to(device)


# DeepSeek-V3's router (docs/routers.md): the bias is passed separately.
DEEPSEEK_V3 = dict(
    scoring="sigmoid", num_groups=8, topk_groups=4, group_scoring="top2_sum", renormalize=True, scaling_factor=2.5
)


def _load_inputs(seed, device, T, E=32):
    clean = _randn((T, E), seed, device)
    noise = _randn((T, E), seed + 1, device)
    stddev = torch.nn.functional.softplus(torch.randn(T, E, generator=_gen(seed + 2))) + 0.01
    noisy = (clean.detach().cpu() + noise.cpu() * stddev).to(device)
    return {
        "clean_logits": clean.requires_grad_(),
        "noisy_logits": noisy.requires_grad_(),
        "noise_stddev": stddev.to(device).requires_grad_(),
    }


def _permute_inputs(seed, device, T):
    return {
        "x": _randn((T, D), seed, device, torch.bfloat16, grad=True),
        "experts": _experts(seed, T, E_CAP, 2).to(device),
    }


def _unpermute_inputs(seed, device, T):
    experts = _experts(seed, T, E_CAP, 2)
    _, _, order = reference.permute(torch.zeros(T, 1), experts, E_CAP)
    return {
        "y_sorted": _randn((T * 2, D), seed, device, torch.bfloat16, grad=True),
        "order": order.to(device),
        "weights": _randn((T, 2), seed + 1, device, grad=True),
    }


CASES = [
    Case(
        "topk_softmax",
        "topk_router",
        lambda seed, device, T: {"logits": _randn((T, 64), seed, device, grad=True)},
        lambda logits: ops.topk_softmax(logits, 8, True),
        ("logits",),
    ),
    Case(
        "topk_softmax_bf16_full_softmax",
        "topk_router",
        lambda seed, device, T: {"logits": _randn((T, 128), seed, device, torch.bfloat16, grad=True)},
        lambda logits: ops.topk_softmax(logits, 2, False),
        ("logits",),
    ),
    Case(
        "topk_router_deepseek_v3",
        "topk_router",
        lambda seed, device, T: {
            "logits": _randn((T, 256), seed, device, grad=True),
            "bias": _deepseek_bias(seed, 256, device),
        },
        lambda logits, bias: ops.topk_router(logits, 8, bias=bias, **DEEPSEEK_V3),
        ("logits",),
    ),
    Case(
        "topk_router_softmax_bf16",
        "topk_router",
        lambda seed, device, T: {"logits": _randn((T, 64), seed, device, torch.bfloat16, grad=True)},
        lambda logits: ops.topk_router(logits, 8, renormalize=True),
        ("logits",),
    ),
    Case(
        "load_probabilities",
        "load_probabilities",
        _load_inputs,
        lambda clean_logits, noisy_logits, noise_stddev: ops.load_probabilities(
            clean_logits, noisy_logits, noise_stddev, 4, return_topk=True
        ),
        ("clean_logits", "noisy_logits", "noise_stddev"),
    ),
    Case(
        "noisy_topk_gate",
        "load_probabilities",
        lambda seed, device, T: {
            "clean_logits": _randn((T, 32), seed, device, grad=True),
            "raw_noise_stddev": _randn((T, 32), seed + 1, device, grad=True),
            "noise": _randn((T, 32), seed + 2, device, grad=True),
            "mask": (torch.arange(T) % 5 != 0).to(device),
        },
        lambda clean_logits, raw_noise_stddev, noise, mask: ops.noisy_topk_gate(
            clean_logits, raw_noise_stddev, noise, 4, 1e-2, mask
        ),
        ("clean_logits", "raw_noise_stddev", "noise"),
    ),
    Case(
        "capacity_positions",
        "capacity_positions",
        lambda seed, device, T: {"experts": _experts(seed, T, E_CAP, K_CAP).to(device)},
        lambda experts: ops.capacity_positions(experts, E_CAP, _capacity(experts.shape[0])),
    ),
    Case(
        "capacity_positions_priority",
        "capacity_positions",
        lambda seed, device, T: {
            "experts": _experts(seed, T, E_CAP, K_CAP).to(device),
            "priority": _randn((T, K_CAP), seed + 1, device),
        },
        lambda experts, priority: ops.capacity_positions(
            experts, E_CAP, _capacity(experts.shape[0]), priority=priority
        ),
    ),
    Case(
        "dispatch",
        "dispatch",
        lambda seed, device, T: dict(
            zip(("experts", "positions"), _routed(seed, T, device)),
            x=_randn((T, D), seed, device, torch.bfloat16, grad=True),
        ),
        lambda x, experts, positions: (ops.dispatch(x, experts, positions, E_CAP, _capacity(x.shape[0])),),
        ("x",),
    ),
    Case(
        "combine",
        "combine",
        lambda seed, device, T: dict(
            zip(("experts", "positions"), _routed(seed, T, device)),
            buffer=_randn((E_CAP, _capacity(T), D), seed, device, torch.bfloat16, grad=True),
            weights=_randn((T, K_CAP), seed + 1, device, grad=True),
        ),
        lambda buffer, experts, positions, weights: (ops.combine(buffer, experts, positions, weights),),
        ("buffer", "weights"),
    ),
    Case(
        "permute",
        "permute",
        _permute_inputs,
        lambda x, experts: ops.permute(x, experts, E_CAP),
        ("x",),
    ),
    Case(
        "unpermute",
        "unpermute",
        _unpermute_inputs,
        lambda y_sorted, order, weights: (ops.unpermute(y_sorted, order, weights, weights.shape[0]),),
        ("y_sorted", "weights"),
    ),
    Case(
        "batchwise_mask",
        "batchwise_mask",
        lambda seed, device, T: {"scores": _randn((T, 16), seed, device)},
        lambda scores: ops.batchwise_mask(scores, scores.shape[0] * 2 // 16, return_indices=True),
    ),
    Case(
        "smooth_step",
        "smooth_step",
        lambda seed, device, T: {"t": _randn((T, 16), seed, device, scale=0.6, grad=True)},
        lambda t: (ops.smooth_step(t, 1.0),),
        ("t",),
    ),
    Case(
        "dselect_k",
        "dselect_k",
        lambda seed, device, T: {
            "alpha": _randn((T, 4), seed, device, grad=True),
            "z": _randn((T, 4, 4), seed + 1, device, scale=0.5, grad=True),
        },
        lambda alpha, z: ops.dselect_k(alpha, z, 16, 1.0, return_selectors=True),
        ("alpha", "z"),
    ),
]
CASE_IDS = [c.name for c in CASES]
CASES_BY_NAME = {c.name: c for c in CASES}


def require(case: Case, backend: str, device_type: str) -> None:
    """Skip, naming the op, when `backend` has no kernel of case.op for `device_type` tensors.

    Asked of backends._available, the rule use_backend applies: an op gets its "cuda" case as
    soon as its CUDA kernel is registered with backends.register (e.g. the dispatch family)."""
    if not backends._available(case.op, backend, device_type):
        via = "" if case.op == case.name else f" (it runs {case.op})"
        pytest.skip(f"{case.name}{via} has no {backend} kernel for {device_type} tensors")


# ----------------------------------------------------------------------------------------------
# Helpers shared by the GPU tests and their CPU smoke forms.


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def forward(case: Case, inputs: dict) -> tuple:
    return _as_tuple(case.run(**inputs))


def cotangents(outputs: tuple, seed: int) -> list[torch.Tensor]:
    """A random cotangent for every differentiable output (a new tensor: static in a graph)."""
    out = []
    for i, o in enumerate(outputs):
        if o.requires_grad:
            out.append(torch.randn(o.shape, generator=_gen(seed * 100 + i)).to(o.dtype).to(o.device))
    return out


def forward_backward(case: Case, inputs: dict, cot: list[torch.Tensor]) -> tuple[tuple, tuple]:
    """(outputs, gradients of case.grad's inputs); torch.autograd.grad, so no .grad accumulates."""
    outs = forward(case, inputs)
    grads = ()
    if case.grad:
        diff = [o for o in outs if o.requires_grad]
        assert len(diff) == len(cot), f"{case.name}: {len(diff)} differentiable outputs, {len(cot)} cotangents"
        grads = torch.autograd.grad(diff, [inputs[n] for n in case.grad], cot)
    return tuple(o.detach() for o in outs), tuple(grads)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers (NaN == NaN when its bits are equal; -0.0 != +0.0)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_INT_VIEW[flat.element_size()]) if flat.dtype != torch.bool else flat.to(torch.uint8)


def assert_bitwise(actual: tuple, expected: tuple, what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a.shape, a.dtype, a.device) == (e.shape, e.dtype, e.device), (
            f"{what}[{i}]: {tuple(a.shape)} {a.dtype} on {a.device}, expected {tuple(e.shape)} {e.dtype} on {e.device}"
        )
        differ = _bits(a) != _bits(e)
        if bool(differ.any()):
            n = int(differ.sum())
            first = int(differ.nonzero()[0, 0])
            raise AssertionError(
                f"{what}[{i}] ({a.dtype}): {n} of {a.numel()} elements differ bitwise; first at flat index "
                f"{first}: {a.reshape(-1)[first].item()} vs {e.reshape(-1)[first].item()}"
            )


def _copy_into(static: dict, fresh: dict, static_cot: list, fresh_cot: list) -> None:
    with torch.no_grad():
        for name, value in fresh.items():
            static[name].copy_(value)
        for s, f in zip(static_cot, fresh_cot):
            s.copy_(f)


def _name(case: Case, backend: str) -> str:
    return f"{case.name} ({backend} backend)"


def static_replay_matches_eager(case: Case, device, backend: str, T: int, *, graph: bool) -> None:
    """Forward (+ backward) on static inputs, then fresh values copied into them and the call
    replayed: the result must be bitwise the eager call on the fresh values.

    graph=True (CUDA): the call is captured once in a CUDA graph, after a warm-up on a side stream
    (torch.cuda.graph's documented recipe: it compiles the Triton kernels and initialises the
    autograd streams), and the replay is graph.replay(). The backward is captured too,
    torch.autograd.grad inside the capture, the cotangents static inputs like the others.
    graph=False (the CPU smoke form): the "replay" re-runs the call on the static inputs."""
    device = torch.device(device)
    name = _name(case, backend)
    static, fresh = case.make(0, device, T), case.make(1, device, T)
    side = torch.cuda.Stream(device) if graph else None
    if graph:
        side.wait_stream(torch.cuda.current_stream(device))
    with moe_kernels.use_backend(backend), torch.cuda.stream(side) if graph else contextlib.nullcontext():
        # Every eager call on the static inputs before the capture runs on the side stream, and no
        # graph of them outlives it: an autograd node keeps the stream it was made on, and a node
        # made on the legacy default stream and still alive at the capture (the static leaves'
        # gradient accumulators, held by `outs`) pulls that stream into it. On the first GPU runs
        # the first capture of each process failed so, in torch.autograd.grad, every op alike:
        # "operation would make the legacy stream depend on a capturing blocking stream"
        # (pytorch/pytorch#164302).
        outs = forward(case, static)  # not detached: which outputs need a cotangent
        static_cot, fresh_cot = cotangents(outs, 0), cotangents(outs, 1)
        del outs
        first, _ = forward_backward(case, static, static_cot)
        if graph:
            # The first warm-up call refuses host synchronisations: a graph cannot capture
            # them, and a capture that fails on one can leave the process's CUDA state
            # unusable for the tests after it.
            torch.cuda.set_sync_debug_mode("error")
            try:
                forward_backward(case, static, static_cot)
            except RuntimeError as exc:
                if "synchroniz" not in str(exc):
                    raise
                pytest.fail(f"{name} synchronises with the host, so no CUDA graph can capture it: {exc}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
            for _ in range(2):
                forward_backward(case, static, static_cot)
    with moe_kernels.use_backend(backend):
        if graph:
            torch.cuda.current_stream(device).wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(cuda_graph):
                    captured = forward_backward(case, static, static_cot)
            except Exception as exc:
                # The frames name the call that left the capture (a kernel, the autograd engine,
                # the allocator): the message alone did not, on the first GPU run.
                where = "".join(traceback.format_tb(exc.__traceback__)[-6:])
                pytest.fail(f"{name}: CUDA graph capture failed: {type(exc).__name__}: {exc}\n{where}")
            _copy_into(static, fresh, static_cot, fresh_cot)
            cuda_graph.replay()
            torch.cuda.synchronize(device)
        else:
            forward_backward(case, static, static_cot)
            _copy_into(static, fresh, static_cot, fresh_cot)
            captured = forward_backward(case, static, static_cot)
        eager = forward_backward(case, fresh, fresh_cot)
    assert_bitwise(captured[0], eager[0], f"{name} replayed outputs vs eager")
    assert_bitwise(captured[1], eager[1], f"{name} replayed gradients vs eager")
    # The new values must change the result, or the comparison above proves nothing.
    changed = any(not torch.equal(_bits(a), _bits(b)) for a, b in zip(first, eager[0]))
    assert changed, f"{name}: the fresh inputs gave the same outputs as the static ones"


def two_runs_bitwise_equal(case: Case, device, backend: str, T: int) -> None:
    inputs = case.make(0, torch.device(device), T)
    with moe_kernels.use_backend(backend):
        cot = cotangents(forward(case, inputs), 0)
        a = forward_backward(case, inputs, cot)
        b = forward_backward(case, inputs, cot)
    name = _name(case, backend)
    assert_bitwise(b[0], a[0], f"{name} second run's outputs")
    assert_bitwise(b[1], a[1], f"{name} second run's gradients")


def other_device_report(backend: str, home: str, other: str, names: list[str], T: int) -> list[dict]:
    """Each case on `other` while `home` is the current device, against the same call on `home`.

    One dict per case: {"case", "status": "ok" | "skip" | "fail", "detail"}. Stops at the first
    exception that is not an AssertionError (a CUDA error may be sticky: later cases would only
    repeat it)."""
    home_d, other_d = torch.device(home), torch.device(other)
    if home_d.type == "cuda":
        torch.cuda.set_device(home_d)
    same_model = home_d.type != "cuda" or (torch.cuda.get_device_name(home_d) == torch.cuda.get_device_name(other_d))
    report = []
    for name in names:
        case = CASES_BY_NAME[name]
        if not backends._available(case.op, backend, other_d.type):
            report.append({"case": name, "status": "skip", "detail": f"no {backend} kernel for {case.op}"})
            continue
        try:
            with moe_kernels.use_backend(backend):
                results = []
                for device in (other_d, home_d):
                    inputs = case.make(0, device, T)
                    cot = cotangents(forward(case, inputs), 0)
                    results.append(forward_backward(case, inputs, cot))
            (outs, grads), (home_outs, home_grads) = results
            for t in outs + grads:
                assert t.device == other_d, f"an output or gradient is on {t.device}, not {other_d}"
            for what, got, want in (("outputs", outs, home_outs), ("gradients", grads, home_grads)):
                got = tuple(t.to(home_d) for t in got)
                if same_model:
                    assert_bitwise(got, want, f"{name} {what} on {other} vs {home}")
                else:  # another GPU model may take other kernel configurations
                    for g, w in zip(got, want):
                        if g.is_floating_point():
                            assert_close(g, w)
                        else:
                            assert torch.equal(g, w), f"{name} {what}: indices differ"
            if other_d.type == "cuda":
                torch.cuda.synchronize(other_d)
            report.append({"case": name, "status": "ok", "detail": ""})
        except AssertionError as exc:
            report.append({"case": name, "status": "fail", "detail": str(exc)[:500]})
        except Exception as exc:
            report.append({"case": name, "status": "fail", "detail": f"{type(exc).__name__}: {str(exc)[:500]}"})
            break
    return report


# ----------------------------------------------------------------------------------------------
# 1 and 2: CUDA graphs and determinism, every op and GPU backend.

T_GRAPH, T_DETERMINISM = 2048, 4096


@gpu
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cuda_graph_replay_matches_eager(case, gpu_backend):
    require(case, gpu_backend, "cuda")
    static_replay_matches_eager(case, "cuda", gpu_backend, T_GRAPH, graph=True)


@gpu
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_two_runs_bitwise_equal(case, gpu_backend):
    require(case, gpu_backend, "cuda")
    two_runs_bitwise_equal(case, "cuda", gpu_backend, T_DETERMINISM)


# ----------------------------------------------------------------------------------------------
# 3: dispatch / combine past 2**31 elements.


def _free_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return free


def dispatch_combine_rows(device, backend: str, T: int, d: int, E: int, *, drop_every: int = 1000) -> None:
    """bf16 x [T, d], k = 1: token t goes to expert t % E, slot t // E, except every
    `drop_every`-th slot, dropped. The buffer is x's rows permuted (its last row, (E-1, C-1), is
    token T-1, at element offset (T-1) * d); combine brings them back weighted. Sampled rows (the
    first, the last, random ones and dropped ones) are compared with what the indices say, not
    with the reference (at T d > 2**31 that would need another 13 GB)."""
    device = torch.device(device)
    assert T % E == 0 and T > drop_every * E + 3
    C = T // E
    x = buffer = y = None
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(T, d, generator=gen, device=device, dtype=torch.bfloat16)
        t = torch.arange(T, device=device)
        experts = (t % E).view(T, 1)
        positions = torch.where((t // E) % drop_every == 0, -1, t // E).view(T, 1)
        weights = torch.exp2((t % 3).float() - 1).view(T, 1)  # 0.5, 1, 2: w * x exact in bf16
        with moe_kernels.use_backend(backend):
            buffer = ops.dispatch(x, experts, positions, E, C)
            y = ops.combine(buffer, experts, positions, weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        assert buffer.shape == (E, C, d) and y.shape == (T, d)
        sample = torch.cat(
            [
                torch.arange(8),
                torch.arange(T - 8, T),
                torch.randint(0, T, (64,), generator=torch.Generator().manual_seed(1)),
                torch.tensor([0, drop_every * E, drop_every * E + 3]),  # dropped tokens
            ]
        ).to(device)
        kept = positions[sample, 0] >= 0
        assert bool(kept[8:16].all()) and not bool(kept[-3:].any())  # the last tokens kept; dropped ones
        rows = buffer[experts[sample, 0], sample // E]  # [n, d]: each token's slot, kept or not
        expected_rows = torch.where(kept[:, None], x[sample], 0.0)
        assert torch.equal(rows, expected_rows), "dispatch: sampled buffer rows are not their tokens' rows (or 0)"
        assert torch.equal(buffer[E - 1, C - 1], x[T - 1]), "dispatch: the buffer's last row is not token T-1"
        # combine: one kept choice and a power-of-two weight, so y[t] = w[t] x[t] exactly; dropped: 0.
        expected_y = torch.where(kept[:, None], (weights[sample] * x[sample].float()).to(torch.bfloat16), 0.0)
        assert torch.equal(y[sample], expected_y), "combine: sampled rows differ from w * x (or 0 if dropped)"
    finally:
        del x, buffer, y
        if device.type == "cuda":
            torch.cuda.empty_cache()


@gpu
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
def test_dispatch_combine_beyond_int32_offsets(gpu_backend):
    """bf16 x [T, d] with T * d = 2**31 + 2**18 elements (4.3 GB), E = 4 (dispatch_combine_rows):
    the buffer's last rows and combine's last tokens sit past element offset 2**31."""
    for op in ("dispatch", "combine"):
        if not backends._available(op, gpu_backend, "cuda"):
            pytest.skip(f"{op} has no {gpu_backend} kernel for cuda tensors")
    if _free_bytes() < 24 * 2**30:
        pytest.skip(f"needs ~24 GiB of free GPU memory, {_free_bytes() / 2**30:.1f} GiB free")
    T, d, E = 2**19 + 64, 4096, 4
    assert T * d > 2**31 and (T - 1) * d > 2**31
    dispatch_combine_rows("cuda", gpu_backend, T, d, E)


# ----------------------------------------------------------------------------------------------
# 4: the routers agree at DeepSeek-V3's size.


def _excused_rows(logits: torch.Tensor, bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tol=1e-6):
    """Rows where experts a and b differ only at near ties of float64 choice values (docs/routers.md,
    Exactness: the backends' exp may differ in the last bit). A position is excused when its two
    experts' choice values differ by less than `tol` but are not equal (an exact tie must go to
    the lower index everywhere); a row whose 4th and 5th group scores are that close is excused
    whole (the groups themselves may differ). Returns [n] bool, one per row given."""
    choice = torch.sigmoid(logits.double()) + bias.double()  # [n, E]
    T, E = choice.shape
    g = DEEPSEEK_V3["num_groups"]
    top2 = choice.view(T, g, E // g).topk(2, dim=-1).values.sum(-1)
    ranked = top2.sort(dim=1, descending=True).values
    cut = DEEPSEEK_V3["topk_groups"]
    group_gap = ranked[:, cut - 1] - ranked[:, cut]
    group_near = (group_gap > 0) & (group_gap < tol)
    va, vb = choice.gather(1, a), choice.gather(1, b)
    gap = (va - vb).abs()
    ok_pos = (a == b) | ((gap > 0) & (gap < tol))
    return group_near | ok_pos.all(dim=1)


def deepseek_routers_agree(runs: list[tuple[str, str]], T: int, dtype: torch.dtype) -> None:
    """DeepSeek-V3's router (E = 256, k = 8) on the same [T, E] logits and bias for every
    (backend, device) of `runs`; each must pick the first run's experts in the same order, but for
    rows with a near tie of the float64 choice values (_excused_rows), at most max(1, T / 1000) of
    them; the weights of the rows where all agree to float32 tolerance. bf16 logits and a bias in
    steps of 1/64 make many exact ties, which every backend must give to the lower index."""
    E, k = 256, 8
    logits_cpu = torch.randn(T, E, generator=_gen(30)).to(dtype)
    bias_cpu = _deepseek_bias(30, E, "cpu")
    results = {}
    for backend, device in runs:
        with moe_kernels.use_backend(backend):
            w, e = ops.topk_router(logits_cpu.to(device), k, bias=bias_cpu.to(device), **DEEPSEEK_V3)
        results[f"{backend} on {device}"] = (w.cpu(), e.cpu())
    (base_name, (base_w, base_e)), *others = results.items()
    assert base_e.shape == (T, k) and base_e.dtype == torch.int64 and base_w.dtype == torch.float32
    all_same = torch.ones(T, dtype=torch.bool)
    for name, (_, e) in others:
        differ = (e != base_e).any(dim=1)
        if bool(differ.any()):
            rows = differ.nonzero()[:, 0]
            excused = _excused_rows(logits_cpu[rows], bias_cpu, base_e[rows], e[rows])
            bad = rows[~excused]
            assert bad.numel() == 0, (
                f"{name} vs {base_name}: experts differ on {bad.numel()} rows without a near tie, e.g. row "
                f"{int(bad[0])}: {e[bad[0]].tolist()} vs {base_e[bad[0]].tolist()}"
            )
            limit = max(1, T // 1000)
            assert rows.numel() <= limit, f"{name} vs {base_name}: {rows.numel()} rows differ at near ties"
        all_same &= ~differ
    for name, (w, _) in others:
        assert_close(w[all_same], base_w[all_same], msg=f"{name} vs {base_name}: weights")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_routers_agree_deepseek_v3(dtype):
    """T = 65536, E = 256, k = 8, sigmoid scores + a correction bias, 8 groups of which 4 are
    eligible (scored by their two best choice values), renormalised, times 2.5: Triton, CUDA and
    the C++ kernel (on a CPU copy) pick the same experts in the same order (deepseek_routers_agree)."""
    for backend in GPU_BACKENDS:
        if not backends._available("topk_router", backend, "cuda"):
            pytest.skip(f"topk_router has no {backend} kernel for cuda tensors")
    runs = [("triton", "cuda"), ("cuda", "cuda")]
    if backends._available("topk_router", "cpu", "cpu"):
        runs.append(("cpu", "cpu"))
    deepseek_routers_agree(runs, 65536, dtype)


# ----------------------------------------------------------------------------------------------
# 5: a second GPU.


def _second_device_main(backend: str, T: int) -> None:
    """Entry point of test_ops_on_second_device's subprocess: the report as one JSON line."""
    report = other_device_report(backend, "cuda:0", "cuda:1", CASE_IDS, T)
    print("REPORT " + json.dumps(report), flush=True)


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device (cuda:1)")
@pytest.mark.parametrize("gpu_backend", GPU_BACKENDS)
def test_ops_on_second_device(gpu_backend):
    """Every case with inputs on cuda:1 while cuda:0 is the current device: outputs and gradients
    on cuda:1, bitwise those of cuda:0 (same GPU model; to tolerance otherwise). In a subprocess:
    a Triton kernel launched on the current device with another device's pointers faults, and
    the fault is sticky."""
    code = (
        f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(HERE.parent / 'support')!r}]; import test_gpu; "
        f"test_gpu._second_device_main({gpu_backend!r}, 256)"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE.parents[1], capture_output=True, text=True, timeout=240, env=env
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, f"the subprocess gave no report (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(lines[-1][len("REPORT ") :])
    failed = [f"{r['case']}: {r['detail']}" for r in report if r["status"] == "fail"]
    done = {r["case"] for r in report}
    not_run = [name for name in CASE_IDS if name not in done]
    assert not failed, "on cuda:1:\n" + "\n".join(failed) + (f"\nnot run after that: {not_run}" if not_run else "")
    assert not not_run, f"cases not run: {not_run}"


# ----------------------------------------------------------------------------------------------
# CPU smoke forms (not GPU tests): the helpers above on CPU tensors with the pass's kernel
# backend ("cpu"; "triton" under TRITON_INTERPRET=1), so their code runs in every CI pass.

T_SMOKE = 24


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_smoke_static_replay_on_cpu(case, kernel_backend):
    require(case, kernel_backend, "cpu")
    static_replay_matches_eager(case, "cpu", kernel_backend, T_SMOKE, graph=False)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_smoke_two_runs_on_cpu(case, kernel_backend):
    require(case, kernel_backend, "cpu")
    two_runs_bitwise_equal(case, "cpu", kernel_backend, T_SMOKE)


def test_smoke_other_device_report_on_cpu(kernel_backend):
    report = other_device_report(kernel_backend, "cpu", "cpu", CASE_IDS, T_SMOKE)
    assert [r["case"] for r in report] == CASE_IDS
    assert all(r["status"] in ("ok", "skip") for r in report), report


def test_smoke_dispatch_combine_rows_on_cpu(kernel_backend):
    for op in ("dispatch", "combine"):
        if not backends._available(op, kernel_backend, "cpu"):
            pytest.skip(f"{op} has no {kernel_backend} kernel for cpu tensors")
    dispatch_combine_rows("cpu", kernel_backend, 4160, 8, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_smoke_routers_agree_on_cpu(kernel_backend, dtype):
    """The agreement check of test_routers_agree_deepseek_v3, the pass's kernel against the reference."""
    if not backends._available("topk_router", kernel_backend, "cpu"):
        pytest.skip(f"topk_router has no {kernel_backend} kernel for cpu tensors")
    T = 256 if INTERPRETING else 2048  # the interpreter runs ~8 ms a row
    deepseek_routers_agree([("torch", "cpu"), (kernel_backend, "cpu")], T, dtype)


def test_smoke_excused_rows():
    """_excused_rows: a differing position is excused at a near tie only, never at an exact tie."""
    E = 256
    logits = torch.zeros(1, E)
    bias = torch.zeros(E)
    bias[10], bias[11] = 0.5, 0.5 + 2e-7  # a near tie
    bias[20], bias[21] = 0.4, 0.4  # an exact tie
    base = torch.tensor([[11, 10, 20, 21, 0, 1, 2, 3]])
    swapped_near = torch.tensor([[10, 11, 20, 21, 0, 1, 2, 3]])
    swapped_exact = torch.tensor([[11, 10, 21, 20, 0, 1, 2, 3]])
    assert bool(_excused_rows(logits, bias, base, swapped_near)[0])
    assert not bool(_excused_rows(logits, bias, base, swapped_exact)[0])
    assert bool(_excused_rows(logits, bias, base, base)[0])
