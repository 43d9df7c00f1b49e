"""The GPU benchmarks: every op's kernels on a CUDA device against the same torch sequence run eagerly
and under torch.compile, and against copy_ of the same number of bytes, all measured in one run.

For each op, shape and backend (triton, cuda: whichever the op has), one row of

    op, config, backend, ms, gbps, copy_gbps, vs_torch, vs_compile

into <out>/gpu-<device>.csv (and a markdown table, <out>/bench.md): `ms` the kernel time of one
call, `gbps` the op's bytes-moved model (below, per case) over `ms`, `copy_gbps` torch's copy_ of
the same number of bytes (half read, half written: the practical limit for that much traffic,
measured in the same run), `vs_torch` / `vs_compile` the time of the op's torch sequence (its
reference, moe_kernels.reference) eager / compiled (dynamic=False) over ours, `kernels` where the
call's device time goes (moe_kernels.bench.kernel_times: each kernel's time a call in a
torch.profiler run of a few eager calls, its share, and its launches a call where not one).

Timing (time_gpu in moe_kernels/bench/timing.py): `calls` calls captured in one CUDA graph and
replayed between two CUDA events, the median over rounds, so a kernel of a few microseconds is timed
and not its launch;
a function that cannot be captured (the torch sequences with boolean-mask indexing sync with the
host) is timed as `calls` eager calls between the two events instead, and the row says "loop".

    python3 bench/gpu_bench.py --out DIR [--grid quick|goals|full] [--backend triton|cuda] [--ops topk_router ...]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_goals  # noqa: E402
from common import time_gpu  # noqa: E402

import moe_kernels  # noqa: E402
from moe_kernels import backends, reference  # noqa: E402
from moe_kernels import ops as K  # noqa: E402
from moe_kernels.bench import kernel_times, timing  # noqa: E402

# Where the cases' tensors live: "cuda", or "cpu" for --smoke (each case called once, untimed).
DEV = "cuda"
COLUMNS = ["op", "config", "backend", "ms", "gbps", "copy_gbps", "vs_torch", "vs_compile", "method", "kernels"]
SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass
class Case:
    """One op at one shape: `ours(*args)` (run under each backend), `torch_seq(*args)` the same
    result by the reference, `bytes_moved` the op's bytes-moved model for that call."""

    op: str
    config: str
    bytes_moved: int
    make: Callable[[], tuple]
    ours: Callable
    torch_seq: Callable
    # The registered op whose backends time `ours` (a composed op's kernel), if not `op`.
    kernel_op: str = ""


# The output gradient of the latest fwd+bwd shape (_grad_of): one tensor at a time, so a case's
# ones are freed when the next case's shape comes.
_ONES: dict[tuple, torch.Tensor] = {}


@torch.compiler.disable
def _ones_for(y: torch.Tensor) -> torch.Tensor:
    """A tensor of ones like y, made at the first call of y's shape and kept. Outside torch.compile's
    graphs (a graph break, where the backward's autograd.grad breaks anyway): a graph of the torch
    sequence is then the same whether the ones exist yet or not, so gpu-check's warm compiles in
    another process fill the caches the timed compile pass reads."""
    key = (tuple(y.shape), y.dtype, y.device)
    if key not in _ONES:
        _ONES.clear()
        _ONES[key] = torch.ones_like(y)
    return _ONES[key]


def _grad_of(fn: Callable, *, wrt: tuple[int, ...] = (0,), out: int = 0) -> Callable:
    """fwd+bwd: fn's output `out` (a tensor or a tuple member) back-propagated with ones into the args
    at `wrt`.

    The ones are made at the first call of an output shape and kept (the timing's warm-up calls
    make them; _ones_for), so a timed call is the op's forward and backward: a fresh tensor of ones
    filled in every call would be timed with them, an extra write of the whole output that the
    bytes-moved models do not count (at dispatch's [E, C, d] buffer, as many bytes as the
    backward's own)."""

    def run(*args):
        result = fn(*args)
        y = result[out] if isinstance(result, tuple) else result
        return torch.autograd.grad(y, [args[i] for i in wrt], _ones_for(y))

    return run


