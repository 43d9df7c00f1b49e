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
unpermute with the routing weights (float32 products of the float32 router weights, summed in
float32 and rounded once). Without gradients on CPU at a few tokens (fewer than FEW_CHOICES (token,
expert) choices, or, with chosen_linear, up to FEW_ROWS_PER_EXPERT an expert), the ids are read on
the host; where at least 1 in KERNEL_SHARE choices fall in experts of at most CHOSEN_LINEAR_ROWS
rows, only the chosen experts run, on views of their weights (torch._grouped_mm on CPU runs a matmul
per expert of all E, empty or not): those experts through the chosen_linear op
(csrc/cpu/chosen_linear.cpp, both weight layouts), the longer ones through one torch._grouped_mm
over their rows (or a torch.mm each while fewer than E / LONG_SHARE). Without chosen_linear, the
same for at most k or E / CHOSEN_SHARE distinct experts; else the grouped path below (transformers'
own grouped_mm forward without our permute kernel). Where torch's grouped matmul does not take the
dtype on the device (float64; fp16 / bf16 rows not a multiple of 16 bytes; CUDA before sm_80 or
other than bf16), the same projections run as one batched matmul over a padded [E, C, d] buffer
(capacity_positions with C = the largest count, dispatch, combine).

Traced (torch.compile; fake or meta tensors) every call takes the grouped path, which reads no
value on the host and whose shapes follow T, k and E only (one graph per forward, no break):
permute ([T*k, d] rows, offsets [E+1]; in torch ops where the permute op would run the reference,
e.g. on the meta device), then per projection torch._grouped_mm where its fake takes the dtype
(bf16) and otherwise our grouped matmul op (`moe_kernels::experts_grouped_mm`: its fake gives
[S, out]; its kernel is torch._grouped_mm where the device takes the dtype, else a matmul per
expert, reading the offsets inside the op), then the weighted sum over k in torch ops (the
unpermute kernel's `int num_tokens` would specialise the graph to one T).
docs/routers.md, Experts implementation, has the measurements.
"""

from __future__ import annotations

import collections
import functools
import itertools
import typing

import torch

from moe_kernels import _extension, backends
from moe_kernels.ops import capacity_positions, combine, dispatch, permute, unpermute

NAME = "moe_kernels"


_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
_GROUPED_MM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grouped_mm_takes(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch._grouped_mm runs these operands on their device, forward and backward: float32
    / fp16 / bf16 on CPU (16-bit rows need 16-byte strides), bf16 on CUDA from sm_80."""
    device = _device_takes(x)
    if device is not None:
        return device
    return all(size % 8 == 0 for w in weights for size in w.shape[1:])


def _sizes_take(x: torch.Tensor, *sizes: int) -> bool:
    """_grouped_mm_takes for x with operands whose two inner sizes are `sizes`."""
    device = _device_takes(x)
    return device if device is not None else all(size % 8 == 0 for size in sizes)


def _device_takes(x: torch.Tensor) -> bool | None:
    """_grouped_mm_takes where x alone decides it (asked once per experts call at decode: cheap
    first), None where it depends on the operands' sizes (16-bit CPU rows)."""
    if not _HAS_GROUPED_MM or x.dtype not in _GROUPED_MM_DTYPES:
        return False
    device = x.device.type
    if device == "cpu":
        return True if x.element_size() == 4 else None
    if device == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)
    return False


def _traced(x: torch.Tensor) -> bool:
    """Whether this call is being traced (torch.compile, torch.export) or runs on fake / meta
    tensors: then no value may be read on the host and every shape must follow the input shapes."""
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return True
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


# A grouped matmul for what torch._grouped_mm's fake (meta) refuses: it takes bf16 only, while the
# CPU kernel runs float32 / fp16 too and float64 runs nowhere. The op's fake gives the static
# [S, out]; its kernel runs torch._grouped_mm where the device takes the dtype (the same kernel as
# eager), else one matmul per expert (the offsets read on the host, inside the op, out of the graph).


