"""BatchwiseGate: strictly balanced gating (Shazeer et al. 2017, Appendix F,
000_9a6c7e46ac45e7a4.txt). Training routes with the batchwise mask (eq 18: every expert takes
exactly m = k|X|/n tokens of the batch, i.e. expert-choice routing) and learns per-expert
thresholds with L_batchwise (eq 20); inference routes with the threshold mask (eq 19), which
needs no batch. Gate values are the sparse gate of eq 16 over G_sigma(x) = Softmax(x W_g) (eq 15).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_kernels.gates._common import check_input, check_sizes, route_real_tokens
from moe_kernels.gates.sparse_mask import sparse_gates
from moe_kernels.losses import batchwise_threshold_loss
from moe_kernels.ops import batchwise_mask, threshold_mask
from moe_kernels.routing import Routing

MODES = ("auto", "batchwise", "threshold")


def tokens_per_expert(num_tokens: int, num_experts: int, k: int) -> int:
    """m = k|X|/n (Appendix F), rounded UP when it is not whole, and at most |X|.

    Rounding up keeps the average number of experts per token at least k (never below what the
    top-k gate it replaces would give) and gives every expert at least one token of a non-empty
    batch; the excess is below one token per expert. (T = 0 gives m = 0.)
    """
    return min(num_tokens, math.ceil(k * num_tokens / num_experts))


def _token_view(mask: torch.Tensor, gates: torch.Tensor):
    """[T, E] mask and gates -> (experts [T, w], weights [T, w], per-token count [T]) with the
    experts of each token in ascending order and -1 / 0 padding; w = the most experts any token
    has, at least 1 (a device sync: the width depends on the data)."""
    T, E = mask.shape
    counts = mask.sum(dim=1)
    width = max(1, int(counts.max())) if T else 1
    width = min(width, E)
    # A stable sort of the mask puts each row's chosen experts first, in expert order.
    order = torch.sort(mask.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :width]
    valid = torch.arange(width, device=mask.device)[None, :] < counts[:, None]
    experts = torch.where(valid, order, -1)
    weights = torch.where(valid, gates.gather(1, order), 0.0)
    return experts, weights, counts


class BatchwiseGate(nn.Module):
    """Batchwise (expert-choice) gating in training, learned thresholds at inference.

    Args:
      d_model: input features.
      num_experts: n (E).
      k: the average number of experts per token; training uses m = ceil(k T / E) tokens per expert
        (tokens_per_expert).
      threshold_loss_weight: the weight of L_batchwise (eq 20) in aux_loss. The loss is a sum over
        tokens and experts, so it grows with the batch; the paper gives no weight.
      mode: "auto" (batchwise in train(), threshold in eval()), "batchwise" or "threshold" to force
        one in both.

    forward(x [..., d_model]) -> Routing over the T = x.numel() / d_model tokens:
      - batchwise: layout "expert_choice": expert_tokens [E, m] (ascending token indices) and
        expert_weights [E, m] are authoritative; no capacity, nothing dropped. aux_loss =
        threshold_loss_weight * L_batchwise(G_sigma, thresholds, M_batchwise).
      - threshold: layout "topk" with a variable number of experts per token (-1 padding),
        aux_loss = 0.
      In both, experts / weights [T, w] are the token view (w = the most experts any token got,
      at least 1, found with one device sync), weights are eq 16's G(x), and stats holds
      "tokens_without_expert" (tokens routed nowhere: their output is 0), "tokens_over_k" (tokens
      with more than k experts), "expert_load" [E], "max_load" (max / mean expert load), "m"
      (tokens per expert in batchwise mode, else None), "mode".

    W_g starts as nn.Linear's default (random: with all scores equal, the batchwise mask would
    send the first m tokens to every expert); thresholds start at 1/E, the uniform probability.
    """

    def __init__(self, d_model: int, num_experts: int, k: int, threshold_loss_weight: float = 1e-2, mode: str = "auto"):
        super().__init__()
        check_sizes(d_model, num_experts)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"k must be an int in [1, num_experts = {num_experts}], got {k!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.d_model, self.num_experts = d_model, num_experts
        self.k = k
        self.threshold_loss_weight = threshold_loss_weight
        self.mode = mode
        self.w_gate = nn.Linear(d_model, num_experts, bias=False)
        self.thresholds = nn.Parameter(torch.full((num_experts,), 1.0 / num_experts))

    def current_mode(self) -> str:
        if self.mode != "auto":
            return self.mode
        return "batchwise" if self.training else "threshold"

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        """Routing of x [T, d]; padding tokens (mask [T] bool False) are not routed (route_real_tokens)."""
        check_input(x, self.d_model, mask, any_leading=True)
        if mask is not None:
            return route_real_tokens(self.forward, x.reshape(-1, x.shape[-1]), mask)
        x = x.reshape(-1, x.shape[-1])
        T, E = x.shape[0], self.num_experts
        probs = torch.softmax(self.w_gate(x).float(), dim=-1)  # G_sigma(x), eq 15
        mode = self.current_mode()
        expert_tokens = expert_weights = None
        m = None
        if mode == "batchwise":
            m = tokens_per_expert(T, E, self.k)
            mask, expert_tokens = batchwise_mask(probs.detach(), m, return_indices=True)
            gates = sparse_gates(probs, mask)
            expert_weights = gates.t().gather(1, expert_tokens)
            aux_loss = self.threshold_loss_weight * batchwise_threshold_loss(probs, self.thresholds, mask)
            layout = "expert_choice"
        else:
            mask = threshold_mask(probs.detach(), self.thresholds.detach())
            gates = sparse_gates(probs, mask)
            aux_loss = probs.new_zeros(())
            layout = "topk"
        experts, weights, counts = _token_view(mask, gates)
        load = mask.sum(dim=0)
        stats = {
            "mode": mode,
            "m": m,
            "tokens_without_expert": (counts == 0).sum(),
            "tokens_over_k": (counts > self.k).sum(),
            "expert_load": load,
            "max_load": load.max() / load.float().mean().clamp_min(1e-9) if T else probs.new_zeros(()),
        }
        return Routing(
            experts=experts,
            weights=weights.to(x.dtype),
            num_experts=E,
            aux_loss=aux_loss,
            layout=layout,
            expert_tokens=expert_tokens,
            expert_weights=None if expert_weights is None else expert_weights.to(x.dtype),
            stats=stats,
        )
