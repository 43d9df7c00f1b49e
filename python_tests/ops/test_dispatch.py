"""Capacity routing (capacity_positions, dispatch, combine) and dropless permute / unpermute: every
backend against the reference and against a dense one-hot formulation, forward and backward, on
adversarial routings; invariants; opcheck; torch.compile; bad arguments."""

import pytest
import torch
from shapes import DISPATCH_SHAPES, DTYPES, ROUTING_KINDS, SMALL_DISPATCH_SHAPES, routing_choices
from tolerances import assert_close

import moe_kernels
from moe_kernels import backends, reference
from moe_kernels.ops import capacity_for, capacity_positions, combine, dispatch, permute, topk_router, unpermute

CAPACITY_OPS = ("capacity_positions", "dispatch", "combine")
DROPLESS_OPS = ("permute", "unpermute")


def use(backend, ops=CAPACITY_OPS):
    """The backend's context; skips a kernel backend that has no kernel for some of `ops`."""
    missing = [op for op in ops if backend != "torch" and getattr(backends._REGISTRY[op], backend) is None]
    if missing:
        pytest.skip(f"no {backend} kernels for {missing}")
    return moe_kernels.use_backend(backend)


def shapes_for(backend):
    return SMALL_DISPATCH_SHAPES if backend == "triton" else DISPATCH_SHAPES


def capacities(T, E, k):
    """0, 1, the capacity factor 1 size, and one that can never overflow (>= T)."""
    return sorted({0, 1, capacity_for(T, E, k, 1.0), T + 1})


def priorities(kind, T, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "random":
        return torch.rand(T, k, generator=g)
    if kind == "ties":  # three values: ties fall back to the default order
        return torch.randint(0, 3, (T, k), generator=g).float()
    if kind == "special":  # NaN (last), +-inf, -0.0 == +0.0, in float16
        p = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1.0])
        return p[torch.randint(0, 6, (T, k), generator=g)].half()
    if kind == "vmoe":  # batch prioritised routing: max gate, then first choices before second
        gates = torch.rand(T, k, generator=g).sort(dim=1, descending=True).values
        return gates[:, :1] - 2 * torch.arange(k).float()
    raise ValueError(kind)


# ---------------------------------------------------------------------------- capacity_positions


@pytest.mark.parametrize("priority", [None, "random", "ties", "special", "vmoe"])
@pytest.mark.parametrize("kind", ROUTING_KINDS)
def test_positions_match_reference_and_invariants(backend, kind, priority):
    for T, E, k, _ in shapes_for(backend):
        experts = routing_choices(kind, T, E, k, seed=T + E)
        p = priorities(priority, T, k, seed=T)
        for C in capacities(T, E, k):
            with use(backend):
                positions, counts = capacity_positions(experts, E, C, priority=p)
            ref_positions, ref_counts = reference.capacity_positions(experts, E, C, priority=p)
            assert torch.equal(positions, ref_positions), (T, E, k, C, kind, priority)
            assert torch.equal(counts, ref_counts)
            # Invariants, independent of the reference.
            kept = positions >= 0
            empty = experts < 0
            dropped = ~kept & ~empty
            assert not (kept & empty).any()
            assert int(kept.sum() + dropped.sum() + empty.sum()) == T * k
            assert ((positions >= -1) & (positions < max(C, 1))).all() and (positions < C)[kept].all()
            slots = experts[kept] * max(C, 1) + positions[kept]
            assert slots.unique().numel() == slots.numel(), "two choices share a slot"
            assert torch.equal(counts, torch.bincount(experts[~empty], minlength=E))
            per_expert_kept = torch.bincount(experts[kept], minlength=E)
            assert torch.equal(per_expert_kept, counts.clamp(max=C))
            # Slots are filled from 0 without gaps.
            for e in range(E):
                got = positions[kept & (experts == e)].sort().values
                assert torch.equal(got, torch.arange(got.numel()))


def test_positions_default_order_by_hand(backend):
    experts = torch.tensor([[0, 1], [0, 2], [0, -1], [1, 0]])
    with use(backend):
        positions, counts = capacity_positions(experts, 3, 2)
    assert positions.tolist() == [[0, 1], [1, 0], [-1, -1], [0, -1]]
    assert counts.tolist() == [4, 2, 1]


def test_positions_priority_ties_by_hand(backend):
    # All priorities equal except token 2's first choice: it goes first, then the default order.
    experts = torch.tensor([[0, 1], [0, 1], [0, 1]])
    priority = torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 1.0]])
    with use(backend):
        positions, _ = capacity_positions(experts, 2, 2, priority=priority)
    assert positions.tolist() == [[1, 0], [-1, 1], [0, -1]]