@torch.library.custom_op("moe_kernels::experts_grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in], rows sorted by expert (expert e's: offsets[e]:offsets[e+1]), weight [E, in, out],
    offsets [E+1] int64 -> [S, out] (rows past offsets[E]: 0)."""
    x = x.contiguous()
    if 0 in weight.stride() or 1 not in weight.stride()[1:]:  # e.g. an expanded gradient
        weight = weight.contiguous()
    if x.shape[0] and _grouped_mm_takes(x, weight):
        return torch._grouped_mm(x, weight, offs=offsets[1:].to(torch.int32))
    out = x.new_zeros(x.shape[0], weight.shape[2])
    bounds = offsets.tolist()
    for e in range(weight.shape[0]):
        if bounds[e + 1] > bounds[e]:
            torch.mm(x[bounds[e] : bounds[e + 1]], weight[e], out=out[bounds[e] : bounds[e + 1]])
    return out


@_grouped_mm_op.register_fake
def _(x, weight, offsets):
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("moe_kernels::experts_grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, in, out]: expert e's x rows transposed times its grad rows (0 for an expert without rows)."""
    x, grad = x.contiguous(), grad.contiguous()
    E = offsets.shape[0] - 1
    if x.shape[0] and _sizes_take(x, x.shape[1], grad.shape[1]):
        return torch._grouped_mm(x.t(), grad, offs=offsets[1:].to(torch.int32))
    out = x.new_zeros(E, x.shape[1], grad.shape[1])
    bounds = offsets.tolist()
    for e in range(E):
        if bounds[e + 1] > bounds[e]:
            torch.mm(x[bounds[e] : bounds[e + 1]].t(), grad[bounds[e] : bounds[e + 1]], out=out[e])
    return out


@_grouped_mm_weight_grad.register_fake
def _(x, grad, offsets):
    return x.new_empty(offsets.shape[0] - 1, x.shape[1], grad.shape[1])


def _grouped_mm_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    x, weight, offsets = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = _grouped_mm_op(grad, weight.transpose(1, 2), offsets)
    if ctx.needs_input_grad[1]:
        grad_weight = _grouped_mm_weight_grad(x, grad, offsets)
    return grad_x, grad_weight, None


def _weight_grad_backward(ctx, grad):
    # out[e] = x_e^T g_e: d x_e = g_e grad[e]^T, d g_e = x_e grad[e] (double backward).
    x, g, offsets = ctx.saved_tensors
    grad_x = grad_g = None
    if ctx.needs_input_grad[0]:
        grad_x = _grouped_mm_op(g, grad.transpose(1, 2), offsets)
    if ctx.needs_input_grad[1]:
        grad_g = _grouped_mm_op(x, grad, offsets)
    return grad_x, grad_g, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup_context)
_grouped_mm_weight_grad.register_autograd(_weight_grad_backward, setup_context=_grouped_mm_setup_context)


