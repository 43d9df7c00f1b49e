"""The token exchange of expert parallelism: all_to_all_single as autograd Functions, and the
one small collective with which the ranks agree on a capacity (and learn of each other's errors).

Terms: W ranks in the process group, E experts, E_l = E / W local experts (rank r owns experts
r*E_l .. (r+1)*E_l - 1), C capacity (slots per expert per source rank), d hidden size.

Every collective here is issued by every rank of the group in the same order, whatever its token
count (zero included), so no rank can wait for a peer that skipped one. A peer that dies or stops
calling collectives makes the others fail with the group's timeout (the `timeout=` given to
`torch.distributed.init_process_group`), never hang forever.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

__all__ = [
    "ExchangeClock",
    "RemoteRankError",
    "agree_capacity",
    "all_to_all",
    "collective_device",
    "exchange_counts",
    "local_experts",
    "rank_and_world",
    "return_capacity",
    "send_capacity",
]


class RemoteRankError(RuntimeError):
    """Raised on every rank when some rank reported an error before an exchange."""


class ExchangeClock:
    """Wall-clock seconds spent inside the all-to-all calls (forward and backward) of this process.

    Includes the time a rank waits for its slowest peer, which is what a user wants to see when
    deciding whether the exchange or the imbalance dominates. `ExchangeClock.reset()` zeroes it.
    """

    seconds = 0.0
    calls = 0

    @classmethod
    def reset(cls) -> None:
        cls.seconds = 0.0
        cls.calls = 0


def rank_and_world(group) -> tuple[int, int]:
    """(rank within `group`, its size); (0, 1) when group is None and no process group exists."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def local_experts(num_experts: int, world_size: int) -> int:
    """E / W, the experts each rank holds; ValueError unless W divides E."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if num_experts % world_size:
        raise ValueError(
            f"expert parallelism needs num_experts divisible by the group's world size: "
            f"E = {num_experts} experts cannot be split evenly over W = {world_size} ranks"
        )
    return num_experts // world_size


def collective_device(group) -> torch.device:
    """Where this group's small int64 status tensors live: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raw_all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single along dim 0 of a contiguous tensor, timed by ExchangeClock."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    start = time.perf_counter()
    dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
    ExchangeClock.seconds += time.perf_counter() - start
    ExchangeClock.calls += 1
    return out


class _AllToAll(torch.autograd.Function):
    """Rows x[sum(input_splits[:j]) : ...] go to rank j; rows from rank i land in block i of the
    output. Backward is the reverse exchange (the splits swap roles)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _raw_all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _raw_all_to_all(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable all_to_all_single along dim 0.

    Args:
      x: [sum(input_splits), ...] any dtype gloo / NCCL carry; block j (input_splits[j] rows) goes
        to rank j.
      output_splits / input_splits: W Python ints each (every rank passes its own; rank i's
        input_splits[j] must equal rank j's output_splits[i]).
    Returns [sum(output_splits), ...]: block i holds the rows rank i sent here.
    """
    if rank_and_world(group)[1] == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def send_capacity(buffer: torch.Tensor, group) -> torch.Tensor:
    """Capacity-mode exchange, [E, C, d] -> [E_l, W*C, d].

    Rank r's buffer[e, c] (its tokens for expert e = j*E_l + i) arrives on rank j as
    out[i, r*C + c]: each local expert sees the C slots of every source rank, source-rank-major.
    Equal splits (E_l*C rows per rank), so the ranks must agree on C (agree_capacity).
    """
    E, C, d = buffer.shape
    _, W = rank_and_world(group)
    E_l = local_experts(E, W)
    split = [E_l * C] * W
    out = all_to_all(buffer.reshape(E * C, d), split, split, group)  # [W(source), E_l, C, d]
    return out.view(W, E_l, C, d).transpose(0, 1).reshape(E_l, W * C, d)


