"""moe_kernels.ops.dselect_k: the fused DSelect-k gate (003_a1a58754fcb6a991.txt, eq 6).

Implementations: reference (moe_kernels/reference/dselect_k.py), C++ CPU
(csrc/cpu/dselect_k.cpp, with a fused backward kernel), Triton (moe_kernels/triton/dselect_k.py,
with a backward kernel). No CUDA kernel: on GPU the Triton kernel runs. backends.py chooses.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _validate
from moe_kernels.ops.smooth_step import check_gamma
from moe_kernels.reference.dselect_k import num_bits

# The selectors have 2^m entries; the kernels keep one selector's entries in scratch/registers.
MAX_EXPERTS = 1 << 20


def _setup_context(ctx, inputs, output):
    alpha, z, num_experts, gamma, return_selectors = inputs
    ctx.save_for_backward(alpha, z)
    ctx.num_experts, ctx.gamma, ctx.return_selectors = num_experts, gamma, return_selectors


def _make_backward(op):
    def backward(ctx, grad_gates, grad_selectors):
        alpha, z = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the reference's, differentiable again
            E, gamma, selectors = ctx.num_experts, ctx.gamma, ctx.return_selectors
            grads = _autograd.through_reference(
                lambda a, z: _reference(a, z, E, gamma, selectors),
                (alpha, z),
                ctx.needs_input_grad[:2],
                (grad_gates, grad_selectors),
            )
            return (*grads, None, None, None)
        if grad_gates is None:
            grad_gates = alpha.new_zeros((alpha.shape[0], ctx.num_experts))
        grad_alpha, grad_z = op()(grad_gates, grad_selectors, alpha, z, ctx.num_experts, ctx.gamma)
        return grad_alpha, grad_z, None, None, None

    return backward


def _fake(alpha, z, num_experts, gamma, return_selectors):
    B, k, m = z.shape
    return alpha.new_empty((B, num_experts)), alpha.new_empty((B, k, (1 << m) if return_selectors else 0))


def _fake_backward(grad_gates, grad_selectors, alpha, z, num_experts, gamma):
    return (
        torch.empty_like(alpha, memory_format=torch.contiguous_format),
        torch.empty_like(z, memory_format=torch.contiguous_format),
    )


def _reference(alpha, z, num_experts, gamma, return_selectors):
    """The reference with the kernels' calling convention ([B, k] / [B, k, m], two outputs)."""
    if return_selectors:
        return reference.dselect_k(alpha, z, num_experts, gamma, True)
    gates = reference.dselect_k(alpha, z, num_experts, gamma)
    return gates, gates.new_empty((z.shape[0], z.shape[1], 0))


_cpp = None
if backends._extension.defines("dselect_k"):
    _cpp = _autograd.direct(torch.ops.moe_kernels.dselect_k)
    torch.library.register_fake("moe_kernels::dselect_k")(_fake)
    torch.library.register_fake("moe_kernels::dselect_k_backward")(_fake_backward)
    _autograd.register_autograd(
        "moe_kernels::dselect_k",
        _make_backward(lambda: torch.ops.moe_kernels.dselect_k_backward),
        setup_context=_setup_context,
    )

_triton = None
if backends.triton_importable():
    from moe_kernels.triton import dselect_k as _triton_module

    _triton_module.dselect_k.register_autograd(
        _make_backward(lambda: torch.ops.moe_kernels_triton.dselect_k_backward), setup_context=_setup_context
    )

    def _triton(alpha, z, num_experts, gamma, return_selectors):
        if not _triton_module.supports(num_experts):  # past the kernel's size: the reference (no CUDA kernel)
            return backends.fallback("dselect_k", "triton", alpha)(alpha, z, num_experts, gamma, return_selectors)
        return _triton_module.dselect_k(alpha, z, num_experts, gamma, return_selectors)


# No kernel has a float64 path: float64 alpha runs the reference (backends.choose_for).
backends.register("dselect_k", torch=_reference, cpu=_cpp, triton=_triton, float64=())


def dselect_k(alpha: torch.Tensor, z: torch.Tensor, num_experts: int, gamma: float = 1.0, return_selectors=False):
    """DSelect-k gate weights q~(alpha, Z) = sum_i softmax(alpha)_i r(S(z_i)) (eqs 4 and 6).

    Args:
      alpha: [k] (static gate, Section 3.1) or [B, k] (per example, Section 3.2: alpha = G x),
        float32 / float16 / bfloat16 (float64: the reference, in float64), k >= 1.
      z: [k, m] or [B, k, m] (per example: z_i = W_i x), alpha's dtype, with
        m = ceil(log2(num_experts)) binary-encoding variables per selector (m = 0 for one expert).
      num_experts: n, 1 <= n <= 2^20. Bit j of the 0-based expert index l (least significant
        first) picks S(z_ij) or 1 - S(z_ij). When n < 2^m the selector entries past n are not
        experts (Appendix B.2): dropped, NOT renormalised.
      gamma: smooth-step width, positive and finite.
      return_selectors: also return the selector outputs r(S(z_i)) over all 2^m entries (each on
        the probability simplex, Proposition 2), for the entropy regulariser and the B.2 penalty.

    Returns:
      gates [n] or [B, n] in alpha's dtype (computed in float32, float64 for float64); with return_selectors, also
      selectors [k, 2^m] or [B, k, 2^m]. Differentiable with respect to alpha and z.
      A row whose alpha is all -inf gets NaN gates (as torch.softmax).
    """
    _validate.tensor("alpha", alpha, shape="[k] or [B, k]", dtypes=_validate.FLOAT_DTYPES)
    _validate.tensor("z", z, shape="[k, m] or [B, k, m]", dtypes=_validate.FLOAT_DTYPES)
    _validate.integer("num_experts", num_experts, low=1, high=MAX_EXPERTS)
    gamma = check_gamma(gamma)
    if not isinstance(return_selectors, bool):
        raise TypeError(f"return_selectors must be a bool, got {type(return_selectors).__name__}")
    static = alpha.dim() == 1
    if alpha.dim() not in (1, 2):
        raise ValueError(f"alpha must be [k] or [B, k], got shape {tuple(alpha.shape)}")
    m = num_bits(num_experts)
    expected = tuple(alpha.shape) + (m,)
    if tuple(z.shape) != expected:
        raise ValueError(
            f"z must be {'[k, m]' if static else '[B, k, m]'} = {list(expected)} with m = ceil(log2(num_experts = "
            f"{num_experts})) = {m}, got shape {tuple(z.shape)}"
        )
    if alpha.shape[-1] < 1:
        raise ValueError(f"alpha must have k >= 1 selectors, got shape {tuple(alpha.shape)}")
    if z.dtype != alpha.dtype:
        raise TypeError(f"z must have alpha's dtype {alpha.dtype}, got {z.dtype}")
    if static:
        alpha, z = alpha[None], z[None]
    _validate.same_device(alpha=alpha, z=z)
    gates, selectors = backends.implementation("dselect_k", alpha)(alpha, z, num_experts, gamma, return_selectors)
    if static:
        gates, selectors = gates[0], selectors[0]
    return (gates, selectors) if return_selectors else gates
