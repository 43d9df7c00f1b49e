"""The backend registry: one place decides, forced choices are honoured or refused loudly."""

import os
import subprocess
import sys

import pytest
import torch

import moe_kernels
from moe_kernels import _extension, backends


def test_extension_is_built_when_required():
    """`make test` sets MOE_KERNELS_REQUIRE_EXTENSION=1: CI must test the C++ kernels, not
    silently fall back to the reference."""
    if os.environ.get("MOE_KERNELS_REQUIRE_EXTENSION") == "1":
        assert _extension.LOADED, _extension.LOAD_ERROR


def test_summary_names_every_op_and_device():
    summary = moe_kernels.backends()
    assert "topk_router" in summary
    assert "topk_softmax" not in summary  # a thin function over topk_router, not an op of its own
    for row in summary.values():
        assert set(row) == {"cpu", "cuda", "cpu float64", "cuda float64", "why"}
        assert row["cpu"] in backends.BACKENDS
        assert row["cuda"] in (*backends.BACKENDS, "unavailable")
    if not torch.cuda.is_available():
        assert all(row["cuda"] == "unavailable" for row in summary.values())


def test_default_cpu_choice():
    expected = "cpu" if _extension.LOADED else "torch"
    if backends.forced() is None:
        assert backends.choose("topk_router", "cpu") == expected


def test_use_backend_is_scoped():
    with moe_kernels.use_backend("torch"):
        assert backends.choose("topk_router", "cpu") == "torch"
    assert backends.forced() is None or os.environ.get("MOE_KERNELS_BACKEND")


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ValueError, match="valid names"):
        with moe_kernels.use_backend("fortran"):
            pass


def test_unavailable_backend_is_an_error():
    with moe_kernels.use_backend("cuda"):
        with pytest.raises(ValueError, match="valid names for cpu"):
            moe_kernels.ops.topk_softmax(torch.randn(3, 4), 1)


def test_unknown_op():
    with pytest.raises(ValueError, match="unknown op"):
        backends.choose("no_such_op", "cpu")


@pytest.mark.parametrize("name", ["torch", "cpu", "bogus"])
def test_environment_override(name):
    """MOE_KERNELS_BACKEND is read at call time, in a fresh process so no state leaks."""
    code = (
        "import torch, moe_kernels; print(moe_kernels.backends()['topk_router']['cpu']); "
        "moe_kernels.ops.topk_softmax(torch.randn(2, 3), 1)"
    )
    env = {**os.environ, "MOE_KERNELS_BACKEND": name}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if name == "bogus":
        assert out.returncode != 0 and "valid names" in out.stderr
    elif name == "cpu" and not _extension.LOADED:
        assert out.returncode != 0 and "valid names" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == name


def test_opt_in_backend_runs_only_when_forced(monkeypatch):
    # A kernel registered opt-in is never the default for its device, even where the extension has
    # it, but a forced backend gets it. No op is opt-in at present: a stand-in op is registered.
    import types

    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: True)
    monkeypatch.delenv("MOE_KERNELS_BACKEND", raising=False)
    monkeypatch.setitem(backends._REGISTRY, "opt_in_stand_in", None)
    backends.register("opt_in_stand_in", torch=lambda: "torch", cuda=lambda: "cuda", opt_in=("cuda",))
    assert backends.choose("opt_in_stand_in", "cuda") == "torch"
    cuda_tensor = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)  # no GPU needed
    assert backends.fallback("opt_in_stand_in", "triton", cuda_tensor) is backends._REGISTRY["opt_in_stand_in"].torch
    with moe_kernels.use_backend("cuda"):
        assert backends.choose("opt_in_stand_in", "cuda") == "cuda"
    assert backends.choose("topk_router", "cuda") in ("triton", "cuda")  # not opt-in


def test_balanced_assignment_takes_the_cuda_solver_by_default(monkeypatch):
    """The CUDA solver ran exact on an H100 and an H200 and is far faster than the reference's
    Python auction there (ops/balanced_assignment.py): CUDA tensors take it unforced."""
    if not _extension.defines("balanced_assignment"):
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: True)  # a CUDA build
    monkeypatch.delenv("MOE_KERNELS_BACKEND", raising=False)
    assert backends.choose("balanced_assignment", "cuda") == "cuda"
    assert "cuda" not in backends._REGISTRY["balanced_assignment"].opt_in


def test_register_rejects_unknown_opt_in():
    with pytest.raises(ValueError, match="opt_in"):
        backends.register("no_such_op", torch=lambda: None, opt_in=("gpu",))


@pytest.mark.parametrize("op", ["capacity_positions", "dispatch", "combine"])
def test_dispatch_family_reaches_its_cuda_kernels(op, monkeypatch):
    """The kernels of csrc/cuda/capacity_positions.cu and dispatch.cu are the "cuda" backend of
    their ops (a CUDA build faked here): chosen when forced, next after triton by default, not
    opt-in; dispatch and combine have no float64 CUDA path, so float64 data on CUDA runs the
    reference."""
    if not _extension.defines(op):
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    import types

    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: True)
    monkeypatch.delenv("MOE_KERNELS_BACKEND", raising=False)
    entry = backends._REGISTRY[op]
    assert op == "capacity_positions" or entry.cuda.packet is getattr(torch.ops.moe_kernels, op)
    assert entry.cuda is not None and "cuda" not in entry.opt_in
    with moe_kernels.use_backend("cuda"):
        assert backends.choose(op, "cuda") == "cuda"
        f64 = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float64)  # no GPU needed
        assert backends.choose_for(op, f64) == ("cuda" if op == "capacity_positions" else "torch")
    monkeypatch.setattr(backends, "triton_importable", lambda: False)
    assert backends.choose(op, "cuda") == "cuda"


