"""Reference top-k softmax gating: the specification the kernels are tested against."""

import torch

from moe_kernels.reference.ranking import descending_order


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool = True):
    """Select the k largest logits of each row and weight them by a softmax.

    Args:
      logits: [T, E] float tensor (any float dtype; computed in float32, or float64 for float64).
      k: number of experts per token, 1 <= k <= E.
      renormalize: True gives Softmax(KeepTopK(H, k)) (eqs 3 and 5 of Shazeer et al. 2017,
        002_01a24e7ec3602eec.txt): a softmax over the k selected logits. False gives the full
        softmax probabilities of the selected experts (the Switch / GShard convention).

    Returns:
      weights: [T, k] in the logits' dtype.
      experts: [T, k] int64, by descending logit; equal logits go to the lower expert index.

    Conventions every backend follows:
      - NaN ranks above every number (reference/ranking.py), so a row with a NaN selects it and its
        weights are NaN.
      - -0.0 and +0.0 are equal (a tie, broken by index).
      - A row whose largest selected logit is -inf (a fully masked token) gets weights 0.
    """
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute)
    # A stable descending sort is the plain statement of "by value, then by lower index".
    order = descending_order(x)
    values = x.gather(1, order)
    experts = order[:, :k]
    row_max = values[:, :1]
    masked = row_max == float("-inf")
    # Masked rows go through the softmax as zeros so that their gradient is 0, not NaN.
    if renormalize:
        weights = torch.softmax(torch.where(masked, 0.0, values[:, :k]), dim=-1)
    else:
        weights = torch.softmax(torch.where(masked, 0.0, x), dim=-1).gather(1, experts)
    weights = torch.where(masked, torch.zeros_like(weights), weights)
    return weights.to(logits.dtype), experts