def test_positions_float64_priority_compares_as_float32(backend):
    # 1 + 1e-12 rounds to 1.0 in float32: the two first choices tie and keep the default order
    # (token 0 first) on every backend and in the reference, though float64 tells them apart.
    experts = torch.tensor([[0], [0]])
    priority = torch.tensor([[1.0], [1.0 + 1e-12]], dtype=torch.float64)
    with use(backend):
        positions, _ = capacity_positions(experts, 1, 1, priority=priority)
    assert positions.tolist() == [[0], [-1]]
    assert torch.equal(positions, reference.capacity_positions(experts, 1, 1, priority=priority)[0])


def test_positions_large_parallel_path(backend):
    # More choices than one chunk of the C++ kernel (65536) / several scan blocks of the Triton one.
    T, E, k = (40000, 64, 2) if backend != "triton" else (2500, 4, 2)
    experts = routing_choices("empties", T, E, k, seed=3)
    for p in (None, priorities("ties", T, k)):
        with use(backend):
            positions, counts = capacity_positions(experts, E, capacity_for(T, E, k, 1.0), priority=p)
        assert (positions < 0).any() and (positions >= 0).any()
        ref = reference.capacity_positions(experts, E, capacity_for(T, E, k, 1.0), priority=p)
        assert torch.equal(positions, ref[0]) and torch.equal(counts, ref[1])


@pytest.mark.parametrize(
    "E, k, max_bins",
    [(5, 3, None), (40, 10, None), (5, 3, 4), (70, 3, None)],
    ids=["packed", "packed-words", "scan", "sorted"],
)
def test_triton_positions_blocks_and_wide_fallback(backend, monkeypatch, E, k, max_bins):
    """The Triton kernels' paths: the O(T k) ones (the packed scan of 128-choice segments at E = 5,
    and at E = 40 in five words with the slots of a token block in two tiles (k = 10 > 8); a sort
    of 1024-choice blocks at E = 70; the counts of the segments or blocks before) over many
    segments, with ragged last ones, and the per-expert scan past MAX_BINS experts (made small
    here); ids past E dropped on each."""
    if backend != "triton":
        pytest.skip("the Triton kernels' own paths")
    from moe_kernels.triton import capacity_positions as kernels

    if max_bins is not None:
        monkeypatch.setattr(kernels, "MAX_BINS", max_bins)
    T = 700  # 6 token blocks of 128 (S_MAJOR), the last ragged; 2100 or 7000 choices
    experts = routing_choices("empties", T, E, k, seed=7).to(backend.device)
    for p in (None, priorities("ties", T, k).to(backend.device)):
        for C in (0, 1, capacity_for(T, E, k, 1.0), T * k):
            positions, counts = kernels.capacity_positions(experts, E, C, p)
            ref = reference.capacity_positions(experts, E, C, priority=p)
            assert torch.equal(positions, ref[0]) and torch.equal(counts, ref[1]), (p is None, C)
    wild = experts.clone()
    wild[::7, 0] = E + 3  # out of range: no slot, not counted
    positions, counts = kernels.capacity_positions(wild, E, T * k, None)
    kept = torch.where(wild == E + 3, -1, wild)
    ref = reference.capacity_positions(kept, E, T * k)
    assert torch.equal(positions, ref[0]) and torch.equal(counts, ref[1])


@pytest.mark.parametrize(
    "T, E, k",
    [(110_000, 16, 10), (900, 8192, 3), (1000, 9000, 2), (2049, 1, 1)],
    ids=["scan-row-blocks", "one-warp-a-block", "per-expert-fallback", "one-expert"],
)
def test_cuda_positions_segments_and_wide_fallback(backend, T, E, k):
    """The CUDA kernels' paths (csrc/cuda/capacity_positions.cu): segments of 2048 choices over
    more than one block of the scan's 256 rows (540 segments), ragged last segments, k = 10 slots
    a token block (more than a block's 8 warps), E = 8192 (a warp a block: its counters fill the
    block's shared memory), and past it the per-expert scan; ids outside [0, E) dropped on each.
    Their layout is checked on the host too (test_capacity_positions_cuda_emulation.py)."""
    if backend != "cuda":
        pytest.skip("the CUDA kernels' own paths")
    g = torch.Generator().manual_seed(T + E)
    experts = torch.randint(-1, E, (T, k), generator=g)
    wild = experts.clone()
    wild[::7, 0] = E + 3  # out of range: no slot, not counted
    kept = torch.where(wild == E + 3, -1, wild)
    for p in (None, priorities("ties", T, k)):
        # The reference once a fill order (its one-hot is [T k, E]); a capacity keeps the ranks below it.
        ranks, ref_counts = reference.capacity_positions(kept, E, T * k, priority=p)
        for C in (0, 1, capacity_for(T, E, k, 1.0), T * k):
            with use(backend):
                positions, counts = capacity_positions(
                    wild.to(backend.device), E, C, priority=None if p is None else p.to(backend.device)
                )
            expected = torch.where(ranks < C, ranks, -1)
            assert torch.equal(positions.cpu(), expected) and torch.equal(counts.cpu(), ref_counts), (p is None, C)


