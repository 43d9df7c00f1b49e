"""Two-level hierarchical MoE (Shazeer et al. 2017, Section 2): a primary gate chooses a sparse
weighted combination of groups, each group a MoE with its own gate."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels.gates.noisy_topk import NoisyTopKGate
from moe_kernels.layers.moe import MoE, balance_stats, flatten_tokens, run_sorted
from moe_kernels.losses import importance as importance_of
from moe_kernels.ops import permute, unpermute


class _Groups(nn.Module):
    """The secondary MoEs seen as "experts" of the primary routing (forward_expert interface)."""

    def __init__(self, groups):
        super().__init__()
        self.groups = nn.ModuleList(groups)

    def forward_expert(self, g: int, rows: torch.Tensor) -> torch.Tensor:
        return self.groups[g](rows)


class HierarchicalMoE(nn.Module):
    """y = sum_g G_primary(x)_g MoE_g(x), MoE_g(x) = sum_i G_g(x)_i E_{g,i}(x).

    Args:
      d_model: d; num_groups: a; experts_per_group: b; d_hidden: the experts' hidden size.
      k_primary: groups per token; k_secondary: experts per token inside a group.
      primary_gate: default NoisyTopKGate(d, a, k_primary).
      capacity_factor: of the secondary MoEs (None = dropless). The primary level is dropless:
        each group receives exactly the tokens routed to it (a sub-batch), so its gate and its
        balance losses see only those tokens.
      **moe_kwargs: passed to every secondary MoE.

    The reading implemented: Appendix B of the paper (its hierarchical details) is not among the
    seeds; this is Section 2's description. forward(x [..., d], mask=None) -> y [..., d];
    `aux_loss` = primary gate's + sum of the groups'; `stats` = the primary level's balance
    numbers (load = tokens per group), "dropped_fraction" over the groups' choices, and
    "groups": each group's stats.
    """

    def __init__(
        self,
        d_model: int,
        num_groups: int,
        experts_per_group: int,
        d_hidden: int,
        k_primary: int = 1,
        k_secondary: int = 2,
        primary_gate: nn.Module | None = None,
        capacity_factor: float | None = 1.25,
        **moe_kwargs,
    ):
        super().__init__()
        self.d_model, self.num_groups = d_model, num_groups
        self.primary_gate = NoisyTopKGate(d_model, num_groups, k_primary) if primary_gate is None else primary_gate
        self.groups = _Groups(
            MoE(d_model, experts_per_group, d_hidden, k=k_secondary, capacity_factor=capacity_factor, **moe_kwargs)
            for _ in range(num_groups)
        )
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        lead, xf, mf = flatten_tokens(x, mask, self.d_model)
        routing = self.primary_gate(xf) if mf is None else self.primary_gate(xf, mask=mf)
        if routing.layout != "topk" or routing.num_experts != self.num_groups:
            raise ValueError("the primary gate must return a 'topk' Routing over num_groups groups")
        experts = routing.experts if mf is None else torch.where(mf[:, None], routing.experts, -1)
        x_sorted, offsets, order = permute(xf, experts, self.num_groups)
        y_sorted = run_sorted(self.groups, x_sorted, offsets, self.num_groups)
        y = unpermute(y_sorted, order, routing.weights.to(xf.dtype), xf.shape[0])

        groups = self.groups.groups
        self.aux_loss = routing.aux_loss + sum(g.aux_loss for g in groups)
        routed = sum(g.stats["load"].sum() for g in groups)
        dropped = sum(g.stats["dropped_fraction"] * g.stats["load"].sum() for g in groups)
        importance = importance_of(routing.experts, routing.weights, self.num_groups, mf)
        self.stats = {
            **balance_stats(offsets.diff(), importance, dropped, routed),
            "groups": [g.stats for g in groups],
        }
        return y.reshape(*lead, self.d_model)
