"""moe_kernels.ops.noisy_topk_gate: NoisyTopKGate's math from its logits (Shazeer et al. 2017).

Implementations: reference (moe_kernels/reference/noisy_topk_gate.py) and the fused C++ CPU kernel
(csrc/cpu/noisy_topk_gate.cpp: Softplus, the noise, the top k+1, the softmax and Load in one pass
per row, P never written; its backward one pass per row). Wherever load_probabilities would not
run its C++ CPU kernel (CUDA tensors, a forced "torch" / "triton" / "cuda" backend, no extension),
the gate is computed by the same composition as the reference, with load_probabilities on the
backend it picks: Triton and CUDA have no fused gate kernel and use their load_probabilities.
"""

import math

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _validate
from moe_kernels.ops.load_probabilities import load_probabilities


def _setup_context(ctx, inputs, output):
    clean_logits, raw_noise_stddev, noise, k, noise_epsilon, token_weights = inputs
    ctx.save_for_backward(clean_logits, raw_noise_stddev, noise, token_weights, output[1])
    ctx.k, ctx.noise_epsilon = k, noise_epsilon


def _backward(ctx, grad_weights, grad_top, grad_load):
    clean_logits, raw_noise_stddev, noise, token_weights, top = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph: the reference's, differentiable again
        k, eps = ctx.k, ctx.noise_epsilon
        grads = _autograd.through_reference(
            lambda c, r, n: reference.noisy_topk_gate(c, r, n, k, eps, token_weights),
            (clean_logits, raw_noise_stddev, noise),
            ctx.needs_input_grad[:3],
            (grad_weights, None, grad_load),
        )
        return (*grads, None, None, None)
    T, E = clean_logits.shape
    if grad_weights is None:
        grad_weights = clean_logits.new_zeros((T, ctx.k), dtype=torch.float32)
    if grad_load is None:
        grad_load = clean_logits.new_zeros((E,), dtype=torch.float32)
    g_clean, g_raw, g_noise_top = torch.ops.moe_kernels.noisy_topk_gate_backward(
        grad_weights, grad_load, clean_logits, raw_noise_stddev, noise, token_weights, top, ctx.k, ctx.noise_epsilon
    )
    g_noise = None
    if ctx.needs_input_grad[2]:
        # d noise = d H * stddev: nonzero only at the k+1 elements whose noisy logits the gate
        # reads, and NaN wherever raw_noise_stddev is NaN (0 * NaN elsewhere too, as the
        # reference: a NaN input's gradient is NaN, docs/reliability.md).
        g_noise = torch.zeros(T, E, dtype=torch.float32, device=noise.device)
        g_noise.masked_fill_(torch.isnan(raw_noise_stddev), float("nan"))
        g_noise.scatter_add_(1, top.clamp(min=0), torch.where(top >= 0, g_noise_top, 0.0))
        g_noise = g_noise.to(noise.dtype)
    return g_clean, g_raw, g_noise, None, None, None


def _fake(clean_logits, raw_noise_stddev, noise, k, noise_epsilon, token_weights):
    T, E = clean_logits.shape
    return (
        clean_logits.new_empty((T, k)),
        clean_logits.new_empty((T, k + 1), dtype=torch.int64),
        clean_logits.new_empty((E,), dtype=torch.float32),
    )


_cpp = None
if backends._extension.has_kernel("noisy_topk_gate", "CPU"):
    _cpp = _autograd.direct(torch.ops.moe_kernels.noisy_topk_gate)
    torch.library.register_fake("moe_kernels::noisy_topk_gate")(_fake)
    _autograd.register_autograd("moe_kernels::noisy_topk_gate", _backward, setup_context=_setup_context)

    @torch.library.register_fake("moe_kernels::noisy_topk_gate_backward")
    def _fake_backward(grad_weights, grad_load, clean_logits, raw_noise_stddev, noise, token_weights, top, k, eps):
        T, E = clean_logits.shape
        return (
            torch.empty_like(clean_logits, memory_format=torch.contiguous_format),
            torch.empty_like(raw_noise_stddev, memory_format=torch.contiguous_format),
            clean_logits.new_empty((T, k + 1), dtype=torch.float32),
        )