@pytest.mark.parametrize("path", [0, 1, 2, 3], ids=["strided-match", "strided-votes", "tiles-votes", "tiles-match"])
def test_cuda_positions_every_path(backend, path, monkeypatch):
    """Each way of the CUDA kernels (capacity_segments::Path), forced by MOE_KERNELS_CAPACITY_PATH
    as bench/gpu_capacity_variants.py forces it: the strided and tile paths, a chunk's peers from
    __match_any_sync or from ballots. Several token blocks and tiles, ragged last ones, k past a
    tile block's 8 warps (12, 16) and k E at the tile path's limit (16 x 512); a priority's order
    takes no tile path, which raises where forced. Their layout: test_capacity_positions_cuda_emulation.py."""
    if backend != "cuda":
        pytest.skip("the CUDA kernels' own paths")
    monkeypatch.setenv("MOE_KERNELS_CAPACITY_PATH", str(path))
    for T, E, k in [(20_000, 64, 8), (5000, 256, 4), (3000, 40, 12), (2100, 512, 16), (4096, 8, 2), (2049, 255, 3)]:
        g = torch.Generator().manual_seed(T + E + path)
        wild = torch.randint(-1, E, (T, k), generator=g)
        wild[::7, 0] = E + 3  # out of range: no slot, not counted
        wild[1::9, k - 1] = E  # the ballots' label E + 1
        kept = torch.where((wild == E + 3) | (wild == E), -1, wild)
        ranks, ref_counts = reference.capacity_positions(kept, E, T * k)
        for C in (0, capacity_for(T, E, k, 1.0), T * k):
            with use(backend):
                positions, counts = capacity_positions(wild.to(backend.device), E, C)
            expected = torch.where(ranks < C, ranks, -1)
            assert torch.equal(positions.cpu(), expected) and torch.equal(counts.cpu(), ref_counts), (T, E, k, C)
    p = priorities("ties", 300, 4)
    experts = torch.randint(0, 8, (300, 4), generator=torch.Generator().manual_seed(3))
    with use(backend):
        if path in (2, 3):
            with pytest.raises(RuntimeError, match="does not take these experts"):
                capacity_positions(experts.to(backend.device), 8, 300, priority=p.to(backend.device))
        else:
            positions, counts = capacity_positions(experts.to(backend.device), 8, 300, priority=p.to(backend.device))
            ref = reference.capacity_positions(experts, 8, 300, priority=p)
            assert torch.equal(positions.cpu(), ref[0]) and torch.equal(counts.cpu(), ref[1])