def routers(T: int, dtype: torch.dtype, modes: tuple[str, ...]) -> list[Case]:
    """topk_router: Mixtral (softmax, E = 8, k = 2), Qwen3-MoE (softmax, E = 128, k = 8),
    DeepSeek-V3 (sigmoid + bias, 8 groups, top-4 groups, E = 256, k = 8); plus topk_softmax (the
    router through its wrapper).
    Forward model: read the logits, write float32 weights and int64 experts; fwd+bwd adds reading
    the weights' gradient and writing the logits' gradient."""
    s = SIZE[dtype]
    models = {
        "mixtral": (8, 2, dict(renormalize=True)),
        "qwen3": (128, 8, dict(renormalize=True)),
        "deepseek-v3": (
            256,
            8,
            dict(scoring="sigmoid", num_groups=8, topk_groups=4, renormalize=True, scaling_factor=2.5),
        ),
    }
    cases = []
    for name, (E, k, kw) in models.items():
        for mode in modes:
            grad = mode == "fwd+bwd"

            def make(E=E, grad=grad, kw=kw):
                logits = torch.randn(T, E, device=DEV, dtype=dtype, requires_grad=grad)
                bias = torch.randn(E, device=DEV) * 0.1 if "num_groups" in kw else None
                return (logits, bias)

            def ours(logits, bias, k=k, kw=kw):
                return K.topk_router(logits, k, bias=bias, **kw)

            def seq(logits, bias, k=k, kw=kw):
                return reference.topk_router(logits, k, bias=bias, **_ref_kwargs(kw))

            fwd = T * E * s + T * k * 12
            moved = fwd + (T * k * 4 + T * E * s if grad else 0)
            f_ours, f_seq = (_grad_of(ours), _grad_of(seq)) if grad else (ours, seq)
            config = f"{name} {mode} T={T} E={E} k={k} {str(dtype)[6:]}"
            cases.append(Case("topk_router", config, moved, make, f_ours, f_seq))
    for E, k in ((64, 2), (128, 8)):
        for mode in modes:
            grad = mode == "fwd+bwd"

            def make(E=E, grad=grad):
                return (torch.randn(T, E, device=DEV, dtype=dtype, requires_grad=grad),)

            def ours(logits, k=k):
                return K.topk_softmax(logits, k)

            def seq(logits, k=k):
                return reference.topk_softmax(logits, k)

            moved = T * E * s + T * k * (s + 8) + ((T * k * s + T * E * s) if grad else 0)
            f_ours, f_seq = (_grad_of(ours), _grad_of(seq)) if grad else (ours, seq)
            config = f"topk_softmax {mode} T={T} E={E} k={k} {str(dtype)[6:]}"
            cases.append(Case("topk_router", config, moved, make, f_ours, f_seq))  # its wrapper
    return cases


def _ref_kwargs(kw: dict) -> dict:
    """The public op's keyword defaults, spelled out for the reference (which has no defaults)."""
    full = dict(scoring="softmax", num_groups=1, topk_groups=None, group_scoring="top2_sum")
    full.update(renormalize=False, scaling_factor=1.0)
    full.update(kw)
    if full["topk_groups"] is None:
        full["topk_groups"] = full["num_groups"]
    return full


def routing(T: int, E: int, k: int, *, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, int]:
    """experts [T, k] (k distinct experts per token, by a random top k), their weights, capacity C
    (capacity factor 1.25)."""
    scores = torch.rand(T, E, device=DEV)
    weights, experts = torch.topk(scores, k, dim=1)
    return experts, weights.softmax(-1), K.capacity_for(T, E, k, 1.25)


def maps(T: int, E: int, k: int) -> list[Case]:
    """capacity_positions: read the ids, write the positions (and the counts)."""

    def make():
        experts, _, C = routing(T, E, k)
        return (experts, C)

    def ours(experts, C):
        return K.capacity_positions(experts, E, C)

    def seq(experts, C):
        return reference.capacity_positions(experts, E, C)

    return [Case("capacity_positions", f"T={T} E={E} k={k}", T * k * 16 + E * 8, make, ours, seq)]


