"""Gradient estimators for MoE routers under expert capacity (Kool et al.,
004_62bca7777c830867.txt, eqs 2, 3 and 6, Appendices B-E).

Every estimator is a *surrogate loss*: a scalar whose gradient is the estimate. With log p_i(z_i)
the router's log-probability of the sampled expert, f_i the per-token loss (differentiable in the
expert parameters) and w_i a detached weight (importance weight p/q times the skip correction):

    surrogate = (1 / N) * sum_i w_i * (log p_i(z_i) * (f_i - b) + f_i)          (eqs 2, 3, 6)

    d surrogate / d router  = (1/N) sum_i w_i (f_i - b) grad log p_i(z_i)   (REINFORCE, baseline b)
    d surrogate / d experts = (1/N) sum_i w_i grad f_i                      (importance-weighted)

`sample_routing` draws z and the weights for one of the paper's strategies:

    name                proposal / sampler                         w_i                         N
    sample              z_i ~ q_i independently (no capacity)      p/q                         n
    sample_skip         ... then skip beyond capacity (biased)     delta_i p/q                 #kept
    sample_skip_iw      ... then skip beyond capacity (eq 3)       delta_i n_z/min(n_z,c) p/q  n
    gumbel_matching     z = GM(log p / tau + G) (biased)           p/q_i (tempered softmax)    n
    gumbel_matching_iw  z = GM(log p / tau + G) (eq 6)             p/q(z_i | A, G_-i)          n
    gumbel_matching_sh  z = GM(log p / tau + G) (Section 2.3)      p/p~ (Sinkhorn marginals)   n

The proposal q_i is the tempered router softmax(log p_i / tau), or, with sinkhorn=True, the
Sinkhorn-balanced sinkhorn(log p / tau) (rows 1, columns n / k). Gumbel-Matching samples are the
same either way (balancing does not change the solution of eq 4); sinkhorn=True only changes the
plain 'gumbel_matching' weights, to p / p~ (our reading of Appendix E: "we take it into account
when computing the importance weights"). `importance_weights=False` drops p/q everywhere (Figure
3, right column); the skip correction of sample_skip_iw is kept.

With sinkhorn=True the plain 'gumbel_matching' weights p / p~ are exactly those of
'gumbel_matching_sh' (same samples, same denominator): the two coincide under Sinkhorn proposals.

`gating_loss` is the paper's biased baseline, differentiable gating (Section 3.1): the same samples
and weights, but no REINFORCE term; the expert output is multiplied by the router probability
p(z_i | x_i) so that f_i carries the router's gradient, and a load-balancing loss is added:

    gating_loss = (1 / N) * sum_i w_i * f_i + load_weight * load_balancing_loss       (weight 0.01)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_kernels.ops import gumbel_matching, sinkhorn, skip_sample

ESTIMATORS = (
    "sample",
    "sample_skip",
    "sample_skip_iw",
    "gumbel_matching",
    "gumbel_matching_iw",
    "gumbel_matching_sh",
)


class EMABaseline:
    """Exponential moving average of the mean loss (decay 0.99 in the paper, Section 3)."""

    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.value: float | None = None

    def __call__(self) -> float:
        return 0.0 if self.value is None else self.value

    def update(self, f: torch.Tensor) -> None:
        m = float(f.detach().mean()) if f.numel() else 0.0
        self.value = m if self.value is None else self.decay * self.value + (1 - self.decay) * m


@dataclass
class RoutingSample:
    """experts [n] int64; weights [n] float64 (detached, 0 for skipped tokens); normalizer N."""

    experts: torch.Tensor
    weights: torch.Tensor
    normalizer: float


def proposal(log_p: torch.Tensor, tau: float, use_sinkhorn: bool) -> torch.Tensor:
    """q [n, k] float64: softmax(log p / tau), or its Sinkhorn balancing."""
    x = log_p.detach().double() / tau
    return sinkhorn(x, 200, 1e-6) if use_sinkhorn else torch.softmax(x, dim=-1)


def sample_routing(
    name: str,
    log_p: torch.Tensor,
    *,
    tau: float = 1.0,
    capacity: int | None = None,
    use_sinkhorn: bool = False,
    importance_weights: bool = True,
    generator: torch.Generator | None = None,
) -> RoutingSample:
    """Draw the experts and the surrogate weights of estimator `name` (see the module docstring).

    log_p: [n, k] router log-probabilities (only read, detached). capacity: default ceil(n / k).
    Every tensor is made on log_p's device; `generator`, if given, must be a generator of that
    device (torch.Generator(device=log_p.device)), as torch's samplers require.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"unknown estimator {name!r}; valid: {ESTIMATORS}")
    n, k = log_p.shape
    capacity = capacity if capacity is not None else max(1, math.ceil(n / k))
    lp = log_p.detach().double()
    p = lp.exp()
    q = proposal(lp, tau, use_sinkhorn)
    device = log_p.device
    rows = torch.arange(n, device=device)
    if name.startswith("sample"):
        if name == "sample":
            z = torch.multinomial(q.float(), 1, generator=generator).squeeze(1)
            skip = torch.ones(n, dtype=torch.float64, device=device)
            kept = torch.ones(n, dtype=torch.bool, device=device)
        else:
            z, kept, skip = skip_sample(q, capacity, generator=generator)
            if name == "sample_skip":
                skip = kept.double()
        iw = p[rows, z] / q[rows, z] if importance_weights else torch.ones(n, dtype=torch.float64, device=device)
        norm = float(kept.sum()) if name == "sample_skip" else float(n)
        return RoutingSample(z, skip * iw, max(norm, 1.0))
    z, q_cond = gumbel_matching(lp, tau, capacity, generator=generator)
    if name == "gumbel_matching_iw":
        denom = q_cond.double()[rows, z]
    elif name == "gumbel_matching_sh":
        denom = proposal(lp, tau, True)[rows, z]
    else:
        denom = q[rows, z]
    iw = p[rows, z] / denom if importance_weights else torch.ones(n, dtype=torch.float64, device=device)
    return RoutingSample(z, iw, float(n))