def _grouped_linear(x, weight, bias, transposed, offsets, ends, expert_of_row):
    """[S, in] rows sorted by expert -> [S, out]: each expert's rows through its weight (+ bias).
    torch._grouped_mm eagerly and wherever its fake takes the dtype (bf16); our op otherwise."""
    weight = weight if transposed else weight.transpose(1, 2)
    if (_traced(x) and x.dtype != torch.bfloat16) or not _grouped_mm_takes(x, weight):
        out = _grouped_mm_op(x, weight, offsets)
    else:
        out = torch._grouped_mm(x, weight, offs=ends)
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
        return _transformers_grouped_mm()(self, hidden_states, top_k_index, top_k_weights)
    E = self.num_experts
    if (
        not torch.compiler.is_compiling()  # first: traced, a size test would guard (recompile) on T k
        and hidden_states.device.type == "cpu"
        and not torch.is_grad_enabled()
        and hidden_states.dtype != torch.float64
        and _few(top_k_index.numel(), E, self.gate_up_proj if self.has_gate else self.up_proj)
        and _grouped_mm_takes(hidden_states, self.gate_up_proj if self.has_gate else self.up_proj, self.down_proj)
    ):  # decode: first, so that the few-token path pays for few other checks
        return _forward_few(self, hidden_states, top_k_index, top_k_weights, E)
    experts = top_k_index.to(torch.int64)
    weight_dtype = (self.gate_up_proj if self.has_gate else self.up_proj).dtype
    x = hidden_states.to(weight_dtype)
    first = self.gate_up_proj if self.has_gate else self.up_proj
    if _traced(x):
        y = _forward_grouped(self, x, experts, top_k_weights, E)
    elif not _grouped_mm_takes(x, first, self.down_proj):
        y = _forward_padded(self, x, experts, top_k_weights, E)
    else:
        y = _forward_grouped(self, x, experts, top_k_weights, E)
    return y.to(hidden_states.dtype)


# CPU inference takes _forward_few below FEW_CHOICES (token, expert) choices, or, where
# chosen_linear takes the weights, up to FEW_ROWS_PER_EXPERT choices per expert on average: there
# the chosen experts' path beats a matmul per expert. Measured on bench/bench_decode.py's experts
# at hidden 512 (2 threads): the chosen path against transformers' forward was 1.05-2.8x at T = 64
# for the four families in float32 (Mixtral 16 rows an expert, DeepSeek-V3 2), 1.4x for Qwen3-MoE
# at T = 128 (8 rows an expert) and 1.1x at 256 (16, as the grouped path), 0.91x for Mixtral at
# T = 128 (32; grouped 0.94x). The bench times T = 1, 8 and 64 in float32; the figures at T = 128-256
# and in bf16 here and below are one-off interleaved loops over its models' experts modules.
FEW_CHOICES = 256
FEW_ROWS_PER_EXPERT = 8
# Without chosen_linear's experts (below), with at most k (one token's) or E / CHOSEN_SHARE
# distinct experts, only those run (a torch.mm each; transformers' grouped_mm forward costs a
# matmul per expert of all E, most of its time at one token).
CHOSEN_SHARE = 8
# The chosen experts' path where at least 1 in KERNEL_SHARE choices fall in experts that
# chosen_linear takes (at most CHOSEN_LINEAR_ROWS rows); else our grouped path. Bench experts at
# T = 64 (2 threads): with that share at 0.45-0.67 (Mixtral and GPT-OSS in float32, Qwen3-MoE in
# bf16) the chosen path was 1.01-1.37x transformers' forward; at 0-0.04 (Mixtral and GPT-OSS in
# bf16, where every expert has more than 4 rows) 0.93-0.95x (the host layout for one grouped
# matmul: what transformers runs), the grouped path 0.96-1.02x.
KERNEL_SHARE = 4
# The longest span (rows of one expert) chosen_linear takes, by dtype; the longer ones take one
# torch._grouped_mm or a torch.mm each (LONG_SHARE). chosen_linear against a torch.mm per expert, by
# rows per expert (8 experts of [256, 512] weights, both layouts, 1 and 2 threads): float32 1.6-4.0x
# at 1-4 rows, 1.2-1.9x at 8, 0.9-1.4x at 16; bf16 1.3-3.4x at 1-4 rows, 0.8-1.3x at 8 (torch.mm's
# bf16 GEMM multiplies with the CPU's bf16 dot products, ours in float32); fp16 [E, out, in]
# 0.6-0.9x at one row, 0.9-1.1x at two, 1.2-1.4x from four (its exact widening without F16C), [E,
# in, out] 2.7-15x at 1-32 rows.
CHOSEN_LINEAR_ROWS = {torch.float32: 16, torch.bfloat16: 4, torch.float16: 32}
# One torch._grouped_mm over the long experts' rows where at least 1 in LONG_SHARE of all E
# experts are long. A grouped matmul against a torch.mm per expert ([256, 512] weights, 8-16
# rows each): 0.83-0.91x the time with 8 of 8 or 64 of 128 experts long, 1.04-1.77x with 16 or 4
# of 128 (an empty expert costs it about a microsecond), 1.03x with 2 of 8 in the Mixtral bench.
LONG_SHARE = 2


