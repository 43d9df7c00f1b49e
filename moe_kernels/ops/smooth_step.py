"""moe_kernels.ops.smooth_step: the smooth-step function of DSelect-k (Section 3.1.3).

Implementations: reference (moe_kernels/reference/smooth_step.py), C++ CPU
(csrc/cpu/smooth_step.cpp, with a fused backward kernel), Triton
(moe_kernels/triton/smooth_step.py, with a backward kernel). No CUDA kernel: on GPU the Triton
kernel runs. backends.py chooses among them.
"""

import math

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _validate


def _setup_context(ctx, inputs, output):
    t, gamma = inputs
    ctx.save_for_backward(t)
    ctx.gamma = gamma


def _backward_in_graph(ctx, grad):
    """create_graph (grad mode on in the backward): the reference's, differentiable again."""
    (t,) = ctx.saved_tensors
    return _autograd.through_reference(lambda t: reference.smooth_step(t, ctx.gamma), (t,), (True,), (grad,))[0], None


def _backward_cpp(ctx, grad):
    if torch.is_grad_enabled():
        return _backward_in_graph(ctx, grad)
    (t,) = ctx.saved_tensors
    return torch.ops.moe_kernels.smooth_step_backward(grad, t, ctx.gamma), None


def _backward_triton(ctx, grad):
    if torch.is_grad_enabled():
        return _backward_in_graph(ctx, grad)
    (t,) = ctx.saved_tensors
    return torch.ops.moe_kernels_triton.smooth_step_backward(grad, t, ctx.gamma), None


def _fake(t, gamma):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _fake_backward(grad, t, gamma):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


_cpp = None
if backends._extension.defines("smooth_step"):
    _cpp = _autograd.direct(torch.ops.moe_kernels.smooth_step)
    torch.library.register_fake("moe_kernels::smooth_step")(_fake)
    torch.library.register_fake("moe_kernels::smooth_step_backward")(_fake_backward)
    _autograd.register_autograd("moe_kernels::smooth_step", _backward_cpp, setup_context=_setup_context)

_triton = None
if backends.triton_importable():
    from moe_kernels.triton import smooth_step as _triton_module

    _triton = _triton_module.smooth_step
    _triton.register_autograd(_backward_triton, setup_context=_setup_context)

# No kernel has a float64 path: float64 t runs the reference (backends.choose_for).
backends.register("smooth_step", torch=reference.smooth_step, cpu=_cpp, triton=_triton, float64=())


def check_gamma(gamma) -> float:
    """gamma must be a positive finite real number (int or float, not bool)."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)):
        raise TypeError(f"gamma must be a float, got {type(gamma).__name__}")
    if not (gamma > 0 and math.isfinite(gamma)):
        raise ValueError(f"gamma must be positive and finite, got {gamma}")
    if gamma < 1e-12:  # 2 / gamma^3 overflows float32 below ~1.8e-13
        raise ValueError(f"gamma must be >= 1e-12 (2 / gamma^3 must be finite in float32), got {gamma}")
    return float(gamma)


def smooth_step(t: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Smooth-step S(t) of DSelect-k (003_a1a58754fcb6a991.txt, Section 3.1.3), elementwise.

    S(t) = 0 for t <= -gamma/2, 1 for t >= gamma/2, -2/gamma^3 t^3 + 3/(2 gamma) t + 1/2 between:
    continuously differentiable, with S'(+-gamma/2) = 0 and exactly 0 / 1 outside.

    Args:
      t: any shape, float32 / float16 / bfloat16, any strides (computed in float32); float64 runs
        the reference, in float64.
      gamma: width of the fractional region, a positive finite float.

    Returns: S(t), t's shape and dtype (contiguous). Differentiable with respect to t.
    """
    _validate.tensor("t", t, shape="[...]", dtypes=_validate.FLOAT_DTYPES)
    gamma = check_gamma(gamma)
    return backends.implementation("smooth_step", t)(t, gamma)
