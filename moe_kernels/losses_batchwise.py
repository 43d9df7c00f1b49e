"""The threshold loss of strictly balanced gating: L_batchwise (eq 20 of Shazeer et al. 2017,
Appendix F, 000_9a6c7e46ac45e7a4.txt).

Kept apart from moe_kernels/losses.py (the other auxiliary losses) so that the two can be written
at the same time; the integrator may fold this file into that one.
"""

import torch

from moe_kernels.ops import _validate
from moe_kernels.ops.batchwise_mask import threshold_mask as _threshold_mask

_DTYPES = (*_validate.ROUTING_DTYPES, torch.float64)


def batchwise_threshold_loss(scores: torch.Tensor, thresholds: torch.Tensor, batch_mask: torch.Tensor) -> torch.Tensor:
    """L_batchwise(X, T, m) = sum_j sum_i (M_threshold(x_j, T)_i - M_batchwise(X, m)_{j,i}) (X_{j,i} - T_i).

    Args:
      scores: [T, E] float, X (the gate's G_sigma(x) in the paper; the same values the masks saw).
      thresholds: [E] float, the learned per-expert thresholds T.
      batch_mask: [T, E] bool, M_batchwise(X, m) (moe_kernels.ops.batchwise_mask(scores, m)).

    Returns:
      0-dim tensor, a plain sum over tokens and experts (not a mean: the paper's formula; scale it
      with the gate's loss weight), in float32 (float64 if scores or thresholds are float64).

    Every term is >= 0: a token over its expert's threshold but outside the batchwise mask costs
    X - T > 0, a token in the mask at or under the threshold costs T - X >= 0, so the loss is 0
    exactly when the two masks agree (up to ties X == T). The masks are step functions and carry no
    gradient, so the gradients are the formula's:
      d L / d X_{j,i} = M_threshold - M_batchwise,   d L / d T_i = -sum_j (M_threshold - M_batchwise),
    i.e. a threshold rises while more tokens pass it than the batchwise mask keeps, and falls
    otherwise. Terms whose masks agree are exactly 0 (also for -inf scores, where 0 * inf would be
    NaN); a disagreeing -inf score (kept by the batchwise mask only because a column had fewer than
    m finite scores) gives +inf, and a NaN score gives NaN.
    """
    _validate.tensor("scores", scores, dim=2, shape="[T, E]", dtypes=_DTYPES)
    _validate.tensor("thresholds", thresholds, dtypes=_DTYPES)
    _validate.tensor("batch_mask", batch_mask, dtypes=(torch.bool,))
    if thresholds.shape != (scores.shape[1],):
        raise ValueError(
            f"thresholds must be [E] = [{scores.shape[1]}] for scores of shape {tuple(scores.shape)}, "
            f"got shape {tuple(thresholds.shape)}"
        )
    if batch_mask.shape != scores.shape:
        raise ValueError(
            f"batch_mask must be [T, E] = {list(scores.shape)} like scores, got shape {tuple(batch_mask.shape)}"
        )
    compute = torch.float64 if torch.float64 in (scores.dtype, thresholds.dtype) else torch.float32
    x, t = scores.to(compute), thresholds.to(compute)
    with torch.no_grad():
        diff = _threshold_mask(x.detach(), t.detach()).to(compute) - batch_mask.to(compute)
    return torch.where(diff != 0, diff * (x - t[None, :]), 0.0).sum()