def _few(choices: int, E: int, first: torch.Tensor) -> bool:
    """Whether CPU inference on `choices` (token, expert) choices takes _forward_few."""
    return choices < FEW_CHOICES or (
        choices <= FEW_ROWS_PER_EXPERT * E and _takes_chosen_linear(first, first.dtype)  # rows take its dtype
    )


def _forward_few(self, hidden_states, experts, top_k_weights, E):
    """CPU inference at a few tokens (_few). The ids are read on the host (two to a few thousand):
    the range check transformers' forward lacks (its histc drops ids outside [0, E): tokens lost
    silently), then the chosen experts alone (_forward_chosen) where at least 1 in KERNEL_SHARE
    choices fall in experts chosen_linear takes, or at most k (one token) or E / CHOSEN_SHARE
    distinct experts are chosen; else our grouped path (transformers' own grouped_mm forward
    without our permute kernel, or with no ids)."""
    ids = experts.reshape(-1).tolist()
    if ids and (min(ids) < 0 or max(ids) >= E):
        raise ValueError(f"top_k_index must hold expert ids in [0, {E}), got [{min(ids)}, {max(ids)}]")
    first = self.gate_up_proj if self.has_gate else self.up_proj
    x = hidden_states.to(first.dtype)
    kernel = _takes_chosen_linear(first, x.dtype) and _takes_chosen_linear(self.down_proj, x.dtype)
    limit = CHOSEN_LINEAR_ROWS.get(x.dtype, 0) if kernel else 0
    rows_of = collections.Counter(ids)
    # The chosen experts alone: while few are chosen (a torch.mm each beats a matmul per expert of
    # all E), or while enough choices go through chosen_linear to pay for the host layout (the
    # other experts' rows then take one grouped matmul, or a torch.mm each).
    short = sum(n for n in rows_of.values() if n <= limit)
    chosen = KERNEL_SHARE * short >= len(ids) or len(rows_of) <= max(experts.shape[1], E // CHOSEN_SHARE)
    if ids and not chosen and backends.choose_for("permute", x) != "torch":
        # Our grouped path: its permute / unpermute kernels beat transformers' index ops by a few
        # percent (bench experts in bf16 at T = 32-128: 0.97-1.09x against 0.93-1.04x).
        return _forward_grouped(self, x, experts.to(torch.int64), top_k_weights, E).to(hidden_states.dtype)
    if not ids or not chosen:
        return _forward_transformers(self, hidden_states, experts, top_k_weights)
    return _forward_chosen(self, x, experts, top_k_weights, ids, rows_of, limit).to(hidden_states.dtype)


def _forward_transformers(self, x, experts, top_k_weights):
    """transformers' grouped_mm experts forward (the ids checked by the caller)."""
    return _transformers_grouped_mm()(self, x, experts, top_k_weights)


@functools.cache
def _transformers_grouped_mm():
    """transformers' grouped_mm experts forward (imported on first use: an import statement in the
    decode path costs a microsecond a call)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward


def _forward_chosen(self, x, experts, top_k_weights, ids: list[int], rows_of: collections.Counter, limit: int):
    """The grouped path with its layout made on the host from the ids read there (`ids`: the [T k]
    choices c = t k + s, in range; `rows_of`: their count by expert; experts of at most `limit`
    rows through chosen_linear), the chosen experts only, on views of their weights:
    torch._grouped_mm on CPU (transformers' grouped_mm forward, and ours) runs a matmul per expert
    of all E, empty or not, and at a few tokens that is most of its time. The activation, bias and
    weighting run once on all rows; each choice's float32 product with its float32 weight goes back
    to its own row, and the sum over k is in float32, rounded once, as on the other paths."""
    T, k = experts.shape
    E = self.num_experts
    # The long experts' rows first, then the short ones', each by expert, then by choice (stable).
    key = [e if rows_of[e] > limit else e + E for e in ids]
    order = sorted(range(len(ids)), key=key.__getitem__)
    short, long, start = [], [], 0  # (expert, first row, end row) of each chosen expert, sorted rows
    for end in range(1, len(order) + 1):
        if end == len(order) or ids[order[end]] != ids[order[start]]:
            e = ids[order[start]]
            (long if rows_of[e] > limit else short).append((e, start, end))
            start = end
    long_ends = None
    if LONG_SHARE * len(long) >= E:  # one grouped matmul over the long block
        ends = [0] * E
        for e, _, end in long:
            ends[e] = end
        long_ends = torch.tensor(list(itertools.accumulate(ends, max)), dtype=torch.int32)
    n_long = long[-1][2] if long else 0
    layout = _ChosenLayout(torch.tensor(short, dtype=torch.int64) if short else None, long, n_long, long_ends)
    order_t = torch.tensor(order)
    rows = x.index_select(0, order_t // k)
    expert_of_row = torch.tensor([ids[c] for c in order]) if self.has_bias else None
    linear = functools.partial(
        _chosen_linear, layout=layout, expert_of_row=expert_of_row, transposed=self.is_transposed
    )
    out = _projections(self, rows, linear)
    weights = _sum_weights(top_k_weights, out).reshape(-1)
    products = out.to(weights.dtype) * weights.index_select(0, order_t).unsqueeze(1)
    return torch.empty_like(products).index_copy_(0, order_t, products).view(T, k, -1).sum(1)


class _ChosenLayout(typing.NamedTuple):
    """The chosen experts' rows as _forward_chosen sorts them: `long` experts' rows first, then the
    `short` ones' ([S, 3] int64 spans for chosen_linear, or None), `n_long` rows in the first block;
    `long_ends` [E] int32, the end of each expert's rows in it where one grouped matmul takes it
    (None: a torch.mm per long expert)."""

    short: torch.Tensor | None
    long: list
    n_long: int
    long_ends: torch.Tensor | None


def _chosen_linear(rows, weight, bias, *, layout, expert_of_row, transposed):
    """rows [S, in] in the layout's order -> [S, out]: each expert's rows through its weight ([E,
    out, in], or [E, in, out] if transposed; a view, no copy) (+ bias [E, out]). The short experts
    (at most CHOSEN_LINEAR_ROWS rows) through chosen_linear (csrc/cpu/chosen_linear.cpp: each
    weight element read once per four rows, on torch's threads); the long ones through one
    torch._grouped_mm or a torch.mm each."""
    if layout.short is not None:  # the long rows zero, then written over
        out = torch.ops.moe_kernels.chosen_linear(rows, weight, layout.short, transposed)
    else:
        out = rows.new_empty(rows.shape[0], weight.shape[2] if transposed else weight.shape[1])
    if layout.long_ends is not None:
        long_rows = torch._grouped_mm(
            rows[: layout.n_long], weight if transposed else weight.transpose(1, 2), offs=layout.long_ends
        )
        if layout.short is None:
            out = long_rows
        else:
            out[: layout.n_long] = long_rows
    else:
        for e, a, b in layout.long:
            torch.mm(rows[a:b], weight[e] if transposed else weight[e].t(), out=out[a:b])
    if bias is not None:
        out += bias.index_select(0, expert_of_row)
    return out


if _extension.defines("chosen_linear"):

    @torch.library.register_fake("moe_kernels::chosen_linear")
    def _(rows, weight, spans, transposed=False):
        return rows.new_empty(rows.shape[0], weight.shape[2] if transposed else weight.shape[1])


def _takes_chosen_linear(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the chosen-experts linear runs as chosen_linear for rows of `dtype`: an [E, out, in]
    (or, transposed, [E, in, out]) weight contiguous along its last dimension, of the rows' dtype
    (float32 / bf16 / fp16), on CPU, with the extension's kernel."""
    return (
        dtype == weight.dtype
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
        and weight.stride(-1) == 1
        and weight.device.type == "cpu"
        and _extension.has_kernel("chosen_linear", "CPU")
    )


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
    kernels = backends.choose_for("permute", x) != "torch"  # else (meta, forced reference): torch ops
    x_sorted, offsets, order = (permute if kernels else _permute_static)(x, experts, E)  # [T*k, d], [E+1], [T*k]
    ends = offsets[1:].to(torch.int32)
    expert_of_row = None
    if self.has_bias:  # the expert of each sorted row, for the per-expert biases
        expert_of_row = torch.repeat_interleave(
            torch.arange(E, device=x.device), offsets.diff(), output_size=T * experts.shape[1]
        )
    out = _projections(
        self, x_sorted, lambda rows, w, b: _grouped_linear(rows, w, b, self.is_transposed, offsets, ends, expert_of_row)
    )
    # Traced, torch ops combine instead of the kernel, whose `int num_tokens` would specialise T.
    combine_rows = unpermute if kernels and not _traced(x) else _unpermute_static
    return combine_rows(out, order, _sum_weights(top_k_weights, out), T)


def _permute_static(x, experts, E):
    """permute's outputs for ids in [0, E), in torch ops of static shapes (the reference's boolean
    masks and bincount have data-dependent shapes, and bincount no meta kernel)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.searchsorted(flat[order], torch.arange(E + 1, device=x.device, dtype=flat.dtype))
    return x.index_select(0, order // k), offsets, order


def _unpermute_static(y_sorted, order, weights, T):
    """unpermute for a permutation `order` (no empty choices), in torch ops of static shapes: each
    choice's row gathered back to [T, k, d] and weighted over k (float32 accumulation, as unpermute)."""
    acc = torch.float64 if y_sorted.dtype == torch.float64 else torch.float32
    k = weights.shape[1]
    row_of_choice = torch.zeros_like(order).scatter(0, order, torch.arange(order.shape[0], device=order.device))
    rows = y_sorted.index_select(0, row_of_choice).to(acc).view(T, k, y_sorted.shape[1])
    return (rows * weights.to(acc).unsqueeze(-1)).sum(1).to(y_sorted.dtype)


def _forward_padded(self, x, experts, top_k_weights, E):
    T = x.shape[0]
    counts = torch.bincount(experts.reshape(-1), minlength=E) if T else experts.new_zeros(E)
    capacity = int(counts.max()) if T else 0  # one host read: the buffer's size
    positions, _ = capacity_positions(experts, E, capacity)
    buffer = dispatch(x, experts, positions, E, capacity)  # [E, C, d]
    out = _projections(self, buffer, lambda rows, w, b: _linear(rows, w, b, self.is_transposed))
    return combine(out, experts, positions, _sum_weights(top_k_weights, out))


def _sum_weights(top_k_weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The routing weights as the weighted sum takes them: float32 (float64 for float64 rows), not
    rounded to 16-bit rows' dtype first. transformers' grouped_mm multiplies 16-bit rows by float32
    router weights in float32; unpermute and combine accumulate in float32 either way."""
    return top_k_weights.to(torch.float64 if out.dtype == torch.float64 else torch.float32)


def register() -> None:
    """Register `experts_forward` as the experts implementation "moe_kernels" (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)


class Registration:
    """Held by a patched model: unpickling it (torch.load, pickle, copy.deepcopy) registers the
    experts implementation, so that a model saved whole runs in a process that never patched one."""

    def __reduce__(self):
        return _registered, ()


def _registered() -> Registration:
    register()
    return Registration()
