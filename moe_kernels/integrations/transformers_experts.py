"""Our experts forward for transformers' experts-implementation interface.

transformers (>= 5) routes the experts of every MoE block decorated with
`transformers.integrations.moe.use_experts_implementation` through
`ALL_EXPERTS_FUNCTIONS[config._experts_implementation]`, called as
`forward(experts_module, hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]`.
The module declares its layout: `has_gate` (gate_up_proj, split by the module's `_apply_gate`, which
also covers the interleaved layout of `is_concatenated=False`) or `up_proj` + `act_fn`;
`is_transposed` (weights [E, in, out] instead of [E, out, in]); `has_bias` (`*_proj_bias` [E, out]);
`has_post_expert_norm`.

Ours: permute (the T*k token copies sorted by expert, contiguous per expert, no padding) -> one
grouped matmul per projection (torch._grouped_mm, on CPU a matmul per expert over its rows) ->
unpermute with the routing weights. Without gradients on CPU (inference, generate) the experts run
one after another instead, each on its gathered rows through its whole MLP while the
intermediates are in cache (_forward_per_expert). Where torch's grouped matmul
does not take the dtype on the device (float64; fp16 / bf16 rows not a multiple of 16 bytes;
CUDA before sm_80 or other than bf16), the same projections run as one batched matmul over a
padded [E, C, d] buffer (capacity_positions with C = the largest count, dispatch, combine).
docs/routers.md, Experts implementation, has the measurements.
"""

from __future__ import annotations

import torch

from moe_kernels.ops import capacity_positions, combine, dispatch, permute, unpermute

NAME = "moe_kernels"


def _grouped_mm_takes(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands on their device, forward and backward: float32
    / fp16 / bf16 on CPU (16-bit rows need 16-byte strides), bf16 on CUDA from sm_80."""
    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    if x.device.type != "cpu":
        return False
    if x.element_size() == 4:
        return True
    return all(w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0 for w in weights)


def _grouped_linear(x, weight, bias, transposed, ends, expert_of_row):
    """[S, in] rows sorted by expert -> [S, out]: each expert's rows through its weight (+ bias)."""
    out = torch._grouped_mm(x, weight if transposed else weight.transpose(1, 2), offs=ends)
    if bias is not None:
        out = out + bias.index_select(0, expert_of_row)  # its backward is index_add_, not index_put_
    return out


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
    experts = top_k_index.to(torch.int64)
    weight_dtype = (self.gate_up_proj if self.has_gate else self.up_proj).dtype
    x = hidden_states.to(weight_dtype)
    first = self.gate_up_proj if self.has_gate else self.up_proj
    if x.device.type == "cpu" and not _needs_grad(x, first, self.down_proj):
        y = _forward_per_expert(self, x, experts, top_k_weights, E)
    elif _grouped_mm_takes(x, first, self.down_proj):
        y = _forward_grouped(self, x, experts, top_k_weights, E)
    else:
        y = _forward_padded(self, x, experts, top_k_weights, E)
    return y.to(hidden_states.dtype)


def _projections(self, rows, linear):
    """The expert MLP on rows: up (with the gate) -> activation -> down (-> post-expert norm)."""
    if self.has_gate:
        bias = self.gate_up_proj_bias if self.has_bias else None
        hidden = self._apply_gate(linear(rows, self.gate_up_proj, bias))
    else:
        bias = self.up_proj_bias if self.has_bias else None
        hidden = self.act_fn(linear(rows, self.up_proj, bias))
    out = linear(hidden, self.down_proj, self.down_proj_bias if self.has_bias else None)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return out


def _forward_grouped(self, x, experts, top_k_weights, E):
    T = x.shape[0]
    x_sorted, offsets, order = permute(x, experts, E)  # [T*k, d], [E+1], [T*k]
    ends = offsets[1:].to(torch.int32)
    expert_of_row = None
    if self.has_bias:  # the expert of each sorted row, for the per-expert biases
        expert_of_row = torch.repeat_interleave(
            torch.arange(E, device=x.device), offsets.diff(), output_size=T * experts.shape[1]
        )
    out = _projections(
        self, x_sorted, lambda rows, w, b: _grouped_linear(rows, w, b, self.is_transposed, ends, expert_of_row)
    )
    return unpermute(out, order, top_k_weights.to(out.dtype), T)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _forward_per_expert(self, x, experts, top_k_weights, E):
    """Inference on CPU: one expert at a time, its rows gathered into a small buffer and taken
    through its whole MLP while the [rows, d_ff] intermediates are in cache, then added into the
    output with their routing weights. The grouped path runs every elementwise step (bias, gate,
    activation) over all T*k rows out of memory, and its [T*k, d] permuted copy costs page faults
    on every call; both measured slower than transformers' eager loop (docs/routers.md)."""
    T, k = experts.shape
    flat = experts.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= E):
        raise ValueError(f"top_k_index must hold expert ids in [0, {E}), got [{int(flat.min())}, {int(flat.max())}]")
    order = torch.argsort(flat, stable=True)  # choices by expert, then by token: deterministic
    bounds = [0] + torch.bincount(flat, minlength=E).cumsum(0).tolist()
    tokens = order // k
    weights = top_k_weights.reshape(-1)[order].to(x.dtype).unsqueeze(1)
    y = x.new_zeros(T, self.down_proj.shape[2 if self.is_transposed else 1])

    def linear(rows, weight, bias, e):
        w = weight[e] if self.is_transposed else weight[e].t()
        return torch.mm(rows, w) if bias is None else torch.addmm(bias[e], rows, w)

    for e in range(E):
        a, b = bounds[e], bounds[e + 1]
        if a == b:
            continue
        rows = x.index_select(0, tokens[a:b])
        if self.has_gate:
            bias = self.gate_up_proj_bias if self.has_bias else None
            hidden = self._apply_gate(linear(rows, self.gate_up_proj, bias, e))
        else:
            bias = self.up_proj_bias if self.has_bias else None
            hidden = self.act_fn(linear(rows, self.up_proj, bias, e))
        out = linear(hidden, self.down_proj, self.down_proj_bias if self.has_bias else None, e)
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        y.index_add_(0, tokens[a:b], out * weights[a:b])
    return y


def _forward_padded(self, x, experts, top_k_weights, E):
    T = x.shape[0]
    counts = torch.bincount(experts.reshape(-1), minlength=E) if T else experts.new_zeros(E)
    capacity = int(counts.max()) if T else 0  # one host read: the buffer's size
    positions, _ = capacity_positions(experts, E, capacity)
    buffer = dispatch(x, experts, positions, E, capacity)  # [E, C, d]
    out = _projections(self, buffer, lambda rows, w, b: _linear(rows, w, b, self.is_transposed))
    return combine(out, experts, positions, top_k_weights.to(out.dtype))


def register() -> None:
    """Register `experts_forward` as the experts implementation "moe_kernels" (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