@pytest.mark.parametrize("E", [8, 13, 16])
def test_triton_packed_scan_full_fields(backend, E):
    """Every choice of whole 128-choice segments to one expert: its 8-bit field of the packed
    words reaches 128, in the top field of a word (expert 7 of 8, 15 of 16: the int64 word's sign
    wraps) and in another (12 of 13), in each fill order (the default, a given one, permute's flat
    one)."""
    if backend != "triton":
        pytest.skip("the Triton kernels' own paths")
    from moe_kernels.triton import capacity_positions as kernels

    T, k = 300, 2
    experts = torch.full((T, k), E - 1, dtype=torch.int64)
    experts[T // 2 :, 1] = 0
    experts = experts.to(backend.device)
    for p in (None, priorities("ties", T, k).to(backend.device)):
        positions, counts = kernels.capacity_positions(experts, E, T * k, p)
        ref = reference.capacity_positions(experts.cpu(), E, T * k, priority=None if p is None else p.cpu())
        assert torch.equal(positions.cpu(), ref[0]) and torch.equal(counts.cpu(), ref[1])
    ranks, counts = kernels.ranks(experts, E, T * k, kernels.FLAT)
    flat = experts.cpu().reshape(-1)
    expected = torch.empty_like(flat)
    for e in (0, E - 1):
        expected[flat == e] = torch.arange(int((flat == e).sum()))
    assert torch.equal(ranks.cpu().reshape(-1), expected)
    assert torch.equal(counts.cpu(), torch.bincount(flat, minlength=E))


def test_capacity_for():
    assert capacity_for(16384, 64, 2, 1.0) == 512
    assert capacity_for(10, 4, 1, 1.25) == 4  # ceil(3.125)
    assert capacity_for(0, 4, 2, 1.0, min_capacity=3) == 3
    assert capacity_for(5, 8, 1, 1.0) == 1


# ---------------------------------------------------------------------------- dispatch / combine


def dense_route(x, w, experts, positions, E, C):
    """The dense one-hot formulation (GShard): mask [T, k, E, C]; buffer = einsum, y = einsum."""
    kept = positions >= 0
    mask = torch.zeros(*experts.shape, E, C, dtype=x.dtype)
    t, s = kept.nonzero(as_tuple=True)
    mask[t, s, experts[kept], positions[kept]] = 1
    buffer = torch.einsum("tsec,td->ecd", mask, x)
    return buffer, lambda b: torch.einsum("tsec,ts,ecd->td", mask, w, b)


@pytest.mark.parametrize("kind", ROUTING_KINDS)
def test_dispatch_combine_against_dense_one_hot(backend, kind):
    for T, E, k, d in shapes_for(backend):
        experts = routing_choices(kind, T, E, k, seed=T)
        for C in capacities(T, E, k):
            positions, _ = reference.capacity_positions(experts, E, C)
            x = torch.randn(T, d, dtype=torch.float64, requires_grad=True)
            w = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
            with use(backend):
                buffer = dispatch(x, experts, positions, E, C)
                expert_out = buffer * torch.linspace(0.5, 1.5, d, dtype=torch.float64)  # a per-feature expert
                y = combine(expert_out, experts, positions, w)
            dense_buffer, dense_combine = dense_route(x, w, experts, positions, E, C)
            y_dense = dense_combine(dense_buffer * torch.linspace(0.5, 1.5, d, dtype=torch.float64))
            assert_close(buffer, dense_buffer)
            assert_close(y, y_dense)
            g = torch.randn(T, d, dtype=torch.float64)
            if y.requires_grad:
                grads = torch.autograd.grad(y, (x, w), g, allow_unused=True)
                dense = torch.autograd.grad(y_dense, (x, w), g, allow_unused=True)
                for a, b in zip(grads, dense, strict=True):
                    assert_close(
                        a if a is not None else torch.zeros_like(b), b if b is not None else torch.zeros_like(a)
                    )


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_dispatch_combine_match_reference(backend, dtype):
    for T, E, k, d in shapes_for(backend):
        experts = routing_choices("empties", T, E, k, seed=T + 1)
        for C in capacities(T, E, k):
            positions, _ = reference.capacity_positions(experts, E, C)
            x = torch.randn(T, d).to(dtype).requires_grad_()
            w = torch.rand(T, k).requires_grad_()  # float32 gates with low-precision activations
            with use(backend):
                buffer = dispatch(x, experts, positions, E, C)
                y = combine(buffer * 2, experts, positions, w)
            ref_buffer = reference.dispatch(x, experts, positions, E, C)
            ref_y = reference.combine(ref_buffer * 2, experts, positions, w)
            assert buffer.dtype == dtype and y.dtype == dtype and buffer.shape == (E, C, d)
            assert torch.equal(buffer, ref_buffer), "dispatch is a copy: it must be exact"
            assert_close(y, ref_y)
            if T and d:
                g = torch.randn(T, d).to(dtype)
                grads = torch.autograd.grad(y, (x, w), g)
                ref_grads = torch.autograd.grad(ref_y, (x, w), g)
                for a, b in zip(grads, ref_grads, strict=True):
                    assert a.dtype == b.dtype
                    assert_close(a, b, dtype=dtype)


def test_dispatch_wide_rows_with_empty_slots(backend):
    """Rows wider than the kernels' column steps (d = 600: the empty slots' zeros in a 512-column
    step and a ragged one, scatter_rows' 128-column tiles), with empty slots in some blocks of rows
    and none in others (a poisoned buffer would show a slot left unwritten: dispatch must equal
    the reference bit for bit)."""
    T, E, k, d = 40, 4, 2, 600
    experts = routing_choices("empties", T, E, k, seed=7)
    for C in (4, 2 * T * k // E):  # every slot filled in most experts; about half of them empty
        positions, _ = reference.capacity_positions(experts, E, C)
        x = torch.randn(T, d).bfloat16()
        with use(backend):
            buffer = dispatch(x, experts, positions, E, C)
        assert torch.equal(buffer, reference.dispatch(x, experts, positions, E, C)), C


def test_gradcheck_kernels(kernel_backend):
    experts = routing_choices("empties", 6, 4, 2, seed=1)
    positions, _ = reference.capacity_positions(experts, 4, 2)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    with use(kernel_backend):
        assert torch.autograd.gradcheck(
            lambda x, w: combine(dispatch(x, experts, positions, 4, 2) ** 2, experts, positions, w), (x, w)
        )
    with use(kernel_backend, DROPLESS_OPS):
        assert torch.autograd.gradcheck(
            lambda x, w: unpermute(permute(x, experts, 4)[0] ** 2, permute(x, experts, 4)[2], w, 6), (x, w)
        )


def test_triton_backward_computes_only_the_gradients_asked_for(backend, monkeypatch):
    """combine's and unpermute's backwards launch the weights' row dots only where the weights need a
    gradient, and the rows' scatter only where the rows do; each gradient asked for is the
    reference's."""
    if backend != "triton":
        pytest.skip("the Triton backwards' launches")
    from moe_kernels.triton import dispatch as rows_module

    T, E, k, d = 9, 4, 2, 6
    experts = routing_choices("empties", T, E, k, seed=3)
    C = capacity_for(T, E, k, 1.0)
    positions, _ = reference.capacity_positions(experts, E, C)
    _, _, order = reference.permute(torch.zeros(T, 1), experts, E)
    experts, positions, order = (t.to(backend.device) for t in (experts, positions, order))
    launched = []
    for name in ("row_dots", "scatter_rows"):
        real = getattr(rows_module, name)
        monkeypatch.setattr(rows_module, name, lambda *a, real=real, name=name: launched.append(name) or real(*a))
    g = torch.Generator().manual_seed(0)
    buffer, w = torch.randn(E, C, d, generator=g).to(backend.device), torch.rand(T, k, generator=g).to(backend.device)
    ys = torch.randn(T * k, d, generator=g).to(backend.device)
    grad_y = torch.randn(T, d, generator=g).to(backend.device)
    cases = [
        (combine, buffer, (experts, positions), lambda rows, w: reference.combine(rows, experts, positions, w)),
        (unpermute, ys, (order,), lambda rows, w: reference.unpermute(rows, order, w, T)),
    ]
    for op, rows, index, ref in cases:
        for wanted in ("rows", "weights"):
            r, ww = rows.clone().requires_grad_(wanted == "rows"), w.clone().requires_grad_(wanted == "weights")
            launched.clear()
            with use(backend, CAPACITY_OPS + DROPLESS_OPS):
                args = (r, *index, ww) if op is combine else (r, *index, ww, T)
                (got,) = torch.autograd.grad(op(*args), r if wanted == "rows" else ww, grad_y)
            assert launched == (["scatter_rows"] if wanted == "rows" else ["row_dots"]), (op.__name__, wanted)
            r2, w2 = rows.clone().requires_grad_(), w.clone().requires_grad_()
            expected = torch.autograd.grad(ref(r2, w2), r2 if wanted == "rows" else w2, grad_y)[0]
            assert_close(got, expected)


def test_repeated_slot_goes_to_the_largest_choice(backend):
    """A malformed map naming one slot from thousands of choices, which the device kernels do not
    check: the largest choice fills the slot whatever order the device's writers run in, as the
    CPU's serial maps give it (whose ops refuse such maps up front)."""
    if backend in ("cpu", "torch"):
        pytest.skip("the host backends refuse repeated positions before any kernel runs")
    T, E, C, d = 4096, 2, 3, 8
    dev = backend.device
    experts = torch.zeros(T, 1, dtype=torch.int64, device=dev)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(0)).to(dev)
    with use(backend):
        buffer = dispatch(x, experts, torch.zeros_like(experts), E, C)
    assert torch.equal(buffer[0, 0], x[-1]) and not buffer[0, 1:].any() and not buffer[1].any()


def test_repeated_row_goes_to_the_largest_choice(backend):
    """The same for unpermute's rows: a test of its own, so that a backend without permute kernels
    (CUDA) skips only this half."""
    if backend in ("cpu", "torch"):
        pytest.skip("the host backends refuse repeated positions before any kernel runs")
    T, d, k = 4096, 8, 2
    dev = backend.device
    order = torch.zeros(T * k, dtype=torch.int64, device=dev)  # every row names choice 0
    y_sorted = torch.arange(T * k, dtype=torch.float32, device=dev)[:, None].expand(T * k, d).contiguous()
    w = torch.ones(T, k, device=dev)
    with use(backend, DROPLESS_OPS):
        y = unpermute(y_sorted, order, w, T)
    # The last row naming choice 0 is the one it reads.
    assert torch.equal(y[0], torch.full((d,), float(T * k - 1), device=dev)) and not y[1:].any()


def test_round_trip_keeps_kept_tokens(backend):
    T, E, k, d = 64, 8, 2, 6
    experts = routing_choices("one_expert", T, E, k)  # expert 0 overflows: some tokens lose every choice
    positions, _ = reference.capacity_positions(experts, E, 4)
    x = torch.randn(T, d)
    w = torch.rand(T, k)
    with use(backend):
        y = combine(dispatch(x, experts, positions, E, 4), experts, positions, w)
    kept_weight = torch.where(positions >= 0, w, 0.0).sum(1, keepdim=True)
    assert_close(y, x * kept_weight)
    all_dropped = (positions < 0).all(1)
    assert all_dropped.any() and (y[all_dropped] == 0).all(), "a dropped token's output must be zero"


def noncontiguous_inputs(T=9, E=5, k=2, d=7):
    """Column-major experts / positions / x / weights / priority (positions for capacity 2)."""
    experts = routing_choices("empties", T, E, k).t().contiguous().t()
    positions, counts = reference.capacity_positions(experts.contiguous(), E, 2)
    return experts, positions.t().contiguous().t(), torch.randn(d, T).t(), torch.rand(k, T).t(), torch.rand(k, T).t()


def test_noncontiguous_inputs(backend):
    # The capacity ops alone, so a backend without permute kernels (cuda) still runs them.
    T, E = 9, 5
    experts, positions, x, w, priority = noncontiguous_inputs(T, E)
    with use(backend):
        got = capacity_positions(experts, E, 2, priority=priority)
        buffer = dispatch(x, experts, positions, E, 2)
        y = combine(buffer.transpose(0, 1).contiguous().transpose(0, 1), experts, positions, w)
    ref = reference.capacity_positions(experts.contiguous(), E, 2, priority=priority.contiguous())
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(buffer, reference.dispatch(x.contiguous(), experts, positions, E, 2))
    assert_close(y, reference.combine(buffer, experts, positions, w))


def test_noncontiguous_inputs_dropless(backend):
    T, E = 9, 5
    experts, _, x, w, _ = noncontiguous_inputs(T, E)
    with use(backend, DROPLESS_OPS):
        xs, off, order = permute(x, experts, E)
        yu = unpermute(xs.t().contiguous().t(), order, w, T)
    assert_close(yu, reference.unpermute(xs, order, w, T))


def test_deterministic(backend):
    T, E, k, d = (3000, 16, 2, 33) if backend != "triton" else (300, 4, 2, 33)
    experts = routing_choices("one_expert", T, E, k)
    positions, _ = reference.capacity_positions(experts, E, 300)
    x, w = torch.randn(T, d, requires_grad=True), torch.rand(T, k, requires_grad=True)
    outs = []
    for _ in range(2):
        with use(backend):
            y = combine(dispatch(x, experts, positions, E, 300) * 3, experts, positions, w)
        outs.append((y, *torch.autograd.grad(y.square().sum(), (x, w))))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- permute / unpermute


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
@pytest.mark.parametrize("kind", ROUTING_KINDS)
def test_permute_unpermute_match_reference(backend, kind, dtype):
    for T, E, k, d in shapes_for(backend):
        experts = routing_choices(kind, T, E, k, seed=T + 2)
        x = torch.randn(T, d).to(dtype).requires_grad_()
        w = torch.rand(T, k).requires_grad_()
        with use(backend, DROPLESS_OPS):
            xs, offsets, order = permute(x, experts, E)
            y = unpermute(xs * 2, order, w, T)
        ref_xs, ref_offsets, ref_order = reference.permute(x, experts, E)
        ref_y = reference.unpermute(ref_xs * 2, ref_order, w, T)
        assert torch.equal(order, ref_order) and torch.equal(offsets, ref_offsets)
        assert torch.equal(xs, ref_xs) and xs.dtype == dtype
        assert_close(y, ref_y)
        # Rows are grouped by expert and stable by (token, choice) inside a group.
        for e in range(E):
            rows = order[offsets[e] : offsets[e + 1]]
            assert (experts.reshape(-1)[rows] == e).all() and (rows.diff() > 0).all()
        if T and d:
            g = torch.randn(T, d).to(dtype)
            for a, b in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(ref_y, (x, w), g), strict=True):
                assert_close(a, b, dtype=dtype)


