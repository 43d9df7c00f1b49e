"""Plain softmax top-k gating (Switch Transformer k = 1, Mixtral / GShard k = 2) with the
Switch balance loss and the ST-MoE router z-loss."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import losses
from moe_kernels.gates._common import check_input, check_sizes
from moe_kernels.ops import topk_softmax
from moe_kernels.routing import Routing


class TopKGate(nn.Module):
    """experts, weights = topk_softmax(x W_r, k); aux_loss = w_aux * E sum_i f_i P_i + w_z * z-loss.

    Args:
      d_model: d; num_experts: E; k: experts per token.
      renormalize: True = weights are the softmax over the k selected logits (Mixtral); False =
        the full-softmax probabilities of the selected experts (Switch / GShard).
      jitter: multiplicative input noise x * U(1 - jitter, 1 + jitter) in training (Switch), in
        [0, 1]; 0 = off.
      w_aux: weight of the Switch balance loss; w_z: weight of the router z-loss.
      init_std: standard deviation of the router weights' normal initialisation.

    forward(x [T, d], mask=None [T] bool) -> Routing; stats {"importance": [E], "load": [E]}
    (load = tokens dispatched per expert).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int,
        renormalize: bool = True,
        jitter: float = 0.0,
        w_aux: float = 0.01,
        w_z: float = 0.001,
        init_std: float = 0.02,
    ):
        super().__init__()
        check_sizes(d_model, num_experts, k)
        if isinstance(jitter, bool) or not isinstance(jitter, int | float):
            raise TypeError(f"jitter must be a float, got {type(jitter).__name__}")
        if not 0 <= jitter <= 1:  # NaN fails too
            raise ValueError(f"jitter must be a finite number in [0, 1] (x * U(1 - jitter, 1 + jitter)), got {jitter}")
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.renormalize, self.jitter = bool(renormalize), float(jitter)
        self.w_aux, self.w_z = float(w_aux), float(w_z)
        self.w_router = nn.Parameter(torch.randn(d_model, num_experts) * init_std)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        check_input(x, self.d_model, mask)
        E, k = self.num_experts, self.k
        if self.training and self.jitter > 0:
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        logits = x @ self.w_router.to(x.dtype)
        weights, experts = topk_softmax(logits, k, renormalize=self.renormalize)
        probs = torch.softmax(logits.float(), dim=-1)
        aux_loss = self.w_aux * losses.switch_aux_loss(probs, experts, mask) + self.w_z * losses.z_loss(logits, mask)
        stats = {
            "importance": losses.importance(experts, weights, E, mask).detach(),
            "load": losses.importance(experts, torch.ones_like(weights), E, mask).detach(),
        }
        return Routing(experts=experts, weights=weights, num_experts=E, aux_loss=aux_loss, stats=stats)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, renormalize={self.renormalize}"