def surrogate(log_p: torch.Tensor, sample: RoutingSample, f: torch.Tensor, baseline: float = 0.0) -> torch.Tensor:
    """The REINFORCE surrogate loss of eqs 2 / 3 / 6 (module docstring).

    log_p: [n, k] router log-probabilities (differentiable); f: [n] per-token loss of the sampled
    experts (differentiable in the expert parameters); baseline: b (e.g. EMABaseline()).
    """
    w = sample.weights.to(f.dtype)
    lp = log_p.gather(1, sample.experts[:, None]).squeeze(1)
    return (w * (lp * (f.detach() - baseline) + f)).sum() / sample.normalizer


def gating_loss(log_p: torch.Tensor, sample: RoutingSample, f: torch.Tensor, load_weight: float = 0.01) -> torch.Tensor:
    """Differentiable gating with a load loss (Section 3.1; module docstring).

    log_p: [n, k] router log-probabilities (differentiable); f: [n] per-token loss of the *gated*
    output p(z_i | x_i) * expert_{z_i}(x_i), differentiable in the router and the experts;
    load_weight: the weight of `load_balancing_loss` (0.01 in Figure 2c, 0.03 also works there).
    """
    w = sample.weights.to(f.dtype)
    return (w * f).sum() / sample.normalizer + load_weight * load_balancing_loss(log_p.exp(), sample.experts)


def load_balancing_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Switch-style load loss k * sum_j (fraction of tokens routed to j) * (mean router prob of j),
    1 when balanced; used with differentiable gating (Section 3.1, weight 0.01, the paper's [8]).

    probs: [n, k] router probabilities (differentiable); experts: [n] int64 sampled experts (before
    any skipping, as the Switch Transformer counts dispatched tokens before the capacity cut).
    """
    n, k = probs.shape
    frac = torch.bincount(experts, minlength=k).to(probs.dtype) / max(n, 1)
    return k * (frac * probs.mean(0)).sum()
