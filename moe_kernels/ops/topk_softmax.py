"""moe_kernels.ops.topk_softmax: top-k gating with softmax weights, a thin function over topk_router.

topk_softmax(logits, k, renormalize) is topk_router(logits, k, scoring="softmax",
renormalize=renormalize) with the weights cast to the logits' dtype: the same kernels on every
backend, the same backward (docs/routers.md).
"""

import torch

from moe_kernels import backends
from moe_kernels.ops import _validate


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool = True):
    """Top-k gating: the k largest logits of each row and their softmax weights.

    Args:
      logits: [T, E] float32 / float16 / bfloat16 / float64, any strides. -inf is legal (a masked
        expert).
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
    # topk_router's implementation directly: its checks of these arguments are the ones above.
    weights, experts = backends.implementation("topk_router", logits)(
        logits,
        k,
        scoring="softmax",
        bias=None,
        num_groups=1,
        topk_groups=1,
        group_scoring="top2_sum",
        renormalize=renormalize,
        scaling_factor=1.0,
    )
    return (weights if weights.dtype == logits.dtype else weights.to(logits.dtype)), experts