def _check_mask_values(mask: torch.Tensor, clean_logits: torch.Tensor) -> None:
    """A non-bool [T] mask must hold only 0 and 1: a ValueError otherwise. A host read, so only
    where the gate runs on a host backend (it follows load_probabilities' choice for the logits);
    on the GPU backends any value is taken as a token weight, unchecked."""
    if _validate.host_readable("load_probabilities", clean_logits, mask):
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("mask must be bool or hold only 0 and 1 (1 = a real token)")


def check_noise_epsilon(noise_epsilon) -> float:
    """noise_epsilon as a float: a TypeError unless a real number, a ValueError unless finite and
    >= 0. Shared with NoisyTopKGate, which checks it when it is built."""
    if isinstance(noise_epsilon, bool) or not isinstance(noise_epsilon, (int, float)):
        raise TypeError(f"noise_epsilon must be a float, got {type(noise_epsilon).__name__}")
    if not math.isfinite(noise_epsilon) or noise_epsilon < 0:
        raise ValueError(f"noise_epsilon must be a finite number >= 0, got {noise_epsilon}")
    return float(noise_epsilon)


def noisy_topk_gate(
    clean_logits: torch.Tensor,
    raw_noise_stddev: torch.Tensor,
    noise: torch.Tensor,
    k: int,
    noise_epsilon: float = 1e-2,
    mask: torch.Tensor | None = None,
):
    """The noisy top-k gate (eqs 3-5) and its Load(X) (eqs 9-10) from the gate's logits:

        noise_stddev = Softplus(raw_noise_stddev) + noise_epsilon
        H = clean_logits + noise * noise_stddev                          (eq 4)
        experts = the top k of H (larger value, then lower index; NaN first)
        weights = Softmax(H[experts]) (eq 3), computed in float32
        load_i = sum over tokens t of mask_t P(x_t, i), P = load_probabilities(clean, H, noise_stddev, k)

    Args:
      clean_logits: [T, E] x W_g; float32 / float16 / bfloat16, any strides (float64: the
        reference, in float64).
      raw_noise_stddev: [T, E] x W_noise, same dtype.
      noise: [T, E] StandardNormal() samples, same dtype.
      k: experts per token, 1 <= k <= E.
      noise_epsilon: float added to the softplus (the authors' code uses 1e-2).
      mask: optional [T] bool / 0-1 tensor, True for a real token: masked tokens add nothing to
        load (they are still routed). Not differentiated. Other values are a ValueError on the
        host backends; the GPU backends read no value to check it.

    Returns:
      (weights [T, k] in clean_logits' dtype, experts [T, k] int64, load [E] float32, float64 for float64).
      Differentiable in clean_logits, raw_noise_stddev (through the softplus) and noise.
    """
    _validate.tensor("clean_logits", clean_logits, dim=2, shape="[T, E]", dtypes=_validate.FLOAT_DTYPES)
    for name, value in (("raw_noise_stddev", raw_noise_stddev), ("noise", noise)):
        _validate.tensor(name, value, dim=2, shape="[T, E]", dtypes=(clean_logits.dtype,))
        if value.shape != clean_logits.shape:
            raise ValueError(
                f"{name} must be [T, E] = {list(clean_logits.shape)} like clean_logits, got {tuple(value.shape)}"
            )
    T, E = clean_logits.shape
    if E < 1:
        raise ValueError(f"clean_logits must be [T, E] with E >= 1, got shape {tuple(clean_logits.shape)}")
    _validate.integer("k", k, low=1, high=E, what=f" (E = {E} experts)")
    check_noise_epsilon(noise_epsilon)
    if mask is not None:
        _validate.tensor("mask", mask, dim=1, shape=f"[T] = [{T}]")
        if mask.shape != (T,):
            raise ValueError(f"mask must be [T] = [{T}], got shape {tuple(mask.shape)}")
    _validate.same_device(clean_logits=clean_logits, raw_noise_stddev=raw_noise_stddev, noise=noise, mask=mask)
    if mask is not None and mask.dtype != torch.bool and mask.numel():
        _check_mask_values(mask, clean_logits)
    if _cpp is not None and backends.choose_for("load_probabilities", clean_logits) == "cpu":
        token_weights = None if mask is None else mask.detach().to(torch.float32)
        weights, top, load = _cpp(clean_logits, raw_noise_stddev, noise, k, float(noise_epsilon), token_weights)
        return weights, top[:, :k], load
    return reference.noisy_topk_gate(
        clean_logits, raw_noise_stddev, noise, k, float(noise_epsilon), mask, load_probabilities_fn=load_probabilities
    )