def test_permute_equals_dropless_dispatch_combine(backend):
    T, E, k, d = 30, 6, 3, 5
    experts = routing_choices("empties", T, E, k, seed=5)
    positions, _ = reference.capacity_positions(experts, E, T)  # capacity T: nothing drops
    x, w = torch.randn(T, d, dtype=torch.float64), torch.rand(T, k, dtype=torch.float64)
    with use(backend, CAPACITY_OPS + DROPLESS_OPS):
        xs, _, order = permute(x, experts, E)
        y = unpermute(torch.tanh(xs), order, w, T)
        y_capacity = combine(torch.tanh(dispatch(x, experts, positions, E, T)), experts, positions, w)
    assert_close(y, y_capacity)


# ---------------------------------------------------------------------------- torch.library / compile


def test_weight_gradient_of_dropped_choices_is_zero_with_nonfinite_grad(backend):
    """combine's and unpermute's gradient to the weights: 0 for a dropped or empty choice, also
    where the output's gradient holds inf or NaN (inf * 0 in a dot over a zero row would be NaN);
    a kept choice's dot is the reference's."""
    E, C, d = 2, 1, 4
    buffer = torch.randn(E, C, d)
    experts = torch.tensor([[0, 1], [1, -1]])
    positions = torch.tensor([[0, -1], [-1, -1]])  # (0, 0) kept, (0, 1) dropped, row 1 empty / dropped
    weights = torch.rand(2, 2)
    grad_y = torch.randn(2, d)
    grad_y[0, 0], grad_y[1, 1] = float("inf"), float("nan")

    def weight_grad(fn, *args):
        w = weights.clone().requires_grad_()
        (g,) = torch.autograd.grad(fn(*args, w), w, grad_y)
        return g

    with moe_kernels.use_backend(backend):
        got = weight_grad(lambda b, e, p, w: combine(b, e, p, w), buffer, experts, positions)
    want = weight_grad(reference.combine, buffer, experts, positions)
    assert torch.equal(got[:, 1], torch.zeros(2)) and got[1, 0] == 0 and torch.isinf(got[0, 0])
    assert torch.equal(got, want)

    x = torch.randn(2, d)
    with moe_kernels.use_backend(backend):
        y_sorted, _, order = permute(x, experts, E)
        got = weight_grad(lambda y, o, w: unpermute(y, o, w, 2), y_sorted, order)
    y_ref, _, order_ref = reference.permute(x, experts, E)
    want = weight_grad(lambda y, o, w: reference.unpermute(y, o, w, 2), y_ref, order_ref)
    assert got[1, 1] == 0 and torch.equal(torch.isnan(got), torch.isnan(want))
    assert_close(torch.nan_to_num(got), torch.nan_to_num(want))


