"""Routing: the one object every gate returns and every layer consumes (docs/design.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Routing:
    """Where each token goes and with what weight.

    Attributes:
      experts: [T, k] int64 expert of each (token, choice); -1 marks an empty choice.
      weights: [T, k] float gate value of each choice (0 for empty choices).
      num_experts: E.
      aux_loss: 0-dim tensor, the gate's auxiliary loss for this step (0 when it has none).
      layout: "topk" (the [T, k] tensors above are authoritative) or "expert_choice" (each expert
        picked its tokens: `expert_tokens` / `expert_weights` are authoritative and `experts` /
        `weights` are the same routing seen from the tokens, with k = the most experts any token
        got). The layer asks the Routing how to dispatch; it never asks which gate it has.
      expert_tokens: [E, m] int64 token indices (expert_choice layout only; -1 = empty).
      expert_weights: [E, m] float gate values (expert_choice layout only).
      stats: gate-specific numbers for logging (tensors or floats), e.g. tokens with no expert.
    """

    experts: torch.Tensor
    weights: torch.Tensor
    num_experts: int
    aux_loss: torch.Tensor
    layout: str = "topk"
    expert_tokens: torch.Tensor | None = None
    expert_weights: torch.Tensor | None = None
    stats: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.experts.shape[0]

    @property
    def k(self) -> int:
        return self.experts.shape[1]

    def dense(self) -> torch.Tensor:
        """[T, E] gate matrix G(x): weights at the chosen experts, 0 elsewhere."""
        T, E = self.num_tokens, self.num_experts
        out = self.weights.new_zeros(T, E + 1)  # column E collects the empty (-1) choices
        idx = torch.where(self.experts < 0, E, self.experts)
        out.scatter_add_(1, idx, self.weights)
        return out[:, :E]
