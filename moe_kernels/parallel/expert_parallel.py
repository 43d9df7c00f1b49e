"""One expert-parallel MoE step over a torch.distributed process group, built from our routing ops
(capacity_positions, dispatch, combine, permute, unpermute) and the exchange (exchange.py).

Terms: W ranks, E experts, E_l = E / W local experts (rank r owns experts r*E_l .. (r+1)*E_l - 1),
T_r tokens on rank r (may differ between ranks, may be 0), k choices per token, d hidden size,
h expert hidden size. expert_parallel_route runs any experts object (forward_buffer /
forward_expert); expert_parallel_moe the feed-forward experts activation(x @ w1[e]) @ w2[e].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_kernels.ops import capacity_for, capacity_positions, combine, dispatch, permute, unpermute
from moe_kernels.parallel.exchange import (
    agree_capacity,
    all_to_all,
    exchange_counts,
    local_experts,
    rank_and_world,
    return_capacity,
    send_capacity,
)
from moe_kernels.routing import Routing

__all__ = ["LocalFFN", "expert_ffn", "expert_parallel_moe", "expert_parallel_route"]


def expert_ffn(buffer: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation=F.gelu) -> torch.Tensor:
    """Every local expert on its capacity buffer: [E_l, N, d] -> [E_l, N, d] (batched matmuls).

    w1: [E_l, d, h]; w2: [E_l, h, d]. Empty slots are computed too (combine never reads them).
    """
    return torch.bmm(activation(torch.bmm(buffer, w1)), w2)


class LocalFFN:
    """The experts interface expert_parallel_route calls, over plain weight tensors:
    forward_buffer(buffer [E_l, N, d]) -> [E_l, N, d] and forward_expert(e, rows [n, d]) -> [n, d]
    (the same two methods as the single-process layer's expert modules)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor, activation=F.gelu):
        self.w1, self.w2, self.activation = w1, w2, activation
        self.num_experts = w1.shape[0] if w1.dim() == 3 else None

    def forward_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        return expert_ffn(buffer, self.w1, self.w2, self.activation)

    def forward_expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        return self.activation(rows @ self.w1[e]) @ self.w2[e]


def _check_weights(w1, w2, d, E_l):
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != E_l or w2.shape[0] != E_l:
        raise ValueError(
            f"w1 / w2 must be the local experts' weights [E/W = {E_l}, d, h] / [E/W, h, d], "
            f"got {tuple(w1.shape)} / {tuple(w2.shape)}"
        )
    if w1.shape[1] != d or w2.shape[2] != d or w1.shape[2] != w2.shape[1]:
        raise ValueError(f"w1 [E_l, d, h] / w2 [E_l, h, d] with d = {d}, got {tuple(w1.shape)} / {tuple(w2.shape)}")


def _check_inputs(x, routing, experts, E_l):
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [T, d] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    T = x.shape[0]
    if routing.experts.shape[0] != T or routing.weights.shape != routing.experts.shape:
        raise ValueError(
            f"routing must have experts and weights [T, k] with T = x.shape[0] = {T}, "
            f"got {tuple(routing.experts.shape)} and {tuple(routing.weights.shape)}"
        )
    if not (hasattr(experts, "forward_buffer") and hasattr(experts, "forward_expert")):
        raise TypeError(f"experts must have forward_buffer and forward_expert, got {type(experts).__name__}")
    if getattr(experts, "num_experts", E_l) != E_l:
        raise ValueError(f"experts must hold this rank's E/W = {E_l} experts, got {experts.num_experts}")


def _source_to_expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """Row permutation from the exchange's order (source rank, then local expert) to the experts'
    order (local expert, then source rank). recv_counts: [W, E_l] int64; returns [N] int64."""
    W, E_l = recv_counts.shape
    flat = recv_counts.reshape(-1)
    source_start = (flat.cumsum(0) - flat).view(W, E_l)
    dest_counts = recv_counts.t().reshape(-1)  # segments in (expert, source) order
    dest_source_start = source_start.t().reshape(-1)
    segment = torch.repeat_interleave(torch.arange(W * E_l), dest_counts)
    dest_start = torch.repeat_interleave(dest_counts.cumsum(0) - dest_counts, dest_counts)
    return dest_source_start[segment] + torch.arange(segment.numel()) - dest_start


def _capacity_step(x, routing, experts_fn, group, E, error, capacity, capacity_factor, min_capacity, priority):
    experts, weights = routing.experts, routing.weights
    T, k = experts.shape
    counts = torch.bincount(experts[experts >= 0], minlength=E) if error is None else torch.zeros(E, dtype=torch.int64)
    if capacity is None and capacity_factor is not None:
        need = capacity_for(T, E, max(k, 1), capacity_factor, min_capacity)
    else:  # drop-free capacity: the largest per-expert count this rank has (ignored if capacity is given)
        need = max(int(counts.max()) if E else 0, min_capacity)
    C = agree_capacity(need, group, capacity=capacity, error=error)
    positions, counts = capacity_positions(experts, E, C, priority=priority)
    buffer = dispatch(x, experts, positions, E, C)  # [E, C, d]
    local = send_capacity(buffer, group)  # [E_l, W*C, d]
    out = return_capacity(experts_fn.forward_buffer(local).to(x.dtype), group)  # [E, C, d]
    y = combine(out, experts, positions, weights.to(out.dtype))
    dropped = ((positions < 0) & (experts >= 0)).sum()
    return y, {"mode": "capacity", "capacity": C, "counts": counts, "dropped": dropped, "received_rows": local.shape[1]}


def _dropless_step(x, routing, experts_fn, group, E, E_l, error):
    experts, weights = routing.experts, routing.weights
    T, k = experts.shape
    _, W = rank_and_world(group)
    if error is None:
        x_sorted, offsets, order = permute(x, experts, E)  # [T*k, d], rows grouped by expert
        counts = offsets[1:] - offsets[:-1]
    else:
        counts = torch.zeros(E, dtype=torch.int64)
    recv_counts = exchange_counts(counts, group, error=error)  # [W, E_l]; raises if any rank failed
    send_splits = counts.view(W, E_l).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    kept = int(offsets[E])
    received = all_to_all(x_sorted[:kept], recv_splits, send_splits, group)  # source-rank-major
    to_experts = _source_to_expert_major(recv_counts)
    grouped = torch.split(received[to_experts], recv_counts.sum(0).tolist())
    out = [experts_fn.forward_expert(e, rows).to(x.dtype) for e, rows in enumerate(grouped)]
    out = torch.cat(out) if out else received.new_zeros(0, x.shape[1])
    out = out[torch.argsort(to_experts)]  # back to source-rank-major
    back = all_to_all(out, send_splits, recv_splits, group)  # [kept, d], permute's row order
    y_sorted = torch.cat([back, back.new_zeros(T * k - kept, back.shape[1])])  # + empty choices' rows
    y = unpermute(y_sorted, order, weights.to(y_sorted.dtype), T)
    return y, {"mode": "dropless", "counts": counts, "dropped": torch.zeros((), dtype=torch.int64),
               "received_rows": int(recv_counts.sum())}  # fmt: skip


def expert_parallel_route(
    x: torch.Tensor,
    routing: Routing,
    experts,
    group=None,
    *,
    dropless: bool = False,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    min_capacity: int = 0,
    priority: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """y = sum_s weights[t, s] * Expert_{experts[t, s]}(x[t]), with the experts spread over `group`.

    Every rank of `group` calls this with its own tokens (T_r may differ, may be 0) and the same
    options. Two modes:
      capacity (default): capacity_positions -> dispatch [E, C, d] -> all_to_all with equal splits
        -> local experts on [E_l, W*C, d] -> all_to_all back -> combine. C is `capacity` if given
        (must be equal on all ranks), else the max over ranks of capacity_for(T_r, E, k,
        capacity_factor, min_capacity), else (no factor) the max over ranks of the largest
        per-expert count: no drops. C counts slots per expert *per source rank*: a single process
        running the same routing rank by rank with capacity C computes the same y.
      dropless=True: permute -> exchange counts -> all_to_all with those split sizes -> local
        experts -> all_to_all back -> unpermute. No capacity, no drops.

    Args:
      x: [T_r, d] float tokens of this rank.
      routing: Routing of these tokens over all E experts; its token view (experts / weights
        [T_r, k], -1 = empty choice) is used whatever the layout.
      experts: this rank's E_l experts, any object with forward_buffer(buffer [E_l, N, d]) ->
        [E_l, N, d] (capacity mode) and forward_expert(e, rows [n, d]) -> [n, d] for local index
        e in [0, E_l) (dropless mode); e.g. LocalFFN(w1, w2) or the layer's expert module built
        with E_l experts. A capacity buffer's empty slots are zero rows; their outputs are never
        read back.
      group: torch.distributed process group (None = the default group, or one process if none).
      priority: optional [T_r, k] slot priority for capacity_positions (capacity mode).

    Returns (y [T_r, d] in x's dtype, stats): stats["dropped"] counts this rank's dropped choices
    (never silent), stats["counts"] [E] its choices per expert, stats["capacity"] the agreed C
    (capacity mode), stats["received_rows"] the rows its experts processed.

    Differentiable with respect to x, routing.weights and the experts' parameters (the backward
    of each exchange is the reverse all_to_all). Every rank must run the backward through the same
    steps (a rank with T_r = 0 included): the backward exchanges are collectives too.
    A rank whose inputs are invalid raises its own error and its peers raise RemoteRankError
    from the same collective; a rank that dies or stops mid-step makes its peers fail within the
    process group's timeout.
    """
    options = (dropless, capacity, capacity_factor, min_capacity, priority)
    return _route(x, routing, experts, group, None, *options)


def _route(x, routing, experts, group, error, dropless, capacity, capacity_factor, min_capacity, priority):
    """expert_parallel_route; `error`: a failure this rank already hit (reported to the peers)."""
    _, W = rank_and_world(group)
    # Option errors are the same on every rank: raising before any collective leaves no peer waiting.
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a moe_kernels.routing.Routing, got {type(routing).__name__}")
    E = routing.num_experts
    E_l = local_experts(E, W)
    if dropless and (capacity is not None or capacity_factor is not None):
        raise ValueError("dropless=True takes no capacity or capacity_factor")
    if capacity is not None and capacity_factor is not None:
        raise ValueError("give capacity or capacity_factor, not both")
    if error is None:
        try:  # input errors may differ between ranks: report them through the first collective
            _check_inputs(x, routing, experts, E_l)
        except (ValueError, TypeError) as e:
            error = e
    if dropless:
        return _dropless_step(x, routing, experts, group, E, E_l, error)
    return _capacity_step(x, routing, experts, group, E, error, capacity, capacity_factor, min_capacity, priority)


def expert_parallel_moe(
    x: torch.Tensor,
    routing: Routing,
    w1: torch.Tensor,
    w2: torch.Tensor,
    group=None,
    *,
    activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu,
    dropless: bool = False,
    capacity: int | None = None,
    capacity_factor: float | None = None,
    min_capacity: int = 0,
    priority: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """expert_parallel_route with feed-forward experts activation(x @ w1[e]) @ w2[e].

    w1: [E_l, d, h], w2: [E_l, h, d]: this rank's experts (shard_experts of the full [E, ...]).
    Other options as in expert_parallel_route. Returns (y [T_r, d], stats).
    """
    error = None
    if isinstance(routing, Routing) and routing.num_experts % rank_and_world(group)[1] == 0:
        try:  # weights' shapes may differ between ranks: reported like an input error
            d = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
            _check_weights(w1, w2, d, routing.num_experts // rank_and_world(group)[1])
        except ValueError as e:
            error = e
    options = (dropless, capacity, capacity_factor, min_capacity, priority)
    return _route(x, routing, LocalFFN(w1, w2, activation), group, error, *options)
