"""moe_kernels.ops.topk_softmax: fused top-k selection and softmax gating weights.

Implementations: reference (moe_kernels/reference/topk_softmax.py), C++ CPU
(csrc/cpu/topk_softmax.cpp), Triton (moe_kernels/triton/topk_softmax.py), CUDA
(csrc/cuda/topk_softmax.cu). backends.py chooses among them.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _validate


def _backward_from_logits(
    logits: torch.Tensor, experts: torch.Tensor, grad_weights: torch.Tensor, renormalize: bool
) -> torch.Tensor:
    """d loss / d logits [T, E] from d loss / d weights [T, k], shared by the kernel backends.

    The selected weights are recomputed in float32 from the logits (not read back from a
    half-precision output), so the gradient is as accurate as the reference's.
    """
    x = logits.float()
    g = grad_weights.float()
    masked = (
        x.amax(dim=-1, keepdim=True) == float("-inf") if x.numel() else x.new_zeros(x.shape[0], 1, dtype=torch.bool)
    )
    x = torch.where(masked, 0.0, x)
    if renormalize:
        w = torch.softmax(x.gather(1, experts), dim=-1)
        g_sel = w * (g - (g * w).sum(-1, keepdim=True))
        grad = torch.zeros_like(x).scatter(1, experts, g_sel)
    else:
        p = torch.softmax(x, dim=-1)
        gw = g * p.gather(1, experts)
        grad = torch.zeros_like(x).scatter(1, experts, gw) - p * gw.sum(-1, keepdim=True)
    return torch.where(masked, 0.0, grad).to(logits.dtype)


def _setup_context(ctx, inputs, output):
    logits, k, renormalize = inputs
    ctx.set_materialize_grads(False)  # no zero gradient made for the int64 experts
    ctx.save_for_backward(logits, output[1])
    ctx.renormalize = renormalize
    ctx.from_weights = False


def _setup_context_kernel(ctx, inputs, output):
    """The extension op's: float32 renormalised weights are exactly what its backward would
    recompute from the logits, so where the device has the kernel that takes them, a copy of the
    [T, k] weights is saved instead of the [T, E] logits (a copy: a caller may edit the returned
    weights in place). The backward then reads no logits and computes no exps, and the graph
    does not keep the logits alive."""
    logits, k, renormalize = inputs
    from_weights = (
        renormalize
        and logits.dtype == torch.float32
        and backends.extension_kernel("topk_softmax_backward_from_weights", logits) is not None
    )
    if not from_weights:
        return _setup_context(ctx, inputs, output)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[0].clone(), output[1])
    ctx.renormalize, ctx.from_weights, ctx.num_experts = renormalize, True, logits.shape[1]


def _backward(ctx, grad_weights, grad_experts):
    logits, experts = ctx.saved_tensors
    if grad_weights is None:
        return None, None, None
    return _backward_from_logits(logits, experts, grad_weights, ctx.renormalize), None, None


def _backward_kernel(ctx, grad_weights, grad_experts):
    """Backward of the extension op: its fused backward kernel where the device has one."""
    if grad_weights is None:
        return None, None, None
    if ctx.from_weights:
        weights, experts = ctx.saved_tensors
        op = torch.ops.moe_kernels.topk_softmax_backward_from_weights
        return op(grad_weights, weights, experts, ctx.num_experts), None, None
    logits, experts = ctx.saved_tensors
    kernel = backends.extension_kernel("topk_softmax_backward", logits)
    if kernel is None:
        return _backward(ctx, grad_weights, grad_experts)
    return kernel(grad_weights, logits, experts, ctx.renormalize), None, None


_cpp = None
if backends._extension.defines("topk_softmax"):
    _cpp = torch.ops.moe_kernels.topk_softmax

    @torch.library.register_fake("moe_kernels::topk_softmax")
    def _fake(logits, k, renormalize):
        T = logits.shape[0]
        return logits.new_empty((T, k)), logits.new_empty((T, k), dtype=torch.int64)

    @torch.library.register_fake("moe_kernels::topk_softmax_backward")
    def _fake_backward(grad_weights, logits, experts, renormalize):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    if backends._extension.defines("topk_softmax_backward_from_weights"):

        @torch.library.register_fake("moe_kernels::topk_softmax_backward_from_weights")
        def _fake_backward_from_weights(grad_weights, weights, experts, num_experts):
            return weights.new_empty((weights.shape[0], num_experts))

    torch.library.register_autograd("moe_kernels::topk_softmax", _backward_kernel, setup_context=_setup_context_kernel)

_triton = None
if backends.triton_importable():
    from moe_kernels.triton import topk_softmax as _triton_module

    _triton_module.topk_softmax.register_autograd(_backward, setup_context=_setup_context)

    def _triton(logits, k, renormalize):
        if not _triton_module.supports(logits.shape[1]):  # past the kernel's E: cuda, else the reference
            return backends.fallback("topk_softmax", "triton", logits)(logits, k, renormalize)
        return _triton_module.topk_softmax(logits, k, renormalize)


# No kernel has a float64 path: float64 logits run the reference (backends.choose_for).
backends.register("topk_softmax", torch=reference.topk_softmax, cpu=_cpp, triton=_triton, cuda=_cpp, float64=())


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool = True):
    """Top-k gating: the k largest logits of each row and their softmax weights.

    Args:
      logits: [T, E] float32 / float16 / bfloat16, any strides (float64: the reference, in float64).
        -inf is legal (a masked expert).
      k: experts per token, 1 <= k <= E.
      renormalize: True (default) = Softmax(KeepTopK(H, k)), eqs 3 and 5 of Shazeer et al.
        (002_01a24e7ec3602eec.txt), the weights of a row sum to 1. False = the full-softmax
        probabilities of the selected experts (Switch / GShard).

    Returns:
      (weights [T, k] in the logits' dtype, computed in float32 (float64 for float64);
       experts [T, k] int64, by descending logit, ties to the lower expert index).

    Differentiable with respect to `logits`. NaN ranks above every number, so a row containing NaN
    selects it and gets NaN weights (checking for NaN would need a device sync); a row whose
    logits are all -inf gets weights 0. Every backend gives the same experts.
    """
    _validate.tensor("logits", logits, dim=2, shape="[T, E]", dtypes=_validate.FLOAT_DTYPES)
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must be [T, E] with E >= 1, got shape {tuple(logits.shape)}")
    _validate.integer("k", k, low=1, high=E, what=f" (E = {E} experts)")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    return backends.implementation("topk_softmax", logits)(logits, k, renormalize)
