"""moe_kernels.ops.batchwise_mask and threshold_mask: the masks of strictly balanced gating
(Shazeer et al. 2017, Appendix F, eqs 18 and 19; 000_9a6c7e46ac45e7a4.txt).

batchwise_mask implementations: reference (moe_kernels/reference/batchwise_mask.py), C++ CPU
(csrc/cpu/batchwise_mask.cpp), Triton (moe_kernels/triton/batchwise_mask.py), CUDA
(csrc/cuda/batchwise_mask.cu). backends.py chooses among them. threshold_mask is one elementwise
comparison that torch runs natively on every device, so it has no kernels.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _validate


def _fake_outputs(scores, m):
    T, E = scores.shape
    return scores.new_empty((T, E), dtype=torch.bool), scores.new_empty((E, m), dtype=torch.int64)


_cpp = None
if backends._extension.defines("batchwise_mask"):
    _cpp = torch.ops.moe_kernels.batchwise_mask

    @torch.library.register_fake("moe_kernels::batchwise_mask")
    def _fake(scores, m):
        return _fake_outputs(scores, m)


_triton = None
if backends.triton_importable():
    from moe_kernels.triton import batchwise_mask as _triton_module

    def _triton(scores, m):
        if not _triton_module.supports(scores.shape[1]):  # past the grid: cuda, else the reference
            return backends.fallback("batchwise_mask", "triton", scores)(scores, m)
        return _triton_module.batchwise_mask(scores, m)


# The outputs are a bool mask and int64 indices: nothing to differentiate, so no autograd formula
# (gradients reach the scores through the gate values the mask selects, eq 16).
# No kernel has a float64 path: float64 scores run the reference (backends.choose_for).
backends.register("batchwise_mask", torch=reference.batchwise_mask, cpu=_cpp, triton=_triton, cuda=_cpp, float64=())


def batchwise_mask(scores: torch.Tensor, m: int, return_indices: bool = False):
    """M_batchwise(X, m) (eq 18): every expert (column) keeps exactly the m largest scores.

    Args:
      scores: [T, E] float32 / float16 / bfloat16 (float64: the reference), any strides; X_{j,i}
        is token j's score for expert i (the paper applies it to G_sigma(x), eq 15).
      m: tokens per expert, 0 <= m <= T. The gate uses m = k|X|/n (moe_kernels.gates.batchwise).
      return_indices: also return the expert-choice layout.

    Returns:
      mask [T, E] bool with exactly m True entries per column; with return_indices=True,
      (mask, expert_tokens [E, m] int64), each expert's tokens in ascending token order, so
      dispatch needs no capacity and drops nothing.

    Ranking order (docs/design.md): larger score first, equal scores to the lower token index,
    NaN above +inf, -0.0 == +0.0; -inf is the lowest score but still counts, so every column has
    exactly m tokens whatever the input. Every backend gives the same mask and indices.
    """
    _validate.tensor("scores", scores, dim=2, shape="[T, E]", dtypes=_validate.FLOAT_DTYPES)
    T, E = scores.shape
    if E < 1:
        raise ValueError(f"scores must be [T, E] with E >= 1, got shape {tuple(scores.shape)}")
    _validate.integer("m", m, low=0, high=T, what=f" (T = {T} tokens)")
    if not isinstance(return_indices, bool):
        raise TypeError(f"return_indices must be a bool, got {type(return_indices).__name__}")
    mask, expert_tokens = backends.implementation("batchwise_mask", scores)(scores, m)
    return (mask, expert_tokens) if return_indices else mask


def threshold_mask(scores: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """M_threshold(x, T) (eq 19): [T, E] bool, True where scores[j, i] > thresholds[i].

    Args:
      scores: [T, E] float32 / float16 / bfloat16 / float64.
      thresholds: [E] float, the learned per-expert thresholds (differentiable through the loss
        of eq 20, not through this mask).

    Compared in float32 (float64 if either is float64). Consistent with the ranking order of
    batchwise_mask: a NaN score is above every threshold except NaN; -0.0 == +0.0.
    """
    dtypes = (*_validate.ROUTING_DTYPES, torch.float64)
    _validate.tensor("scores", scores, dim=2, shape="[T, E]", dtypes=dtypes)
    _validate.tensor("thresholds", thresholds, dtypes=dtypes)
    if thresholds.shape != (scores.shape[1],):
        raise ValueError(
            f"thresholds must be [E] = [{scores.shape[1]}] (one per expert of scores {tuple(scores.shape)}), "
            f"got shape {tuple(thresholds.shape)}"
        )
    _validate.same_device(scores=scores, thresholds=thresholds)
    return reference.threshold_mask(scores, thresholds)
