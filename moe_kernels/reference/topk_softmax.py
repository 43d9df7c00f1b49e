"""Reference top-k softmax gating: topk_router with softmax scores, its weights in the logits' dtype."""

import torch

from moe_kernels.reference.topk_router import topk_router


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool = True):
    """The k largest logits of each row and their softmax weights [T, k] in the logits' dtype.

    renormalize=True is Softmax(KeepTopK(H, k)) (eqs 3 and 5 of Shazeer et al. 2017,
    002_01a24e7ec3602eec.txt); False the full-softmax probabilities of the selected experts
    (Switch / GShard). Conventions (NaN, -0, fully masked rows) are topk_router's.
    """
    weights, experts = topk_router(logits, k, scoring="softmax", renormalize=renormalize)
    return weights.to(logits.dtype), experts
