"""BalancedAssignmentGate: BASE-layer routing (every expert gets its share of the tokens) by the
exact balanced assignment, with Gumbel-Matching sampling in training (Kool et al.,
004_62bca7777c830867.txt, Section 2.2)."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_kernels.gates._common import check_input, check_sizes, route_real_tokens
from moe_kernels.ops import balanced_assignment, gumbel_matching
from moe_kernels.routing import Routing


class BalancedAssignmentGate(nn.Module):
    """Top-1 routing with at most `capacity` tokens per expert, no token dropped.

    Training (and tau > 0): z ~ Gumbel-Matching(log p / tau) (eq 4), the exact optimum of
    log p / tau + G under the capacity; eval (or tau = 0): z = the exact optimum of the logits
    (BASE layers, tau -> 0). The gate weight is sigmoid(logit of the chosen expert) (BASE layers),
    differentiable in the router.

    Args:
      d_model, num_experts: router shape. tau: sampling temperature in training (0 = deterministic).
      capacity: tokens per expert; None = ceil(T / E) per batch (exactly T / E when E divides T).

    forward(x [T, d_model]) -> Routing with experts [T, 1], weights [T, 1], aux_loss 0 and stats:
      "log_probs" [T] (differentiable log p(z_i | x_i), for the REINFORCE surrogates of
      moe_kernels.estimators), and in sampled mode "conditionals" [T] = q(z_i | A, G_-i) (eq 9),
      the importance-weight denominators of eq 6.
    """

    def __init__(self, d_model: int, num_experts: int, tau: float = 1.0, capacity: int | None = None):
        super().__init__()
        check_sizes(d_model, num_experts)
        if isinstance(tau, bool) or not isinstance(tau, int | float):
            raise TypeError(f"tau must be a float, got {type(tau).__name__}")
        if not tau >= 0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be None or an int >= 1, got {capacity!r}")
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.d_model, self.num_experts = d_model, num_experts
        self.tau = tau
        self.capacity = capacity

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        """Routing of x [T, d]; padding tokens (mask [T] bool False) are not routed (route_real_tokens)."""
        check_input(x, self.d_model, mask, any_leading=True)
        if mask is not None:
            return route_real_tokens(self.forward, x.reshape(-1, x.shape[-1]), mask)
        logits = self.router(x)
        T, E = logits.shape
        capacity = self.capacity if self.capacity is not None else max(1, math.ceil(T / E))
        log_p = torch.log_softmax(logits.float(), dim=-1)
        stats = {}
        if self.training and self.tau > 0:
            experts, q = gumbel_matching(log_p.detach(), self.tau, capacity)
            stats["conditionals"] = q.gather(1, experts[:, None]).squeeze(1)
        else:
            experts = balanced_assignment(logits.detach(), capacity)
        stats["log_probs"] = log_p.gather(1, experts[:, None]).squeeze(1)
        weights = torch.sigmoid(logits.gather(1, experts[:, None]))
        return Routing(
            experts=experts[:, None],
            weights=weights,
            num_experts=E,
            aux_loss=logits.new_zeros(()),
            stats=stats,
        )