def test_triton_double_backward(backend):
    """A backward that builds a graph (create_graph) through the Triton router and combine: their
    fused weight-gradient kernels have no autograd, so those calls take the torch formulas."""
    if backend != "triton":
        pytest.skip("the Triton backwards")
    logits = torch.randn(6, 8, dtype=torch.float64).float().requires_grad_()
    grads = []
    for b in (backend, "torch"):
        with moe_kernels.use_backend(b):
            w, _ = topk_router(logits, 2, renormalize=True)
            (g,) = torch.autograd.grad((w * torch.arange(2.0)).sum(), logits, create_graph=True)
            grads.append(torch.autograd.grad((g * g).sum(), logits)[0])
    assert_close(grads[0], grads[1])
    buffer = torch.randn(2, 3, 4, requires_grad=True)
    experts, positions = torch.tensor([[0, 1], [1, 0]]), torch.tensor([[0, 2], [1, -1]])
    weights = torch.rand(2, 2, requires_grad=True)
    seconds = []
    for b in (backend, "torch"):
        with moe_kernels.use_backend(b):
            y = combine(buffer, experts, positions, weights)
            (gw,) = torch.autograd.grad(y.square().sum(), weights, create_graph=True)
            seconds.append(torch.autograd.grad(gw.sum(), buffer)[0])
    assert_close(seconds[0], seconds[1])