def rows(T: int, d: int, E: int, k: int, modes: tuple[str, ...], dtype=torch.bfloat16) -> list[Case]:
    """dispatch / combine / permute / unpermute at [T, d], k choices over E experts.
    Models: dispatch reads x once and writes the whole [E, C, d] buffer (unfilled slots are
    zeros); combine reads the T k chosen rows and writes y; permute reads x once and writes T k
    rows; unpermute reads T k rows and writes y. The ids and weights are counted too. fwd+bwd
    differentiates what a training step does (x; the buffer or y_sorted and the weights) and adds
    the backward's own minimum: the gradient read and the input gradients written, and for the
    weights' gradient the T k chosen rows read again."""
    s = SIZE[dtype]
    cases = []
    for mode in modes:
        grad = mode == "fwd+bwd"

        def make_dispatch(grad=grad):
            experts, weights, C = routing(T, E, k)
            positions, _ = reference.capacity_positions(experts, E, C)
            x = torch.randn(T, d, device=DEV, dtype=dtype, requires_grad=grad)
            return (x, experts, positions, C)

        def ours_dispatch(x, experts, positions, C):
            return K.dispatch(x, experts, positions, E, C)

        def seq_dispatch(x, experts, positions, C):
            return reference.dispatch(x, experts, positions, E, C)

        C = K.capacity_for(T, E, k, 1.25)
        ids = T * k * 16
        fwd = T * d * s + E * C * d * s + ids
        moved = fwd + ((E * C * d * s + T * d * s) if grad else 0)
        pair = (_grad_of(ours_dispatch), _grad_of(seq_dispatch)) if grad else (ours_dispatch, seq_dispatch)
        config = f"{mode} T={T} d={d} E={E} k={k} {str(dtype)[6:]}"
        cases.append(Case("dispatch", config, moved, make_dispatch, *pair))

        def make_combine(grad=grad):
            experts, weights, C = routing(T, E, k)
            positions, _ = reference.capacity_positions(experts, E, C)
            buffer = torch.randn(E, C, d, device=DEV, dtype=dtype, requires_grad=grad)
            return (buffer, experts, positions, weights.to(dtype).requires_grad_(grad))

        fwd = T * k * d * s + T * d * s + ids + T * k * s
        # The backward also reads the kept rows again for the weights' gradient, and writes it.
        moved = fwd + ((T * d * s + E * C * d * s + T * k * d * s + T * k * s) if grad else 0)
        wrt = (0, 3)  # the buffer and the weights, as a training step differentiates them
        pair = (
            (_grad_of(K.combine, wrt=wrt), _grad_of(reference.combine, wrt=wrt))
            if grad
            else (K.combine, reference.combine)
        )
        cases.append(Case("combine", config, moved, make_combine, *pair))

        def make_permute(grad=grad):
            experts, weights, _ = routing(T, E, k)
            x = torch.randn(T, d, device=DEV, dtype=dtype, requires_grad=grad)
            return (x, experts)

        def ours_permute(x, experts):
            return K.permute(x, experts, E)

        def seq_permute(x, experts):
            return reference.permute(x, experts, E)

        fwd = T * d * s + T * k * d * s + T * k * 24
        moved = fwd + ((T * k * d * s + T * d * s) if grad else 0)
        pair = (_grad_of(ours_permute), _grad_of(seq_permute)) if grad else (ours_permute, seq_permute)
        cases.append(Case("permute", config, moved, make_permute, *pair))

        def make_unpermute(grad=grad):
            experts, weights, _ = routing(T, E, k)
            x = torch.randn(T, d, device=DEV, dtype=dtype)
            _, _, order = reference.permute(x, experts, E)
            y_sorted = torch.randn(T * k, d, device=DEV, dtype=dtype, requires_grad=grad)
            return (y_sorted, order, weights.to(dtype).requires_grad_(grad), T)

        fwd = T * k * d * s + T * d * s + T * k * (8 + s)
        moved = fwd + ((T * d * s + 2 * T * k * d * s + T * k * s) if grad else 0)
        wrt = (0, 2)  # y_sorted and the weights
        pair = (
            (_grad_of(K.unpermute, wrt=wrt), _grad_of(reference.unpermute, wrt=wrt))
            if grad
            else (K.unpermute, reference.unpermute)
        )
        cases.append(Case("unpermute", config, moved, make_unpermute, *pair))
    return cases


