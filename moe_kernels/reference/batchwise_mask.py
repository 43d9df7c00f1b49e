"""Reference batchwise top-m mask (eq 18) and threshold mask (eq 19) of Shazeer et al. 2017,
Appendix F (000_9a6c7e46ac45e7a4.txt): the specification the kernels are tested against."""

import torch

from moe_kernels.reference.ranking import descending_order


def batchwise_mask(scores: torch.Tensor, m: int):
    """M_batchwise(X, m) (eq 18): every expert keeps the m largest scores of its column.

    Args:
      scores: [T, E] float tensor (any float dtype), X_{j,i} = score of token j for expert i.
      m: tokens per expert, 0 <= m <= T.

    Returns:
      mask: [T, E] bool, exactly m True entries in every column.
      expert_tokens: [E, m] int64, the tokens of each expert in ascending token order (the order
        of the rows they came from, so a gather over them reads the input sequentially).

    Ranking order (docs/design.md): larger score first, equal scores to the lower token index,
    NaN above +inf, -0.0 == +0.0; -inf is an ordinary (lowest) score, so a column with fewer than
    m finite scores still gets exactly m tokens.
    """
    T, E = scores.shape
    compute = torch.float64 if scores.dtype == torch.float64 else torch.float32
    x = scores.to(compute)
    mask = torch.zeros(T, E, dtype=torch.bool, device=scores.device)
    expert_tokens = torch.empty(E, m, dtype=torch.int64, device=scores.device)
    for i in range(E):
        # By score, then by lower index; NaN first, -0.0 == +0.0 (reference/ranking.py).
        order = descending_order(x[:, i], dim=0)
        chosen = torch.sort(order[:m]).values
        expert_tokens[i] = chosen
        mask[chosen, i] = True
    return mask, expert_tokens


def threshold_mask(scores: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """M_threshold(x, T) (eq 19): [T, E] bool, True where scores[j, i] ranks strictly above
    thresholds[i] in the ranking order (so NaN scores are kept unless the threshold is NaN)."""
    compute = torch.promote_types(torch.promote_types(scores.dtype, thresholds.dtype), torch.float32)
    x, t = scores.to(compute), thresholds.to(compute)[None, :]
    return (x > t) | (torch.isnan(x) & ~torch.isnan(t))
