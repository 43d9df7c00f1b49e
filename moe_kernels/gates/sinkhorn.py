"""SinkhornGate: top-1 routing balanced in expectation by Sinkhorn normalisation (Kool et al.,
004_62bca7777c830867.txt, Section 2.3; the routing of Megatron's Sinkhorn/BASE option)."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels.gates._common import check_input, check_sizes, route_real_tokens
from moe_kernels.ops import sinkhorn
from moe_kernels.routing import Routing


class SinkhornGate(nn.Module):
    """Training: z_i = argmax_j p~_ij with p~ = sinkhorn(logits) (rows 1, columns T / E), so the
    expert loads are balanced in expectation but not exactly (no capacity: no token is dropped;
    stats report the overload). Eval: z_i = argmax_j logits_ij. The gate weight is
    sigmoid(logit of the chosen expert), differentiable in the router; the Sinkhorn matrix is not.

    forward(x [T, d_model]) -> Routing with experts [T, 1], weights [T, 1], aux_loss 0, stats
    "max_load" = the largest expert load divided by T / E (1 = perfectly balanced).
    """

    def __init__(self, d_model: int, num_experts: int, num_iters: int = 100, tol: float = 1e-4):
        super().__init__()
        check_sizes(d_model, num_experts)
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.d_model, self.num_experts = d_model, num_experts
        self.num_iters = num_iters
        self.tol = tol

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        """Routing of x [T, d]; padding tokens (mask [T] bool False) are not routed (route_real_tokens)."""
        check_input(x, self.d_model, mask, any_leading=True)
        if mask is not None:
            return route_real_tokens(self.forward, x.reshape(-1, x.shape[-1]), mask)
        logits = self.router(x)
        T, E = logits.shape
        if self.training:
            experts = sinkhorn(logits.detach().float(), self.num_iters, self.tol).argmax(-1)
        else:
            experts = logits.detach().argmax(-1)
        weights = torch.sigmoid(logits.gather(1, experts[:, None]))
        load = torch.bincount(experts, minlength=E).max() / max(T / E, 1e-9) if T else torch.tensor(0.0)
        return Routing(
            experts=experts[:, None],
            weights=weights,
            num_experts=E,
            aux_loss=logits.new_zeros(()),
            stats={"max_load": load},
        )
