"""The device axis of the test matrix.

Every test that takes the `backend` fixture runs once per backend that can run here on CPU tensors
("torch", "cpu"; "triton" under TRITON_INTERPRET=1) and once per GPU backend on CUDA tensors
("cuda:cuda", "cuda:triton"), the latter skipped with the reason when no CUDA device is present.

The GPU cases are the CPU cases: the test builds its inputs on the CPU as always, and `redirect`
hands the chosen backend's implementation copies of them on the GPU (same sizes, strides and
dtypes, connected to the CPU tensors by autograd) and brings its outputs back to the CPU. So the
kernels run forward and backward on CUDA tensors, and every assertion of the CPU case — exact
expert indices, tolerances against the reference, gradients — applies unchanged, with no per-test
edit (a new op's tests get the axis by taking `backend`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

from moe_kernels import backends

GPU_BACKENDS = ("cuda", "triton")


class Backend(str):
    """A backend name ("cuda", "triton", ...) that also says which device its tensors live on.

    Equal to the plain name, so `use_backend(backend)` and `backend == "triton"` work unchanged."""

    device: str

    def __new__(cls, name: str, device: str = "cpu"):
        obj = super().__new__(cls, name)
        obj.device = device
        return obj

    @property
    def id(self) -> str:
        # CPU cases keep their plain ids (test_x[cpu]); GPU ones read test_x[cuda:triton].
        return str(self) if self.device == "cpu" else f"{self.device}:{self}"


def gpu_skip_reason(interpreting: bool) -> str | None:
    """Why the GPU cases cannot run in this process, or None when they can."""
    if interpreting:
        return "TRITON_INTERPRET=1: this pass runs the Triton kernels on CPU tensors only"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): GPU backends run on a GPU machine only"
    return None


def gpu_params(interpreting: bool) -> list:
    """pytest params for the GPU backends, each skipped with its reason where it cannot run."""
    reason = gpu_skip_reason(interpreting)
    marks = [pytest.mark.skip(reason=reason)] if reason else []
    return [pytest.param(Backend(b, "cuda"), id=Backend(b, "cuda").id, marks=marks) for b in GPU_BACKENDS]


def to_device(value, device: str):
    """`value` (a tensor, or tuples / lists / dicts of them) on `device`, strides kept.

    The copy is differentiable (Tensor.copy_), so gradients reach the original CPU tensors. A plain
    .to() would make non-contiguous inputs contiguous and hide the kernels' strided paths."""
    if isinstance(value, torch.Tensor):
        if value.device.type == torch.device(device).type:
            return value
        out = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=device)
        return out.copy_(value) if value.requires_grad else out.copy_(value.detach())
    if isinstance(value, (tuple, list)):
        moved = [to_device(v, device) for v in value]
        return type(value)(moved) if not hasattr(value, "_fields") else type(value)(*moved)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


def _on(device: str, impl: Callable, home: str) -> Callable:
    """`impl` run on copies of its tensor arguments on `device`, outputs brought back to `home`."""

    def run(*args, **kwargs):
        out = impl(*to_device(list(args), device), **to_device(kwargs, device))
        return to_device(out, home)

    return run


@contextlib.contextmanager
def redirect(backend: Backend, monkeypatch: pytest.MonkeyPatch):
    """Inside the block, ops called on CPU tensors run `backend`'s kernels on `backend.device`.

    Patches the two questions the ops ask moe_kernels.backends: `choose(op, "cpu")` answers for the
    device (so a forced GPU backend is valid), and `implementation(op, cpu_tensor)` returns the
    device implementation (by `choose_for`: float64 without a float64 kernel runs the reference,
    on the device) wrapped by `_on`. A test whose op has no kernel of that backend is
    skipped, with the op named. A no-op for CPU backends."""
    if backend.device == "cpu":
        yield
        return
    device = backend.device
    original_choose = backends.choose

    def choose(op: str, device_type: str, size: int | None = None) -> str:
        device_type = device if device_type == "cpu" else device_type
        if backends.forced() == backend and not backends._available(op, backend, device_type):
            # e.g. sinkhorn (C++ only) or dselect_k (no CUDA kernel): nothing to run on the GPU
            pytest.skip(f"{op} has no {backend} kernel for {device_type} tensors")
        return original_choose(op, device_type, size)

    def implementation(op: str, tensor: torch.Tensor, size: int | None = None) -> Callable:
        # choose_for (not choose): a float64 tensor whose backend has no float64 path runs the
        # reference, as backends.implementation does (choose_for calls the patched choose).
        impl = getattr(backends._REGISTRY[op], backends.choose_for(op, tensor, size))
        return _on(device, impl, tensor.device.type) if tensor.device.type != device else impl

    monkeypatch.setattr(backends, "choose", choose)
    monkeypatch.setattr(backends, "implementation", implementation)
    yield