def test_fallback_past_a_kernels_limits(monkeypatch):
    """backends.fallback: the next backend of the device's default order with a kernel here (the
    float64 rule and opt-in kept), else the reference; on CPU tensors (the interpreter's Triton)
    the reference."""
    import types

    from moe_kernels import reference

    def cuda_tensor(dtype=torch.float32):  # choose_for / fallback read only these (no GPU needed)
        return types.SimpleNamespace(device=torch.device("cuda"), dtype=dtype)

    for op in ("topk_router", "load_probabilities", "dselect_k"):
        assert backends.fallback(op, "triton", torch.zeros(2, 3)) is backends._REGISTRY[op].torch
    assert backends.fallback("topk_router", "triton", torch.zeros(2, 3)) is reference.topk_router
    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: True)  # a CUDA build
    for op in ("topk_router", "load_probabilities"):
        if backends._REGISTRY[op].cuda is None:
            pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
        assert backends.fallback(op, "triton", cuda_tensor()) is backends._REGISTRY[op].cuda
    assert backends.fallback("dselect_k", "triton", cuda_tensor()) is backends._REGISTRY["dselect_k"].torch
    f64 = cuda_tensor(torch.float64)  # load_probabilities' CUDA kernel has no float64 path; topk_router's has
    assert backends.fallback("load_probabilities", "triton", f64) is backends._REGISTRY["load_probabilities"].torch
    assert backends.fallback("topk_router", "triton", f64) is backends._REGISTRY["topk_router"].cuda
    solver = backends._REGISTRY["balanced_assignment"].cuda or reference.balanced_assignment  # no Triton kernel
    assert backends.fallback("balanced_assignment", "triton", cuda_tensor()) is solver
    with moe_kernels.use_backend("triton"):  # forced or not
        assert backends.fallback("topk_router", "triton", cuda_tensor()) is backends._REGISTRY["topk_router"].cuda


def test_measured_gpu_order(monkeypatch):
    """CUDA tensors take the Triton kernels first (the H200's goals run measured them faster than
    the CUDA ones wherever both exist, but capacity_positions at E = 8, a torch.cumsum since
    replaced); an entry of _MEASURED_ORDER puts another backend first for
    its op on its device only; CPU tensors and a forced backend are unaffected."""
    if not _extension.defines("capacity_positions"):
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: True)  # a CUDA build
    monkeypatch.setattr(backends, "triton_importable", lambda: True)
    monkeypatch.delenv("MOE_KERNELS_BACKEND", raising=False)
    for op in ("capacity_positions", "batchwise_mask", "dispatch", "topk_router"):
        assert backends.choose(op, "cuda") == "triton", op
    monkeypatch.setitem(backends._MEASURED_ORDER, ("capacity_positions", "cuda"), ("cuda", "triton", "torch"))
    assert backends.default_order("capacity_positions", "cuda")[0] == "cuda"
    assert backends.choose("capacity_positions", "cuda") == "cuda"
    assert backends.choose("batchwise_mask", "cuda") == "triton"
    assert backends.choose("capacity_positions", "cpu") == "cpu"
    with moe_kernels.use_backend("triton"):
        assert backends.choose("capacity_positions", "cuda") == "triton"


def test_capacity_positions_takes_the_cuda_kernels_from_64_experts(monkeypatch):
    """From 64 experts the Triton op sorts blocks, which took 3.1x the CUDA kernels' time at E = 256
    on the H200; below, its packed scan was the faster: the unforced order follows num_experts
    (a CUDA build faked here). A forced backend still wins, and other ops ignore the size."""
    if not _extension.defines("capacity_positions"):
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: True)
    monkeypatch.setattr(backends, "triton_importable", lambda: True)
    monkeypatch.delenv("MOE_KERNELS_BACKEND", raising=False)
    from moe_kernels.triton.capacity_positions import SORTED_FROM

    assert backends._MEASURED_FROM[("capacity_positions", "cuda")][0] == SORTED_FROM
    for E, expected in [
        (None, "triton"),
        (8, "triton"),
        (SORTED_FROM - 1, "triton"),
        (SORTED_FROM, "cuda"),
        (256, "cuda"),
    ]:
        assert backends.choose("capacity_positions", "cuda", E) == expected, E
    assert backends.choose("capacity_positions", "cpu", 256) == "cpu"
    assert backends.choose("dispatch", "cuda", 256) == "triton"
    with moe_kernels.use_backend("triton"):
        assert backends.choose("capacity_positions", "cuda", 256) == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    summary = moe_kernels.backends()["capacity_positions"]
    assert summary["cuda"] == "triton" and "cuda: cuda from a size of 64" in summary["why"]
    # The op passes its num_experts.
    seen = []
    monkeypatch.setattr(
        backends, "implementation", lambda op, t, size=None: seen.append(size) or (lambda *a, **k: None)
    )
    moe_kernels.ops.capacity_positions(torch.zeros(3, 2, dtype=torch.int64), 70, 4)
    assert seen == [70]


def test_a_symbolic_size_compiles_fullgraph():
    """capacity_positions passes num_experts to the backend choice; under torch.compile with dynamic
    shapes it can be symbolic (E from a tensor's shape), which choose(), a constant to the compiler,
    cannot take: the op compiles in one graph and gives the eager result at both sides of the rule."""
    from moe_kernels.ops import capacity_positions

    def f(experts, logits):
        return capacity_positions(experts, logits.shape[1], 4)

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for E in (8, 70):
        experts = torch.randint(0, E, (16, 2), generator=torch.Generator().manual_seed(E))
        positions, counts = compiled(experts, torch.zeros(16, E))
        expected = capacity_positions(experts, E, 4)
        assert torch.equal(positions, expected[0]) and torch.equal(counts, expected[1])
