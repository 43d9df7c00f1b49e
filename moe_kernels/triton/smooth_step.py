"""Smooth-step S(t) (DSelect-k, Section 3.1.3) and its backward in Triton, elementwise."""

import torch
import triton
import triton.language as tl

from moe_kernels.reference.smooth_step import smooth_step_coefficients
from moe_kernels.triton.common import on_tensor_device, to_float32

_BLOCK = 1024


@triton.jit
def smooth_step_value(t, half, c1, c3):
    """S(t) in float32, the Horner form of the reference; NaN falls through to the cubic."""
    cubic = t * (c1 - c3 * t * t) + 0.5
    return tl.where(t <= -half, 0.0, tl.where(t >= half, 1.0, cubic))


@triton.jit
def smooth_step_slope(t, half, c1, c3):
    """S'(t) in float32: exactly 0 outside the open interval (-half, half); NaN at a NaN t (it
    fails both comparisons), as csrc's smooth_step_grad and the reference."""
    outside = (t <= -half) | (t >= half)
    return tl.where(outside, 0.0, c1 - 3.0 * c3 * t * t)


@triton.jit
def smooth_step_chain(g, t, half, c1, c3):
    """g * S'(t), exactly 0 where S is flat whatever g is (NaN included), as csrc's
    smooth_step_chain and the reference's where()."""
    slope = smooth_step_slope(t, half, c1, c3)
    return tl.where(slope == 0.0, 0.0, g * slope)


@triton.jit
def smooth_step_kernel(
    t_ptr,  # [N] contiguous fp32/fp16/bf16
    out_ptr,  # [N] contiguous, t's dtype
    N,  # elements
    half,  # gamma / 2
    c1,  # 3 / (2 gamma)
    c3,  # 2 / gamma^3
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    t = to_float32(tl.load(t_ptr + offs, mask=ok, other=0.0))
    tl.store(out_ptr + offs, smooth_step_value(t, half, c1, c3).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def smooth_step_backward_kernel(
    grad_ptr,  # [N] contiguous, upstream gradient
    t_ptr,  # [N] contiguous
    out_ptr,  # [N] contiguous, t's dtype
    N,
    half,
    c1,
    c3,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    t = to_float32(tl.load(t_ptr + offs, mask=ok, other=0.0))
    g = to_float32(tl.load(grad_ptr + offs, mask=ok, other=0.0))
    tl.store(out_ptr + offs, smooth_step_chain(g, t, half, c1, c3).to(out_ptr.dtype.element_ty), mask=ok)


def _params(gamma: float):
    c1, c3 = smooth_step_coefficients(gamma)
    return gamma / 2, c1, c3


@torch.library.custom_op("moe_kernels_triton::smooth_step", mutates_args=())
@on_tensor_device
def smooth_step(t: torch.Tensor, gamma: float) -> torch.Tensor:
    """Triton launch; arguments as moe_kernels.ops.smooth_step (validated there)."""
    x = t.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        smooth_step_kernel[(triton.cdiv(x.numel(), _BLOCK),)](x, out, x.numel(), *_params(gamma), BLOCK=_BLOCK)
    return out


@smooth_step.register_fake
def _(t, gamma):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


@torch.library.custom_op("moe_kernels_triton::smooth_step_backward", mutates_args=())
@on_tensor_device
def smooth_step_backward(grad: torch.Tensor, t: torch.Tensor, gamma: float) -> torch.Tensor:
    """d loss / d t from d loss / d S(t); grad has t's shape."""
    x = t.contiguous()
    g = grad.contiguous()
    out = torch.empty_like(x)
    if x.numel():
        grid = (triton.cdiv(x.numel(), _BLOCK),)
        smooth_step_backward_kernel[grid](g, x, out, x.numel(), *_params(gamma), BLOCK=_BLOCK)
    return out


@smooth_step_backward.register_fake
def _(grad, t, gamma):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _aot(kernel, dt, backward=False):
    signature = {"t_ptr": f"*{dt}", "out_ptr": f"*{dt}", "N": "i64", "half": "fp32", "c1": "fp32", "c3": "fp32"}
    if backward:
        signature = {"grad_ptr": "*fp32", **signature}
    signature["BLOCK"] = "constexpr"
    return kernel, signature, {"BLOCK": _BLOCK}, {"num_warps": 4}


AOT_KERNELS = [
    _aot(smooth_step_kernel, "fp32"),
    _aot(smooth_step_kernel, "bf16"),
    _aot(smooth_step_backward_kernel, "fp32", backward=True),
    _aot(smooth_step_backward_kernel, "fp16", backward=True),
]
