"""Expert networks of a MoE layer: batched FFN weights, or any list of modules."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_kernels.ops import _validate


class BatchedFFN(nn.Module):
    """E one-hidden-layer experts E_i(x) = act(x W1_i + b1_i) W2_i + b2_i stored as batched
    weights W1 [E, d, h], W2 [E, h, d], so that the dispatch buffer [E, C, d] goes through two bmm.

    forward_buffer(buffer [E, C, d]) -> [E, C, d]; forward_expert(e, rows [n, d]) -> [n, d].
    """

    def __init__(self, num_experts: int, d_model: int, d_hidden: int, activation=torch.nn.functional.relu):
        super().__init__()
        for name, value in (("num_experts", num_experts), ("d_model", d_model), ("d_hidden", d_hidden)):
            _validate.integer(name, value, low=1)
        self.num_experts, self.d_model, self.d_hidden = num_experts, d_model, d_hidden
        self.activation = activation
        # nn.Linear's default initialisation, per expert.
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_hidden).uniform_(-1, 1) / math.sqrt(d_model))
        self.b1 = nn.Parameter(torch.empty(num_experts, 1, d_hidden).uniform_(-1, 1) / math.sqrt(d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_hidden, d_model).uniform_(-1, 1) / math.sqrt(d_hidden))
        self.b2 = nn.Parameter(torch.empty(num_experts, 1, d_model).uniform_(-1, 1) / math.sqrt(d_hidden))

    def forward_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        h = self.activation(torch.baddbmm(self.b1.to(buffer.dtype), buffer, self.w1.to(buffer.dtype)))
        return torch.baddbmm(self.b2.to(buffer.dtype), h, self.w2.to(buffer.dtype))

    def forward_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        h = self.activation(torch.addmm(self.b1[e, 0].to(rows.dtype), rows, self.w1[e].to(rows.dtype)))
        return torch.addmm(self.b2[e, 0].to(rows.dtype), h, self.w2[e].to(rows.dtype))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, d_model={self.d_model}, d_hidden={self.d_hidden}"


class ModuleExperts(nn.Module):
    """User-supplied experts: a list of E modules, each mapping [n, d] -> [n, d]."""

    def __init__(self, modules):
        super().__init__()
        self.experts = nn.ModuleList(modules)
        self.num_experts = len(self.experts)

    def forward_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        return torch.stack([expert(buffer[e]) for e, expert in enumerate(self.experts)])

    def forward_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.experts[e](rows)