def test_opcheck(kernel_backend):
    for T, E, k, d in [(7, 4, 2, 5), (0, 3, 1, 2), (6, 3, 3, 4)]:
        experts = routing_choices("empties", T, E, k, seed=T)
        C = capacity_for(T, E, k, 1.0)
        positions, _ = reference.capacity_positions(experts, E, C)
        x = torch.randn(T, d, requires_grad=True)
        w = torch.rand(T, k, requires_grad=True)
        buffer = torch.randn(E, C, d, requires_grad=True)
        if kernel_backend == "triton":
            ops = torch.ops.moe_kernels_triton
            torch.library.opcheck(ops.capacity_positions, (experts, E, C, None))
            torch.library.opcheck(ops.capacity_positions, (experts, E, C, torch.rand(T, k)))
            torch.library.opcheck(ops.dispatch, (x, experts, positions, E, C, None))
            torch.library.opcheck(ops.combine, (buffer, experts, positions, w))
            torch.library.opcheck(ops.kept_slots, (experts, positions, E, C))
            torch.library.opcheck(ops.permute, (x, experts, E))
            order = reference.permute(x, experts, E)[2]
            ys = torch.randn(T * k, d, requires_grad=True)
            torch.library.opcheck(ops.unpermute, (ys, order, w, T))
            grads = (torch.randn(T, d), ys.detach(), order, w.detach())
            torch.library.opcheck(ops.unpermute_backward, grads)
            torch.library.opcheck(ops.unpermute_backward, (*grads, True, False))
            torch.library.opcheck(ops.unpermute_backward, (*grads, False, True))
            continue
        ops = torch.ops.moe_kernels
        torch.library.opcheck(ops.capacity_positions, (experts, E, C, None))
        torch.library.opcheck(ops.capacity_positions, (experts, E, C, torch.rand(T, k)))
        torch.library.opcheck(ops.dispatch, (x, experts, positions, E, C))
        torch.library.opcheck(ops.combine, (buffer, experts, positions, w))
        torch.library.opcheck(ops.dispatch_backward, (buffer.detach(), experts, positions))
        torch.library.opcheck(
            ops.combine_backward, (torch.randn(T, d), buffer.detach(), experts, positions, w.detach())
        )
        torch.library.opcheck(ops.permute, (x, experts, E))
        order = reference.permute(x, experts, E)[2]
        ys = torch.randn(T * k, d, requires_grad=True)
        torch.library.opcheck(ops.unpermute, (ys, order, w, T))
        torch.library.opcheck(ops.unpermute_backward, (torch.randn(T, d), ys.detach(), order, w.detach()))