def batchwise(T: int, E: int, k: int = 2, dtype=torch.bfloat16) -> list[Case]:
    """batchwise_mask: each expert keeps its m = T k / E best tokens; read the scores, write a bool mask."""
    m = max(1, T * k // E)

    def make():
        return (torch.randn(T, E, device=DEV, dtype=dtype),)

    def ours(scores):
        return K.batchwise_mask(scores, m)

    def seq(scores):
        return reference.batchwise_mask(scores, m)

    return [Case("batchwise_mask", f"T={T} E={E} m={m} {str(dtype)[6:]}", T * E * (SIZE[dtype] + 1), make, ours, seq)]


def gate_math(T: int, E: int, k: int) -> list[Case]:
    """load_probabilities, noisy_topk_gate (forward; float32), smooth_step, dselect_k: the ops with
    no GPU speed goal, one shape each so every kernel's speed is on record."""

    def make3():
        return tuple(torch.randn(T, E, device=DEV) for _ in range(2)) + (torch.rand(T, E, device=DEV) + 0.1,)

    def ours_lp(clean, noisy, std):
        return K.load_probabilities(clean, noisy, std, k)

    def seq_lp(clean, noisy, std):
        return reference.load_probabilities(clean, noisy, std, k)

    def ours_gate(clean, raw, noise):
        return K.noisy_topk_gate(clean, raw, noise, k)

    def seq_gate(clean, raw, noise):
        return reference.noisy_topk_gate(clean, raw, noise, k, 1e-2, None)

    n = T * E

    def make_t():
        return (torch.randn(n, device=DEV),)

    def ours_step(t):
        return K.smooth_step(t, 1.0)

    def seq_step(t):
        return reference.smooth_step(t, 1.0)

    B, n_experts, kk = T, 64, 4
    m = 6

    def make_ds():
        return (torch.randn(B, kk, device=DEV), torch.randn(B, kk, m, device=DEV))

    def ours_ds(alpha, z):
        return K.dselect_k(alpha, z, n_experts, 1.0)

    def seq_ds(alpha, z):
        return reference.dselect_k(alpha, z, n_experts, 1.0)

    cfg = f"T={T} E={E} k={k} float32"
    return [
        Case("load_probabilities", cfg, 4 * n * 4, make3, ours_lp, seq_lp),
        Case("noisy_topk_gate", cfg, 3 * n * 4 + T * k * 12 + E * 4, make3, ours_gate, seq_gate, "load_probabilities"),
        Case("smooth_step", f"n={n} float32", 8 * n, make_t, ours_step, seq_step),
        Case(
            "dselect_k",
            f"B={B} n={n_experts} k={kk} float32",
            B * kk * (m + 1) * 4 + B * n_experts * 4,
            make_ds,
            ours_ds,
            seq_ds,
        ),
    ]


GRIDS = ("quick", "goals", "full")


def grid(kind: str, smoke: bool = False) -> list[Case]:
    """The cases of a grid: "quick" (a few shapes per op at sizes that run from L2), "goals" (one
    shape per row of issue 33's goals, at the sizes the goals name: make gpu-check's default),
    "full" (issue 33's shapes, slow), or --smoke's tiny one."""
    if smoke:
        return (
            routers(64, torch.bfloat16, ("fwd", "fwd+bwd"))
            + maps(64, 16, 2)
            + rows(32, 16, 8, 2, ("fwd", "fwd+bwd"))
            + batchwise(64, 8)
            + gate_math(32, 8, 2)
        )
    if kind == "quick":
        return (
            routers(65536, torch.bfloat16, ("fwd", "fwd+bwd"))
            + maps(65536, 256, 8)
            + rows(16384, 4096, 64, 8, ("fwd", "fwd+bwd"))
            + batchwise(65536, 64)
            + gate_math(16384, 64, 2)
        )
    if kind == "goals":
        return (
            routers(262144, torch.bfloat16, ("fwd", "fwd+bwd"))
            + routers(262144, torch.float32, ("fwd",))
            + maps(1048576, 8, 8)
            + maps(1048576, 64, 8)
            + maps(1048576, 256, 8)
            + rows(16384, 7168, 64, 8, ("fwd", "fwd+bwd"))
            + rows(65536, 2048, 64, 2, ("fwd", "fwd+bwd"))
            + batchwise(1048576, 256)
        )
    if kind != "full":
        raise ValueError(f"grid: kind must be one of {GRIDS}, got {kind!r}")
    cases: list[Case] = []
    for T in (16384, 262144, 1048576):
        for dtype in (torch.bfloat16, torch.float32):
            cases += routers(T, dtype, ("fwd", "fwd+bwd"))
    for T, k in ((65536, 2), (65536, 8), (1048576, 2), (1048576, 8)):
        for E in (8, 64, 256):
            cases += maps(T, E, k)
    for d in (2048, 7168):
        for k in (2, 8):
            cases += rows(16384 if k == 8 else 65536, d, 64, k, ("fwd", "fwd+bwd"))
    for T in (65536, 1048576):
        for E in (64, 256):
            cases += batchwise(T, E)
    return cases + gate_math(65536, 64, 2)


# balanced_assignment's cases (issue 33: the CUDA solver against the CPU solver on the same machine):
# randn scores at the goal's shapes, and all-equal scores (a router's zero logits at initialisation,
# where the device auction's earlier two-phase schedule fought a price war: 31,872 bidding
# iterations by the host emulation's count).
ASSIGNMENT_SHAPES = ((8192, 64, "randn"), (16384, 128, "randn"), (8192, 64, "equal"))


def assignment_rows(kind: str, smoke: bool = False) -> list[dict]:
    """balanced_assignment's CUDA solver (exact, the default for CUDA tensors) against the C++ CPU
    solver on the same scores (ASSIGNMENT_SHAPES), on this machine's cores: `ms` the CUDA solve
    (eager calls between two events: the solve reads its done flag on the host, so no graph),
    `vs_torch` the CPU solver's median time over it; `method` says whether the objectives agree
    (each is exactly optimal, so equal values up to float64 rounding of the sum). No bytes model:
    gbps and copy_gbps stay empty. --smoke runs the rows' code with the CPU solver in the CUDA
    solver's place, on a small shape."""
    shapes = ((256, 8, "randn"),) if smoke else ASSIGNMENT_SHAPES[:1] if kind == "quick" else ASSIGNMENT_SHAPES
    cpu = "cpu" if backends._available("balanced_assignment", "cpu", "cpu") else "torch"
    out = []
    for n, k, scores_kind in shapes:
        if scores_kind == "equal":
            scores = torch.zeros(n, k)
        else:
            scores = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
        with moe_kernels.use_backend(cpu):
            _, cpu_value, _ = K.balanced_assignment(scores, return_distances=True)
            cpu_s = statistics.median(timing.timeit(lambda: K.balanced_assignment(scores), reps=5, min_time=0.5))
        on_device = scores.to(DEV)
        with moe_kernels.use_backend("cuda" if DEV == "cuda" else cpu):
            _, value, _ = K.balanced_assignment(on_device, return_distances=True)
            if DEV == "cuda":
                seconds, method = time_gpu(lambda: K.balanced_assignment(on_device), graph=False)
            else:
                seconds, method = cpu_s, "host"
        gap = abs(float(value) - float(cpu_value))
        agree = gap <= 1e-9 * max(1.0, abs(float(cpu_value)))
        row = {
            "op": "balanced_assignment",
            "config": f"n={n} k={k} float32 {scores_kind} (vs: the CPU solver, {os.cpu_count()} cores)",
            "backend": "cuda",
            "ms": f"{seconds * 1e3:.4f}",
            "gbps": "",
            "copy_gbps": "",
            "vs_torch": f"{cpu_s / seconds:.2f}",
            "vs_compile": "",
            "method": f"{method}; objective {'equal' if agree else f'differs by {gap:.3g}'}",
        }
        print(
            f"  balanced_assignment n={n} k={k} {scores_kind} cuda {row['ms']} ms, x{row['vs_torch']} the CPU solver, "
            f"{row['method']}"
        )
        out.append(row)
    return out


def gpu_backends(op: str) -> list[str]:
    """The backends with a kernel of `op` for CUDA tensors in this process, opt-in ones included."""
    return [b for b in ("triton", "cuda") if backends._available(op, b, "cuda")]


def under(backend: str | None, fn: Callable) -> Callable:
    if backend is None:
        return fn

    def run(*args):
        with moe_kernels.use_backend(backend):
            return fn(*args)

    return run


def copy_gbps(nbytes: int, cache: dict) -> float:
    """GB/s of copy_ moving `nbytes` (half read, half written), float32 tensors."""
    n = max(1, nbytes // 8)
    if n not in cache:
        src, dst = torch.ones(n, device=DEV), torch.empty(n, device=DEV)
        seconds, _ = time_gpu(lambda: dst.copy_(src))
        cache[n] = 8 * n / seconds / 1e9
        del src, dst
    return cache[n]


def run_case(case: Case, chosen: list[str] | None, copies: dict) -> list[dict]:
    """One row per backend of `case`: ours, the torch sequence eager, copy_ of the same bytes (the
    torch.compile ratio is added by add_compiled, in a second pass, and the kernels column by
    add_profile, in a third)."""
    args = case.make()
    torch_s, torch_method = time_gpu(lambda: case.torch_seq(*args))
    copy = copy_gbps(case.bytes_moved, copies)
    out = []
    for backend in gpu_backends(case.kernel_op or case.op):
        if chosen and backend not in chosen:
            continue
        fn = under(backend, case.ours)
        try:
            seconds, method = time_gpu(lambda fn=fn: fn(*args))
        except Exception as exc:
            print(f"  {case.op} {case.config} [{backend}] failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            torch.cuda.synchronize()
            continue
        gbps = case.bytes_moved / seconds / 1e9
        row = {
            "op": case.op,
            "config": case.config,
            "backend": backend,
            "ms": f"{seconds * 1e3:.4f}",
            "gbps": f"{gbps:.1f}",
            "copy_gbps": f"{copy:.1f}",
            "vs_torch": f"{torch_s / seconds:.2f}",
            "vs_compile": "",
            "method": method if method == torch_method else f"{method} (torch: {torch_method})",
            "kernels": "",
        }
        print(
            f"  {case.op:<20} {case.config:<44} {backend:<7} {row['ms']:>9} ms {row['gbps']:>8} GB/s "
            f"({gbps / copy:.0%} of copy) x{row['vs_torch']} torch",
            flush=True,
        )
        out.append(row)
    return out


def add_profile(case: Case, rows: list[dict]) -> None:
    """The kernels column of `rows` (the case's rows), each backend's call profiled on new inputs.
    Last of the passes: every timing is taken before the profiler first starts (CUPTI attached to
    the process, or started and stopped beside captured CUDA graphs, must not touch them)."""
    args = case.make()
    for row in rows:
        row["kernels"] = profile_row(under(row["backend"], case.ours), args)
        print(f"  {case.op:<20} {case.config:<44} {row['backend']:<7} {row['kernels']}", flush=True)


def profile_order(by_case: list) -> list:
    """by_case's (case, rows) in the order the profile pass takes them: the cases with a row that
    misses its issue-33 goal first (their kernels' times are the bounds the op docs must state,
    and a device call cut at its limit keeps the profiles taken so far), then the rest, each group
    in grid order."""

    def misses(rows: list[dict]) -> bool:
        return any((gpu_goals.verdict(r) or ("", ""))[1] == "not met" for r in rows)

    return sorted(by_case, key=lambda item: not misses(item[1]))


def profile_row(fn: Callable, args: tuple) -> str:
    """kernel_times' summary of fn(*args) on DEV; a profile that fails says why in its place (the
    timing stands without it)."""
    try:
        return kernel_times.summary(kernel_times.kernel_times(lambda: fn(*args), device=DEV))
    except Exception as exc:
        return f"profile failed: {type(exc).__name__}: {str(exc)[:200]}"


def add_compiled(case: Case, rows: list[dict]) -> None:
    """vs_compile of `rows` (the case's rows): torch.compile(dynamic=False) of the torch sequence,
    its compile (the first call) left out of the timing."""
    args = case.make()
    try:
        compiled = torch.compile(case.torch_seq, dynamic=False)
        compiled(*args)
        seconds, _ = time_gpu(lambda: compiled(*args))
    except Exception as exc:  # a torch sequence torch.compile cannot take: no ratio, the reason printed
        print(f"  torch.compile of {case.op} {case.config} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return
    finally:
        torch._dynamo.reset()
    for row in rows:
        row["vs_compile"] = f"{seconds / (float(row['ms']) / 1e3):.2f}"
        print(f"  {case.op:<20} {case.config:<44} {row['backend']:<7} x{row['vs_compile']} compile", flush=True)


def compile_pass(by_case: list, deadline: float, warmed: set[str] | None, save: Callable[[], None]) -> None:
    """torch.compile baselines, after every case has its row: add_compiled of each case with rows
    until `deadline` (time.monotonic()) passes. Beside a warm-up (`warmed`), only the cases it
    compiled: they come from torch's caches in seconds, where a cold compile took from 15 s to
    more than 130 s a case on the H200 beside the tests, and one left the profile pass no time."""
    for case, case_rows in by_case:
        if not case_rows:
            continue
        if warmed is not None and case_key(case) not in warmed:
            print(f"  {case.op} {case.config}: not compiled by the warm-up: no vs_compile", flush=True)
            continue
        if time.monotonic() > deadline:
            print("  compile budget spent: the remaining rows have no vs_compile", flush=True)
            break
        add_compiled(case, case_rows)
        torch.cuda.empty_cache()
        save()


def markdown(rows: list[dict], device: str) -> str:
    lines = [
        f"## Benchmarks on {device}\n",
        "Kernel time of one call (CUDA-graph replay; `loop`: eager calls between two events), the op's "
        "bytes-moved model over it, copy_ of as many bytes in the same run, and the torch sequence's "
        "time (eager, torch.compile) over ours.\n",
        "| op | config | backend | ms | GB/s | copy_ GB/s | of copy | vs torch | vs compile | timing |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['config']} | {r['backend']} | {r['ms']} | {r['gbps'] or '-'} | "
            f"{r['copy_gbps'] or '-'} | {gpu_goals.share_text(r)} | {r['vs_torch']} | "
            f"{r['vs_compile'] or '-'} | {r['method']} |"
        )
    profiled = [r for r in rows if r.get("kernels")]
    if profiled:
        lines += [
            "\n### Where the time goes\n",
            "Device time a call by kernel (torch.profiler over eager calls): the kernels' time alone, so "
            "the table's `ms` less the total is about the gaps between them:\n",
        ]
        lines += [f"- {r['op']} {r['config']} [{r['backend']}]: {r['kernels']}" for r in profiled]
    lines += gpu_goals.markdown(rows)
    return "\n".join(lines) + "\n"


def smoke() -> int:
    """Every case of a tiny grid called once on CPU tensors (ours with this process's backend, and
    the torch sequence), and ours profiled (kernel_times on the CPU's operators, where a GPU run
    profiles each backend's kernels): the cases' inputs, signatures and gradients hold together
    (python_tests/bench/test_gpu_check.py)."""
    global DEV
    DEV = "cpu"
    cases = grid("full", smoke=True)
    for case in cases:
        gpu_backends(case.kernel_op or case.op)  # a registered op's name, or the GPU run fails here
        args = case.make()
        case.ours(*args)
        case.torch_seq(*args)
        kernels = profile_row(case.ours, args)
        if kernels.startswith("profile failed"):
            raise RuntimeError(f"{case.op} {case.config}: {kernels}")
    rows = assignment_rows("full", smoke=True)
    markdown(rows, "smoke")
    print(f"gpu_bench --smoke: {len(cases)} cases and {len(rows)} assignment row ran on CPU tensors")
    return 0


def case_key(case: Case) -> str:
    """A case's line in the --warmed file."""
    return f"{case.op} {case.config}"


def warmed_cases(path: str | None) -> set[str] | None:
    """The cases a --warm-compile run listed in `path` as compiled (None: no list, compile all)."""
    if path is None:
        return None
    file = Path(path)
    return set(file.read_text().splitlines()) if file.exists() else set()


def warm_compile(kind: str, ops: list[str] | None, warmed: str | None = None) -> int:
    """torch.compile of each case's torch sequence, called once, in the order the compile pass
    takes them: torch's on-disk caches then hold the compiled graphs for that pass (make
    gpu-check runs this beside its tests). Untimed; a case torch.compile cannot take is skipped.
    Each case compiled is appended to `warmed` (case_key), which the compile pass reads."""
    if not torch.cuda.is_available():
        print("gpu_bench --warm-compile: no CUDA device: nothing to compile")
        return 0
    start = time.monotonic()
    for case in (c for c in grid(kind) if not ops or c.op in ops):
        began = time.monotonic()
        try:
            args = case.make()
            torch.compile(case.torch_seq, dynamic=False)(*args)
            print(f"  compiled {case.op} {case.config} in {time.monotonic() - began:.1f} s", flush=True)
            if warmed is not None:
                with open(warmed, "a") as f:
                    f.write(case_key(case) + "\n")
        except Exception as exc:  # the compile pass reports it; here it only costs the cache
            print(f"  {case.op} {case.config}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        finally:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    print(f"gpu_bench --warm-compile: done in {time.monotonic() - start:.0f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--grid", choices=GRIDS, default="full", help="which shapes (grid()); default full")
    parser.add_argument("--quick", action="store_true", help="--grid quick")
    parser.add_argument("--backend", action="append", choices=("triton", "cuda"), help="time only this backend")
    parser.add_argument("--ops", nargs="*", help="only these ops")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--no-profile", action="store_true", help="leave the kernels column empty (no torch.profiler)")
    parser.add_argument(
        "--compile-budget", type=float, default=1e9, help="seconds into the run after which no more compiles start"
    )
    parser.add_argument("--smoke", action="store_true", help="every case once on tiny CPU tensors, untimed")
    parser.add_argument(
        "--warm-compile", action="store_true", help="compile each case's torch sequence once, into torch's caches"
    )
    parser.add_argument(
        "--warmed",
        metavar="FILE",
        help="the cases --warm-compile compiled, one a line (it appends; the compile pass takes only these)",
    )
    args = parser.parse_args(argv)
    kind = "quick" if args.quick else args.grid
    if args.smoke:
        return smoke()
    if args.warm_compile:
        return warm_compile(kind, args.ops, args.warmed)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device (torch.cuda.is_available() is False): nothing to time")
        return 0
    from gpu_check import device_slug

    name = torch.cuda.get_device_name()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / f"gpu-{device_slug(name)}.csv"
    rows: list[dict] = []
    by_case: list[tuple[Case, list[dict]]] = []
    copies: dict = {}
    failed = 0
    start = time.monotonic()

    def save():  # rewritten after every case: a run cut off keeps its rows
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        (out / "bench.md").write_text(markdown(rows, f"{name}, torch {torch.__version__}, {os.cpu_count()} cores"))

    cases = [c for c in grid(kind) if not args.ops or c.op in args.ops]
    for case in cases:
        try:
            case_rows = run_case(case, args.backend, copies)
        except Exception as exc:  # one case's failure (e.g. out of memory) must not lose the others
            failed += 1
            print(f"  {case.op} {case.config}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            case_rows = []
        rows += case_rows
        by_case.append((case, case_rows))
        torch.cuda.empty_cache()
        save()
    if not args.ops or "balanced_assignment" in args.ops:
        try:
            rows += assignment_rows(kind)
        except Exception as exc:
            failed += 1
            print(f"  balanced_assignment: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        save()
    if not args.no_compile:
        compile_pass(by_case, start + args.compile_budget, warmed_cases(args.warmed), save)
    # The kernels of each call last (add_profile): every timing above is taken before the profiler
    # first starts. The cases that miss a goal first.
    for case, case_rows in profile_order(by_case):
        if args.no_profile or not case_rows:
            continue
        try:
            add_profile(case, case_rows)
        except Exception as exc:  # e.g. out of memory for new inputs: the rows keep their times
            print(f"  profile of {case.op} {case.config}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        torch.cuda.empty_cache()
        save()
    print(f"{len(rows)} rows in {time.monotonic() - start:.0f} s -> {csv_path}; {failed} cases failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
