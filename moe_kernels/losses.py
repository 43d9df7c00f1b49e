"""Balancing losses and regularisers of the gates (all differentiable, all with optional token
masks so that padding does not count: transformers #28505, Megatron PR #2121).

Terms: T tokens, E experts, k choices per token. `mask` is an optional [T] tensor, True / 1 for a
real token and False / 0 for padding; masked tokens contribute nothing to any statistic.
"""

from __future__ import annotations

import torch

from moe_kernels.ops import _validate
from moe_kernels.ops.batchwise_mask import threshold_mask as _threshold_mask


def _token_weights(mask: torch.Tensor | None, T: int, like: torch.Tensor) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.shape != (T,):
        raise ValueError(f"mask must be [T] = [{T}], got shape {tuple(mask.shape)}")
    return mask.to(like.dtype)


def cv_squared(x: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """CV(x)^2 = Var(x) / mean(x)^2 of a vector x [E] (population variance, as the authors'
    tensor2tensor code); 0 for a single element. eps keeps an all-zero x finite."""
    x = x.float()
    if x.numel() <= 1:
        return x.new_zeros(())
    mean = x.mean()
    return ((x - mean) ** 2).mean() / (mean**2 + eps)


def importance(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, mask=None) -> torch.Tensor:
    """Importance(X) [E] = sum over tokens of G(x) (Shazeer et al. 2017, Section 4), from the
    sparse gate: experts [T, k] int64 (-1 = empty), weights [T, k]. Differentiable in weights."""
    T = experts.shape[0]
    w = weights.float()
    m = _token_weights(mask, T, w)
    if m is not None:
        w = w * m[:, None]
    w = torch.where(experts >= 0, w, 0.0)
    return w.new_zeros(num_experts + 1).index_add(
        0, torch.where(experts >= 0, experts, num_experts).reshape(-1), w.reshape(-1)
    )[:num_experts]


def importance_loss(experts, weights, num_experts: int, w_importance: float, mask=None) -> torch.Tensor:
    """L_importance = w_importance * CV(Importance(X))^2 (Shazeer et al. 2017, eq 7)."""
    return w_importance * cv_squared(importance(experts, weights, num_experts, mask))


def load(load_probabilities: torch.Tensor, mask=None) -> torch.Tensor:
    """Load(X) [E] = sum over tokens of P(x, i) (eq 10), P [T, E] from ops.load_probabilities."""
    p = load_probabilities.float()
    m = _token_weights(mask, p.shape[0], p)
    return (p * m[:, None]).sum(0) if m is not None else p.sum(0)


def load_loss(load_probabilities: torch.Tensor, w_load: float, mask=None) -> torch.Tensor:
    """L_load = w_load * CV(Load(X))^2 (eq 11)."""
    return w_load * cv_squared(load(load_probabilities, mask))


def switch_aux_loss(router_probs: torch.Tensor, experts: torch.Tensor, mask=None) -> torch.Tensor:
    """The Switch / GShard balance loss E * sum_i f_i * P_i.

    router_probs: [T, E] full softmax of the router logits; experts: [T, k] int64 (-1 = empty).
    f_i = fraction of the (token, choice) pairs dispatched to i (normalised by the number of
    non-empty choices, so the loss is 1 at perfect balance for every k), P_i = mean router
    probability of i. Differentiable through router_probs only (f is a count).
    """
    T, E = router_probs.shape
    p = router_probs.float()
    m = _token_weights(mask, T, p)
    valid = (experts >= 0).float()
    if m is not None:
        valid = valid * m[:, None]
    counts = p.new_zeros(E + 1).index_add(0, torch.where(experts >= 0, experts, E).reshape(-1), valid.reshape(-1))[:E]
    f = counts / valid.sum().clamp(min=1)
    tokens = m.sum().clamp(min=1) if m is not None else p.new_tensor(float(max(T, 1)))
    P = ((p * m[:, None]).sum(0) if m is not None else p.sum(0)) / tokens
    return E * (f * P).sum()


def z_loss(router_logits: torch.Tensor, mask=None) -> torch.Tensor:
    """Router z-loss of ST-MoE: mean over tokens of logsumexp(logits)^2. router_logits [T, E]."""
    x = router_logits.float()
    z = torch.logsumexp(x, dim=-1) ** 2
    m = _token_weights(mask, x.shape[0], x)
    if m is None:
        return z.mean() if z.numel() else z.sum()
    return (z * m).sum() / m.sum().clamp(min=1)


# The threshold loss of strictly balanced gating: L_batchwise (eq 20 of Shazeer et al. 2017,
# Appendix F, 000_9a6c7e46ac45e7a4.txt).
_THRESHOLD_LOSS_DTYPES = (*_validate.ROUTING_DTYPES, torch.float64)


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
    _validate.tensor("scores", scores, dim=2, shape="[T, E]", dtypes=_THRESHOLD_LOSS_DTYPES)
    _validate.tensor("thresholds", thresholds, dtypes=_THRESHOLD_LOSS_DTYPES)
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


def sequence_balance_loss(scores: torch.Tensor, experts: torch.Tensor, seq_len: int | None = None, mask=None):
    """DeepSeek-V3's complementary sequence-wise balance loss (arXiv 2412.19437, eqs 17-20),
    without its weight alpha, averaged over the sequences of the batch:

        L = sum_i f_i P_i,  f_i = E / (k T_s) * #{t in the sequence: i among the k chosen for t},
        P_i = 1/T_s sum_t s'_{i,t},  s'_{i,t} = s_{i,t} / sum_j s_{j,t}

    It is E / k at a sequence whose tokens all pick the same k experts with all their normalised
    score, 1 at perfect balance.

    Args:
      scores: [T, E] the router's scores s (sigmoid or softmax of the logits); differentiable.
      experts: [T, k] int64 chosen experts (-1 = empty); counts only, no gradient.
      seq_len: tokens per sequence: the T tokens are T / seq_len consecutive sequences; None = one.
      mask: [T] bool or float token weights (padding 0): T_s counts the unmasked tokens.
    """
    T, E = scores.shape
    k = experts.shape[1]
    S = T if seq_len is None else seq_len
    if S < 1 or T % S:
        raise ValueError(f"seq_len must divide the number of tokens T = {T}, got {seq_len}")
    B = T // S if T else 0
    s = scores.float()
    s = s / s.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
    m = _token_weights(mask, T, s)
    m = torch.ones(T, dtype=s.dtype, device=s.device) if m is None else m
    chosen = (experts >= 0).to(s.dtype) * m[:, None]
    slot = torch.where(experts >= 0, experts, E) + (torch.arange(T, device=s.device) // max(S, 1) * (E + 1))[:, None]
    counts = s.new_zeros(B * (E + 1)).index_add(0, slot.reshape(-1), chosen.reshape(-1)).view(B, E + 1)[:, :E]
    tokens = m.view(B, S).sum(dim=1).clamp(min=1)
    f = counts * (E / (k * tokens))[:, None]
    P = (s * m[:, None]).view(B, S, E).sum(dim=1) / tokens[:, None]
    return (f * P).sum(dim=-1).mean() if B else s.sum() * 0
