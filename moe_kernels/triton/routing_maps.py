"""The index maps between choices, slots and rows that the Triton row kernels (dispatch.py) read,
each built in one pass over the ids where torch ops took a launch per elementwise step (about
fifteen for dispatch's two maps, a dozen for unpermute's backward):
- choice_slots_kernel: each choice's kept slot e * C + p (-1 where dropped) and, for dispatch, the
  slot -> choice map;
- inverse_map_kernel: the inverse of a map into [0, size) (unpermute's row of each choice);
- offsets_kernel and expert_rows_kernel: permute's offsets (the running sum of its counts), each
  choice's row, offsets[e] + its rank, and the row -> choice order.
An inverse of a map given by the caller (dispatch's slots, unpermute's order) is written by an
integer atomic max into a map filled with -1: valid maps name each entry once, and where a
malformed one repeats an entry (unchecked on a GPU) the largest index naming it wins, whatever
order the programs run in, as the CPU's serial maps (their last writer, csrc/cpu/rows/routing_rows.h
`invert`). Permute's order is the inverse of rows built here from its own ranks, distinct by
construction: plain stores, and -1 written past the filled rows, with no fill before. An id
outside its range is dropped (docs/reliability.md).
"""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device

_BLOCK = 1024


@triton.jit
def choice_slots_kernel(
    experts_ptr,  # [N] int64 (N = T * K)
    positions_ptr,  # [N] int64
    slot_ptr,  # [N] int64 out: e * C + p of each kept choice, -1 otherwise
    source_ptr,  # [S] int64, filled with -1 (read only if SOURCES): the choice that fills each slot
    N,
    E,
    C,
    SOURCES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < N
    e = tl.load(experts_ptr + j, mask=ok, other=-1)
    p = tl.load(positions_ptr + j, mask=ok, other=-1)
    kept = ok & (e >= 0) & (e < E) & (p >= 0) & (p < C)
    slot = tl.where(kept, e * C + p, -1)
    tl.store(slot_ptr + j, slot, mask=ok)
    if SOURCES:
        tl.atomic_max(source_ptr + tl.where(kept, slot, 0), j, mask=kept, sem="relaxed")


@triton.jit
def inverse_map_kernel(
    index_ptr,  # [N] int64: an entry of [0, SIZE) for each i, anything else = none
    out_ptr,  # [SIZE] int64, filled with -1: out[index[i]] = i
    N,
    SIZE,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    v = tl.load(index_ptr + i, mask=ok, other=-1)
    valid = ok & (v >= 0) & (v < SIZE)
    tl.atomic_max(out_ptr + tl.where(valid, v, 0), i, mask=valid, sem="relaxed")


@triton.jit
def offsets_kernel(
    counts_ptr,  # [E] int64: each expert's choices
    offsets_ptr,  # [E + 1] int64 out: offsets[e] = the choices of the experts before e
    E,
    BLOCK: tl.constexpr,
):
    """One program: the running sum of the counts, BLOCK experts a step (where torch took a fill
    of offsets[0] and a cumsum: three launches, each a few microseconds on a GPU)."""
    before = tl.zeros([], tl.int64)
    tl.store(offsets_ptr, before)
    for first in range(0, E, BLOCK):
        e = first + tl.arange(0, BLOCK)
        counts = tl.load(counts_ptr + e, mask=e < E, other=0)
        tl.store(offsets_ptr + e + 1, before + tl.cumsum(counts, axis=0), mask=e < E)
        before += tl.sum(counts, axis=0)


@triton.jit
def expert_rows_kernel(
    experts_ptr,  # [N] int64
    rank_ptr,  # [N] int64: each choice's rank among its expert's choices in token order
    offsets_ptr,  # [E + 1] int64: the first row of each expert (offsets[E]: the rows filled)
    row_ptr,  # [N] int64 out: offsets[e] + rank of each choice with e in [0, E), -1 otherwise
    order_ptr,  # [N] int64 out: order[row] = the choice of each row, -1 past offsets[E]
    N,
    E,
    BLOCK: tl.constexpr,
):
    """The ranks (each below its expert's count) make the rows of the valid choices exactly
    [0, offsets[E]), one writer each; this program also writes -1 into the entries of its own
    range of the order that lie past them, so every entry is written once (no fill before)."""
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < N
    e = tl.load(experts_ptr + j, mask=ok, other=-1)
    valid = ok & (e >= 0) & (e < E)
    rank = tl.load(rank_ptr + j, mask=valid, other=0)
    row = tl.where(valid, tl.load(offsets_ptr + tl.where(valid, e, 0), mask=valid, other=0) + rank, -1)
    tl.store(row_ptr + j, row, mask=ok)
    filled = tl.load(offsets_ptr + E)
    tl.store(order_ptr + j, tl.full(j.shape, -1, tl.int64), mask=ok & (j >= filled))
    # The bound only guards malformed ranks.
    tl.store(order_ptr + tl.where(valid, row, 0), j, mask=valid & (row >= 0) & (row < filled))


def _filled(size: int, device) -> torch.Tensor:
    """[size] int64 of -1, with a spare entry (a launch never gets an empty tensor's pointer)."""
    return torch.full((size + 1,), -1, dtype=torch.int64, device=device)


@on_tensor_device
def _choice_slots(experts, positions, E, C, sources: bool):
    """(slot [T * k], source [E * C] or None) by choice_slots_kernel."""
    N = experts.numel()
    slot = torch.empty(N, dtype=torch.int64, device=experts.device)
    source = _filled(E * C, experts.device) if sources else slot
    if N:
        choice_slots_kernel[(triton.cdiv(N, _BLOCK),)](
            experts.contiguous(), positions.contiguous(), slot, source, N, E, C, SOURCES=sources, BLOCK=_BLOCK
        )
    return slot, (source[: E * C] if sources else None)


@torch.library.custom_op("moe_kernels_triton::kept_slots", mutates_args=())
def kept_slots(experts: torch.Tensor, positions: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T * k] int64: e * C + p for kept choices (e in [0, E), p in [0, C)), -1 otherwise. An op of
    its own: combine's backward calls it outside the kernels' ops, where a graph traces it."""
    return _choice_slots(experts, positions, num_experts, capacity, sources=False)[0]


@kept_slots.register_fake
def _(experts, positions, num_experts, capacity):
    return experts.new_empty(experts.numel())


def slot_maps(experts, positions, E, C):
    """(kept_slots [T * k], source [E * C]): source[r] the choice that fills slot r, -1 for an
    empty slot (the largest choice naming it, where malformed positions repeat one)."""
    return _choice_slots(experts, positions, E, C, sources=True)


@on_tensor_device
def inverse_map(index: torch.Tensor, size: int) -> torch.Tensor:
    """[size] int64: out[v] = the largest i with index[i] = v, -1 where none. index: int64, any
    shape (flattened); entries outside [0, size) name nothing."""
    index = index.contiguous().reshape(-1)
    out = _filled(size, index.device)
    if index.numel():
        inverse_map_kernel[(triton.cdiv(index.numel(), _BLOCK),)](index, out, index.numel(), size, BLOCK=_BLOCK)
    return out[:size]


@on_tensor_device
def expert_rows(
    experts: torch.Tensor, rank: torch.Tensor, counts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row [T * k], order [T * k], offsets [E + 1]) of permute: offsets the running sum of counts,
    row = offsets[e] + rank for e in [0, E) (-1 for other ids), order its inverse (-1 for rows no
    choice fills). experts, rank: [T, k] int64; counts: [E] int64, each expert's valid choices."""
    N, E = experts.numel(), counts.numel()
    offsets = torch.empty(E + 1, dtype=torch.int64, device=experts.device)
    # E = 0 (the raw op only: ops.permute asks for E >= 1): the loop reads nothing, so the offsets
    # stand in for the empty counts (a launch never gets an empty tensor's pointer).
    offsets_kernel[(1,)](counts.contiguous() if E else offsets, offsets, E, BLOCK=_BLOCK)
    row = torch.empty(N, dtype=torch.int64, device=experts.device)
    order = torch.empty(N, dtype=torch.int64, device=experts.device)
    if N:
        expert_rows_kernel[(triton.cdiv(N, _BLOCK),)](
            experts.contiguous(), rank.contiguous(), offsets, row, order, N, E, BLOCK=_BLOCK
        )
    return row, order, offsets


def _aot(kernel, **constexprs):
    signature = {"N": "i32"}
    if kernel is choice_slots_kernel:
        pointers = ("experts_ptr", "positions_ptr", "slot_ptr", "source_ptr")
        signature.update({"E": "i32", "C": "i32"})
    elif kernel is inverse_map_kernel:
        pointers = ("index_ptr", "out_ptr")
        signature["SIZE"] = "i32"
    elif kernel is offsets_kernel:
        pointers = ("counts_ptr", "offsets_ptr")
        signature = {"E": "i32"}
    else:
        pointers = ("experts_ptr", "rank_ptr", "offsets_ptr", "row_ptr", "order_ptr")
        signature["E"] = "i32"
    signature = {**dict.fromkeys(pointers, "*i64"), **signature}
    constexprs["BLOCK"] = _BLOCK
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return kernel, signature, constexprs, {"num_warps": 4}


AOT_KERNELS = [
    _aot(choice_slots_kernel, SOURCES=True),
    _aot(choice_slots_kernel, SOURCES=False),
    _aot(inverse_map_kernel),
    _aot(offsets_kernel),
    _aot(expert_rows_kernel),
]