def test_torch_compile_fullgraph(kernel_backend):
    E, k = 8, 2

    def step(x, logits):
        weights, experts = moe_kernels.ops.topk_softmax(logits, k)
        C = capacity_for(x.shape[0], E, k, 1.0)
        positions, counts = capacity_positions(experts, E, C, priority=weights)
        y = combine(dispatch(x, experts, positions, E, C) * 2, experts, positions, weights)
        xs, _, order = permute(x, experts, E)
        return y + unpermute(xs, order, weights, x.shape[0]), counts

    x, logits = torch.randn(32, 6, requires_grad=True), torch.randn(32, E)
    with use(kernel_backend, CAPACITY_OPS + DROPLESS_OPS):
        compiled = torch.compile(
            step, fullgraph=True, backend="aot_eager" if kernel_backend == "triton" else "inductor"
        )
        y, counts = compiled(x, logits)
        y_eager, counts_eager = step(x, logits)
        assert_close(y, y_eager)
        assert torch.equal(counts, counts_eager)
        g = torch.randn_like(y)
        assert_close(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(y_eager, x, g)[0])


# ---------------------------------------------------------------------------- bad arguments

E_ = torch.zeros(4, 2, dtype=torch.int64)
X_ = torch.randn(4, 3)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: capacity_positions(E_.float(), 2, 1), TypeError, "experts"),
        (lambda: capacity_positions(E_[0], 2, 1), ValueError, "experts"),
        (lambda: capacity_positions(E_ + 2, 2, 1), ValueError, "experts"),  # expert out of range
        (lambda: capacity_positions(E_ - 2, 2, 1), ValueError, "experts"),  # below -1
        (lambda: capacity_positions(E_, 0, 1), ValueError, "num_experts"),
        (lambda: capacity_positions(E_, 2, -1), ValueError, "capacity"),
        (lambda: capacity_positions(E_, 2, 1.5), TypeError, "capacity"),
        (lambda: capacity_positions(E_, 2, 1, priority=torch.rand(4, 3)), ValueError, "priority"),
        (lambda: capacity_positions(E_, 2, 1, priority=torch.ones(4, 2, dtype=torch.int64)), TypeError, "priority"),
        (lambda: dispatch(X_[0], E_, E_, 2, 1), ValueError, "x"),
        (lambda: dispatch(X_.int(), E_, E_, 2, 1), TypeError, "x"),
        (lambda: dispatch(X_, E_[:3], E_[:3], 2, 1), ValueError, "experts"),
        (lambda: dispatch(X_, E_, E_[:, :1], 2, 1), ValueError, "positions"),
        (lambda: dispatch(X_, E_, E_ + 1, 2, 1), ValueError, "positions"),  # position >= capacity
        (lambda: combine(torch.randn(2, 1, 3), E_, E_, torch.rand(4, 3)), ValueError, "weights"),
        (lambda: combine(torch.randn(2, 3), E_, E_, torch.rand(4, 2)), ValueError, "buffer"),
        (lambda: combine(torch.randn(1, 1, 3), E_ + 1, E_, torch.rand(4, 2)), ValueError, "experts"),
        (lambda: permute(X_, E_, 0), ValueError, "num_experts"),
        (lambda: permute(X_, E_[:2], 2), ValueError, "experts"),
        (lambda: unpermute(torch.randn(8, 3), torch.arange(8), torch.rand(4, 2), 5), ValueError, "num_tokens"),
        (lambda: unpermute(torch.randn(8, 3), torch.arange(8).float(), torch.rand(4, 2), 4), TypeError, "order"),
    ],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
