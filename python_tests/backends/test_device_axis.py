"""The device axis itself (python_tests/support/devices.py): the GPU cases exist in every `backend` test's
parametrisation, are skipped here with a reason, and the copies they run on keep strides, dtypes
and the autograd connection to the CPU inputs."""

import dataclasses
import sys

import pytest
import torch
from collection import COLLECTED
from devices import GPU_BACKENDS, Backend, gpu_params, gpu_skip_reason, redirect, to_device

import moe_kernels
from moe_kernels import backends
from moe_kernels.ops import topk_softmax


def test_backend_is_its_name():
    b = Backend("triton", "cuda")
    assert b == "triton" and b.device == "cuda" and b.id == "cuda:triton"
    assert Backend("cpu").id == "cpu"
    with moe_kernels.use_backend(b):  # accepted wherever a name is
        assert backends.forced() == "triton"


def test_gpu_params_one_per_gpu_backend_with_skip_reason_here():
    params = gpu_params(interpreting=False)
    assert [p.values[0].id for p in params] == [f"cuda:{b}" for b in GPU_BACKENDS]
    reason = gpu_skip_reason(interpreting=False)
    if torch.cuda.is_available():
        assert reason is None and all(not p.marks for p in params)
    else:
        assert "torch.cuda.is_available() is False" in reason
        assert all(m.kwargs["reason"] == reason for p in params for m in p.marks)
    assert "TRITON_INTERPRET" in gpu_skip_reason(interpreting=True)


def test_every_backend_test_gets_the_gpu_cases(request):
    """Collected ids of this very module's parametrised test below include both GPU cases (all
    collected, before a shard keeps its part: conftest.COLLECTED)."""
    collected = request.config.stash[COLLECTED]
    ids = {item.callspec.id for item in collected if item.originalname == "test_gpu_case_runs_on_device"}
    assert {"cuda:cuda", "cuda:triton"} <= ids


def test_gpu_case_runs_on_device(backend, monkeypatch):
    """The backend's implementation receives tensors on the case's device (CUDA for the GPU
    cases, run for real on a GPU machine); the test gets CPU outputs and CPU gradients."""
    seen = []

    def spy(impl):
        def run(*args, **kwargs):
            seen.append(args[0].device.type)
            return impl(*args, **kwargs)

        return run if impl is not None else None

    entry = backends._REGISTRY["topk_router"]  # topk_softmax's implementation
    wrapped = {name: spy(getattr(entry, name)) for name in backends.BACKENDS}
    monkeypatch.setitem(backends._REGISTRY, "topk_router", dataclasses.replace(entry, **wrapped))
    logits = torch.randn(5, 7, requires_grad=True)
    with moe_kernels.use_backend(backend):
        w, e = topk_softmax(logits, 2)
    w.sum().backward()
    assert seen == [backend.device]
    assert w.device.type == e.device.type == logits.grad.device.type == "cpu"
    w_ref, e_ref = moe_kernels.reference.topk_softmax(logits.detach(), 2)
    assert torch.equal(e, e_ref) and torch.allclose(w, w_ref)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_to_device_keeps_strides_dtype_and_grad(requires_grad):
    base = torch.randn(12, 40, dtype=torch.float16)
    x = base.t()[:, ::2].detach().requires_grad_(requires_grad)  # non-contiguous, strides (1, 80)
    (y, (z,), d) = to_device((x, [x], {"a": x}), "meta")
    for t in (y, z, d["a"]):
        assert t.device.type == "meta" and t.stride() == x.stride() and t.dtype == x.dtype
        assert t.requires_grad == requires_grad
    assert to_device(x, "cpu") is x and to_device(3, "meta") == 3


def test_redirect_is_a_no_op_for_cpu_backends(monkeypatch):
    before = (backends.choose, backends.implementation)
    with redirect(Backend("cpu"), monkeypatch):
        assert (backends.choose, backends.implementation) == before


def test_redirect_skips_ops_without_a_kernel_of_the_backend():
    """Under a GPU case, an op the backend has no kernel for is a skip naming it, not a failure
    (here no op has a CUDA kernel; sinkhorn has none anywhere)."""
    with pytest.MonkeyPatch.context() as mp, redirect(Backend("cuda", "cuda"), mp), moe_kernels.use_backend("cuda"):
        with pytest.raises(pytest.skip.Exception, match="sinkhorn has no cuda kernel for cuda tensors"):
            backends.choose("sinkhorn", "cpu")
    if not backends.triton_importable():
        pytest.skip("triton not installed")
    with pytest.MonkeyPatch.context() as mp, redirect(Backend("triton", "cuda"), mp), moe_kernels.use_backend("triton"):
        assert backends.choose("topk_router", "cpu") == "triton"  # answered for cuda tensors
    assert backends.choose("topk_router", "cpu") != "triton" or backends.triton_interpreting()  # undone


def test_redirect_keeps_the_float64_rule(monkeypatch):
    """A GPU case hands a float64 tensor whose op has no float64 kernel on that backend to the
    reference (on the device), as backends.implementation does: the CUDA load_probabilities kernel
    has no float64 path, so a float64 cuda:cuda case must not reach it."""
    import devices

    from moe_kernels import _extension

    monkeypatch.setattr(_extension, "has_kernel", lambda op, key: True)  # a CUDA build, here
    monkeypatch.setattr(devices, "_on", lambda device, impl, home: impl)  # no GPU to copy to
    with redirect(Backend("cuda", "cuda"), monkeypatch), moe_kernels.use_backend("cuda"):
        entry = backends._REGISTRY["load_probabilities"]
        assert backends.implementation("load_probabilities", torch.zeros(2, 3, dtype=torch.float64)) is entry.torch
        assert backends.implementation("load_probabilities", torch.zeros(2, 3)) is entry.cuda
    assert entry.torch is sys.modules["moe_kernels.ops.load_probabilities"]._reference
