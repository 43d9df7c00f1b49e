"""moe_kernels.ops.load_probabilities: the smooth load estimator P(x, i) of Shazeer et al. 2017.

Implementations: reference (moe_kernels/reference/load_probabilities.py), C++ CPU
(csrc/cpu/load_probabilities.cpp), Triton (moe_kernels/triton/load_probabilities.py), CUDA
(csrc/cuda/load_probabilities.cu).
backends.py chooses among them. Every implementation returns (P, top); the public function
returns P, and (P, top) with return_topk=True.
"""

import math

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _validate


def _backward_from_inputs(clean_logits, noisy_logits, noise_stddev, top, k, grad_p):
    """(d clean, d noisy, d stddev) [T, E] from d loss / d P [T, E], shared by the kernel backends.

    With z = (clean_i - thr_i) / s_i and phi the normal density:
      dP_i/dclean_i = phi(z_i) / s_i,  dP_i/ds_i = -phi(z_i) z_i / s_i,  dP_i/dthr_i = -phi(z_i) / s_i,
    and thr_i is the noisy logit ranked k-th (for i outside the top k) or (k+1)-th (inside), so
    those two elements of noisy collect the threshold gradients of their row. Infinite z has
    gradient 0, as in the reference. Recomputed in float32 from the saved inputs.
    """
    compute = torch.float64 if noisy_logits.dtype == torch.float64 else torch.float32
    clean, noisy, stddev = clean_logits.to(compute), noisy_logits.to(compute), noise_stddev.to(compute)
    g = grad_p.to(compute)
    T, E = noisy.shape
    selected = torch.zeros(T, E, dtype=torch.bool, device=noisy.device).scatter_(1, top[:, :k], True)
    kth = noisy.gather(1, top[:, k - 1 : k])
    k1th = noisy.gather(1, top[:, k : k + 1].clamp(min=0)) if k < E else torch.full_like(kth, float("-inf"))
    threshold = torch.where(selected, k1th, kth)
    diff = clean - threshold
    z = torch.where(torch.isinf(diff), diff, diff / stddev)
    z = torch.where(threshold == float("-inf"), float("inf"), z)
    infinite = torch.isinf(z)
    density = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    g_clean = torch.where(infinite, 0.0, g * density / stddev)
    g_stddev = torch.where(infinite, 0.0, -g_clean * z)
    g_threshold = -g_clean
    g_noisy = torch.zeros_like(noisy)
    g_noisy.scatter_add_(1, top[:, k - 1 : k], torch.where(selected, 0.0, g_threshold).sum(1, keepdim=True))
    if k < E:
        g_noisy.scatter_add_(1, top[:, k : k + 1], torch.where(selected, g_threshold, 0.0).sum(1, keepdim=True))
    return g_clean.to(clean_logits.dtype), g_noisy.to(noisy_logits.dtype), g_stddev.to(noise_stddev.dtype)


def _setup_context(ctx, inputs, output):
    clean_logits, noisy_logits, noise_stddev, k = inputs
    ctx.save_for_backward(clean_logits, noisy_logits, noise_stddev, output[1])
    ctx.k = k


def _backward(ctx, grad_p, grad_top):
    clean_logits, noisy_logits, noise_stddev, top = ctx.saved_tensors
    if grad_p is None:
        return None, None, None, None
    return (*_backward_from_inputs(clean_logits, noisy_logits, noise_stddev, top, ctx.k, grad_p), None)


def _backward_kernel(ctx, grad_p, grad_top):
    """Backward of the extension op: its fused one-pass backward kernel where the device has one."""
    clean_logits, noisy_logits, noise_stddev, top = ctx.saved_tensors
    if grad_p is None:
        return None, None, None, None
    kernel = backends.extension_kernel("load_probabilities_backward", noisy_logits)
    if kernel is None or torch.is_grad_enabled():  # create_graph: the torch formula, differentiable again
        return _backward(ctx, grad_p, grad_top)
    return (*kernel(grad_p, clean_logits, noisy_logits, noise_stddev, top, ctx.k), None)


def _fake(clean_logits, noisy_logits, noise_stddev, k):
    T, E = noisy_logits.shape
    return noisy_logits.new_empty((T, E)), noisy_logits.new_empty((T, k + 1), dtype=torch.int64)


