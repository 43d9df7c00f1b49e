"""Auxiliary-loss-free load balancing (DeepSeek-V3, Liu et al. 2024, arXiv 2412.19437, Section
2.1.2): a per-expert bias added to the scores decides which experts are selected, never how much
they weigh, and is nudged after each training step towards balance:
    b_i += rate * sign(mean_j c_j - c_i),  c = tokens routed to each expert during the step.
Optionally the paper's complementary sequence-wise balance loss (losses.sequence_balance_loss)."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import losses
from moe_kernels.gates._common import check_input, check_sizes
from moe_kernels.ops import topk_router
from moe_kernels.ops.topk_router import check_options
from moe_kernels.routing import Routing


@torch.no_grad()
def update_selection_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """bias += rate * sign(mean(counts) - counts), in place; returns bias.

    bias: [E] float (the selection bias); counts: [E] tokens routed to each expert (any real
    dtype); rate: the update speed gamma (DeepSeek-V3 used 1e-3). An expert above the mean count
    loses `rate`, one below gains it, one exactly at the mean is unchanged.
    """
    if bias.dim() != 1 or counts.shape != bias.shape:
        raise ValueError(f"bias and counts must both be [E], got {tuple(bias.shape)} and {tuple(counts.shape)}")
    c = counts.to(bias.dtype)
    bias.add_(rate * torch.sign(c.mean() - c))
    return bias


class AuxLossFreeGate(nn.Module):
    """experts, weights = topk_router(x W_r, k, bias=selection_bias, ...), the bias updated by
    `update_bias()` from the counts of the training forwards since the last update.

    Args:
      d_model: d; num_experts: E; k: experts per token.
      scoring: "sigmoid" (DeepSeek-V3) or "softmax"; num_groups / topk_groups: group-limited
        routing; renormalize, scaling_factor: as topk_router.
      bias_update_rate: gamma of the update rule.
      seq_balance_weight: alpha of the sequence-wise balance loss (0 = no auxiliary loss at all);
      seq_len: tokens per sequence for that loss (None: the whole batch is one sequence).
      init_std: standard deviation of the router weights' normal initialisation.

    Buffers: `selection_bias` [E] float32 (saved in the state_dict, never given a gradient) and
    `step_counts` [E] float32 (tokens per expert since the last update_bias()).

    Training loop: `loss.backward(); optimizer.step(); gate.update_bias()` (or
    `AuxLossFreeGate.update_all(model)`); with gradient accumulation, call it once per optimizer
    step: the counts of every micro-batch in between are summed.

    forward(x [T, d], mask=None [T] bool) -> Routing; stats {"importance": [E], "load": [E]}.
    Masked (padding) tokens are neither counted for the bias nor in the loss.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int,
        *,
        scoring: str = "sigmoid",
        num_groups: int = 1,
        topk_groups: int | None = None,
        renormalize: bool = True,
        scaling_factor: float = 1.0,
        bias_update_rate: float = 1e-3,
        seq_balance_weight: float = 0.0,
        seq_len: int | None = None,
        init_std: float = 0.02,
    ):
        super().__init__()
        check_sizes(d_model, num_experts, k)
        if not bias_update_rate >= 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {bias_update_rate}")
        if not seq_balance_weight >= 0:
            raise ValueError(f"seq_balance_weight must be >= 0, got {seq_balance_weight}")
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.router = dict(
            scoring=scoring,
            num_groups=num_groups,
            topk_groups=topk_groups,
            renormalize=bool(renormalize),
            scaling_factor=scaling_factor,
        )
        check_options(num_experts, k, **self.router)  # here, not at the first forward
        self.router["scaling_factor"] = float(scaling_factor)
        self.bias_update_rate, self.seq_balance_weight = float(bias_update_rate), float(seq_balance_weight)
        self.seq_len = seq_len
        self.w_router = nn.Parameter(torch.randn(d_model, num_experts) * init_std)
        self.register_buffer("selection_bias", torch.zeros(num_experts))
        self.register_buffer("step_counts", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        check_input(x, self.d_model, mask)
        E = self.num_experts
        logits = x.float() @ self.w_router.float()
        weights, experts = topk_router(logits, self.k, bias=self.selection_bias, **self.router)
        ones = torch.ones_like(weights)
        load = losses.importance(experts, ones, E, mask).detach()
        if self.training:
            self.step_counts += load
        aux_loss = logits.new_zeros(())
        if self.seq_balance_weight > 0:
            scores = torch.sigmoid(logits) if self.router["scoring"] == "sigmoid" else torch.softmax(logits, dim=-1)
            aux_loss = self.seq_balance_weight * losses.sequence_balance_loss(scores, experts, self.seq_len, mask)
        stats = {"importance": losses.importance(experts, weights, E, mask).detach(), "load": load}
        return Routing(experts=experts, weights=weights.to(x.dtype), num_experts=E, aux_loss=aux_loss, stats=stats)

    @torch.no_grad()
    def update_bias(self) -> None:
        """Apply the update rule to the counts since the last call, then reset them. A no-op
        when no training forward was counted (e.g. in eval)."""
        if self.step_counts.sum() > 0:
            update_selection_bias(self.selection_bias, self.step_counts, self.bias_update_rate)
        self.step_counts.zero_()

    @staticmethod
    def update_all(model: nn.Module) -> None:
        """update_bias() on every AuxLossFreeGate inside `model`."""
        for module in model.modules():
            if isinstance(module, AuxLossFreeGate):
                module.update_bias()

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, {self.router}"
