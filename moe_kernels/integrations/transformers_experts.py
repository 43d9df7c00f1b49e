"""Our experts forward for transformers' experts-implementation interface.

transformers (>= 5) routes the experts of every MoE block decorated with
`transformers.integrations.moe.use_experts_implementation` through
`ALL_EXPERTS_FUNCTIONS[config._experts_implementation]`, called as
`forward(experts_module, hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]`.
The module declares its layout: `has_gate` (gate_up_proj, split by the module's `_apply_gate`, which
also covers the interleaved layout of `is_concatenated=False`) or `up_proj` + `act_fn`;
`is_transposed` (weights [E, in, out] instead of [E, out, in]); `has_bias` (`*_proj_bias` [E, out]);
`has_post_expert_norm`.

Ours: capacity_positions with capacity = the largest expert's count (no token is dropped) ->
dispatch into [E, C, d] -> one batched matmul per projection -> combine with the routing weights.
On CPU a batched matmul over the padded [E, C, d] buffer is several times faster than torch's
grouped matmul or a loop of per-expert matmuls (docs/routers.md, Experts implementation); the
padding costs max-count / mean-count extra rows.
"""

from __future__ import annotations

import torch

from moe_kernels.ops import capacity_positions, combine, dispatch

NAME = "moe_kernels"


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """[E, C, in] x per-expert weight -> [E, C, out] (+ bias [E, out])."""
    out = torch.bmm(x, weight if transposed else weight.transpose(1, 2))
    if bias is not None:
        out = out + bias.unsqueeze(1)
    return out


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """transformers' experts interface on our dispatch / combine kernels.

    Args:
      self: the experts module (gate_up_proj / up_proj, down_proj, optional biases, act_fn).
      hidden_states: [T, d] in the model's dtype.
      top_k_index: [T, k] integer expert ids in [0, num_experts).
      top_k_weights: [T, k] routing weights (any float dtype).

    Returns:
      [T, d] in hidden_states' dtype: sum over s of weights[t, s] * expert_{index[t, s]}(x_t).
    """
    if getattr(self, "_is_expert_parallel", False):
        # Expert-parallel sentinels (ids >= num_experts) are transformers' own protocol.
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    E = self.num_experts
    T, d = hidden_states.shape
    experts = top_k_index.to(torch.int64)
    weight_dtype = (self.gate_up_proj if self.has_gate else self.up_proj).dtype
    x = hidden_states.to(weight_dtype)
    counts = torch.bincount(experts.reshape(-1), minlength=E) if T else experts.new_zeros(E)
    capacity = int(counts.max()) if T else 0  # one host read: the buffer's size
    positions, _ = capacity_positions(experts, E, capacity)
    buffer = dispatch(x, experts, positions, E, capacity)  # [E, C, d]
    if self.has_gate:
        bias = self.gate_up_proj_bias if self.has_bias else None
        hidden = self._apply_gate(_linear(buffer, self.gate_up_proj, bias, self.is_transposed))
    else:
        bias = self.up_proj_bias if self.has_bias else None
        hidden = self.act_fn(_linear(buffer, self.up_proj, bias, self.is_transposed))
    out = _linear(hidden, self.down_proj, self.down_proj_bias if self.has_bias else None, self.is_transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    y = combine(out, experts, positions, top_k_weights.to(out.dtype))
    return y.to(hidden_states.dtype)


def register() -> None:
    """Register `experts_forward` as the experts implementation "moe_kernels" (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