_cpp = None
if backends._extension.has_kernel("load_probabilities", "CPU"):
    _cpp = _autograd.direct(torch.ops.moe_kernels.load_probabilities)
    torch.library.register_fake("moe_kernels::load_probabilities")(_fake)
    _autograd.register_autograd("moe_kernels::load_probabilities", _backward_kernel, setup_context=_setup_context)

    @torch.library.register_fake("moe_kernels::load_probabilities_backward")
    def _fake_backward(grad_p, clean_logits, noisy_logits, noise_stddev, top, k):
        return (
            torch.empty_like(clean_logits, memory_format=torch.contiguous_format),
            torch.empty_like(noisy_logits, memory_format=torch.contiguous_format),
            torch.empty_like(noise_stddev, memory_format=torch.contiguous_format),
        )


_triton = None
if backends.triton_importable():
    from moe_kernels.triton import load_probabilities as _triton_module

    _triton_module.load_probabilities.register_autograd(_backward, setup_context=_setup_context)

    def _triton(clean_logits, noisy_logits, noise_stddev, k):
        if not _triton_module.supports(noisy_logits.shape[1]):  # past the kernel's E: cuda, else the reference
            return backends.fallback("load_probabilities", "triton", noisy_logits)(
                clean_logits, noisy_logits, noise_stddev, k
            )
        return _triton_module.load_probabilities(clean_logits, noisy_logits, noise_stddev, k)


def _reference(clean_logits, noisy_logits, noise_stddev, k):
    return reference.load_probabilities(clean_logits, noisy_logits, noise_stddev, k, return_topk=True)


# No kernel has a float64 path: float64 logits run the reference (backends.choose_for).
backends.register("load_probabilities", torch=_reference, cpu=_cpp, triton=_triton, cuda=_cpp, float64=())


def load_probabilities(
    clean_logits: torch.Tensor,
    noisy_logits: torch.Tensor,
    noise_stddev: torch.Tensor,
    k: int,
    *,
    return_topk: bool = False,
):
    """P(x, i), the probability that expert i is selected when only its own noise is redrawn
    (eqs 8-9 of Shazeer et al. 2017, Appendix A, 001_5d5a678b212947b9.txt):

        P(x, i) = Phi((clean_i - kth_excluding(noisy, k, i)) / noise_stddev_i)

    kth_excluding is the (k+1)-th largest noisy logit of the row when i is among its top k, the
    k-th largest otherwise (ranking: larger value, then lower index; NaN first). Load(X)_i
    (eq 10) is P.sum(0).

    Args:
      clean_logits: [T, E] x W_g; float32 / float16 / bfloat16, any strides (float64: the
        reference, in float64).
      noisy_logits: [T, E] H(x) of eq 4, the logits the gate selected its top k from; same dtype.
      noise_stddev: [T, E] Softplus(x W_noise), > 0 (not checked: that would sync); same dtype.
      k: experts per token, 1 <= k <= E.
      return_topk: also return `top` [T, k+1] int64, the k+1 largest noisy logits' indices in
        rank order (the first k are the experts topk_softmax(noisy_logits, k) picks, so a gate
        can take its top k from here); the last column is -1 when k = E.

    Returns:
      P [T, E] in the inputs' dtype, computed in float32, float64 for float64 (or (P, top)). With k = E every expert
      is always selected: P = 1. clean = -inf (masked expert) gives P = 0.

    Differentiable with respect to all three inputs, including through the threshold elements
    of noisy_logits.
    """
    _validate.tensor("noisy_logits", noisy_logits, dim=2, shape="[T, E]", dtypes=_validate.FLOAT_DTYPES)
    for name, value in (("clean_logits", clean_logits), ("noise_stddev", noise_stddev)):
        _validate.tensor(name, value, dim=2, shape="[T, E]", dtypes=(noisy_logits.dtype,))
        if value.shape != noisy_logits.shape:
            raise ValueError(
                f"{name} must be [T, E] = {list(noisy_logits.shape)} like noisy_logits, got {tuple(value.shape)}"
            )
    E = noisy_logits.shape[1]
    if E < 1:
        raise ValueError(f"noisy_logits must be [T, E] with E >= 1, got shape {tuple(noisy_logits.shape)}")
    _validate.integer("k", k, low=1, high=E, what=f" (E = {E} experts)")
    if not isinstance(return_topk, bool):
        raise TypeError(f"return_topk must be a bool, got {type(return_topk).__name__}")
    _validate.same_device(clean_logits=clean_logits, noisy_logits=noisy_logits, noise_stddev=noise_stddev)
    probs, top = backends.implementation("load_probabilities", noisy_logits)(
        clean_logits, noisy_logits, noise_stddev, k
    )
    return (probs, top) if return_topk else probs