def return_capacity(buffer: torch.Tensor, group) -> torch.Tensor:
    """The inverse of send_capacity, [E_l, W*C, d] -> [E, C, d]: expert outputs go back home."""
    E_l, WC, d = buffer.shape
    _, W = rank_and_world(group)
    if WC % W:
        raise ValueError(f"buffer must be [E_l, W*C, d] with W = {W}, got {tuple(buffer.shape)}")
    C = WC // W
    per_rank = buffer.view(E_l, W, C, d).transpose(0, 1).reshape(W * E_l * C, d)  # [W(destination), E_l, C, d]
    split = [E_l * C] * W
    return all_to_all(per_rank, split, split, group).view(W * E_l, C, d)


def _status_tensor(values: list[int], error: BaseException | None, rank: int, world: int) -> torch.Tensor:
    # Integers only: gloo and NCCL both reduce int64. The error flags ride with the payload, so
    # reporting a local error costs no extra collective: one slot per rank, this rank's set when it
    # failed, so that a MAX leaves every failed rank's slot at 1 (one shared flag said only that
    # some rank failed, and the message then named its index, rank 0, on every rank).
    flags = [0] * world
    if error is not None:
        flags[rank] = 1
    return torch.tensor([*values, *flags], dtype=torch.int64)


def _raise_if_failed(flags: torch.Tensor, error: BaseException | None, where: str) -> None:
    if error is not None:
        raise error
    failed = torch.nonzero(flags).flatten().tolist()
    if failed:
        raise RemoteRankError(f"{where}: rank(s) {failed} of the process group failed (see their errors); stopping")


def agree_capacity(local_need: int, group, *, capacity: int | None = None, error: BaseException | None = None) -> int:
    """The capacity C every rank uses this step, from one all_reduce(MAX) of 3 + W int64.

    Args:
      local_need: this rank's wanted C (e.g. capacity_for(T_local, E, k, factor), or the largest
        per-expert count for a drop-free capacity); 0 for a rank with no tokens.
      capacity: a C fixed by the caller: then it must be the same on every rank (checked in the
        same all_reduce; a mismatch is a ValueError on every rank) and local_need is ignored.
      error: an exception this rank hit while preparing the step. The rank still joins the
        all_reduce, so its peers raise RemoteRankError (naming every rank that failed) at once
        instead of waiting for the timeout; the rank itself re-raises `error`.
    Returns the agreed C (max over ranks of local_need, or the given capacity).
    """
    given = -1 if capacity is None else int(capacity)
    need = int(local_need) if capacity is None else given
    rank, W = rank_and_world(group)
    # [need, given, -given, failed by rank 0 .. W-1]: MAX of -given is -min(given), so one MAX
    # says if all agree; MAX of the flags which ranks failed.
    status = _status_tensor([need, given, -given], error, rank, W)
    if W > 1:
        status = status.to(collective_device(group))
        start = time.perf_counter()
        dist.all_reduce(status, op=dist.ReduceOp.MAX, group=group)
        ExchangeClock.seconds += time.perf_counter() - start
    agreed, hi, neg_lo, *failed = status.tolist()
    _raise_if_failed(torch.tensor(failed), error, "agree_capacity")
    if hi != -neg_lo:
        raise ValueError(
            f"capacity must be the same on every rank (or None on all of them to agree one); "
            f"got values between {-neg_lo} and {hi} across ranks"
        )
    return agreed


def exchange_counts(counts: torch.Tensor, group, *, error: BaseException | None = None) -> torch.Tensor:
    """Dropless-mode count exchange: counts [E] of this rank's rows per expert -> recv [W, E_l],
    recv[i, e] = rows rank i sends to this rank's local expert e.

    One all_to_all of int64 [W, E_l + 1]; the extra column carries each rank's error flag, so a
    rank that failed while preparing (pass it as `error`) stops every peer with RemoteRankError
    before any payload moves.
    """
    _, W = rank_and_world(group)
    E_l = local_experts(counts.shape[0], W)
    flag = 0 if error is None else 1
    send = torch.cat([counts.to(torch.int64).cpu().view(W, E_l), torch.full((W, 1), flag, dtype=torch.int64)], 1)
    if W > 1:
        send = _raw_all_to_all(send.to(collective_device(group)), [1] * W, [1] * W, group).cpu()
    recv = send
    _raise_if_failed(recv[:, E_l], error, "exchange_counts")
    return recv[:, :E_l]
