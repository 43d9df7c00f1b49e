"""The Triton launchers with out-of-range ids (issue 15, item 1, GPU part): never an access out of
bounds and no host sync; a choice whose expert id is outside [0, E) (or whose position is outside
[0, C)) is dropped, exactly as if it were -1 (empty). The raw ops, and the public ops on the
"triton" backend, which read no value to range-check it (only the host backends "cpu" / "torch"
raise; issue 30): forward and backward. Run in the interpreter pass; on a GPU the same launchers
run."""

import pytest
import torch

import moe_kernels  # registers the moe_kernels_triton ops
from moe_kernels import backends

pytestmark = pytest.mark.triton

T, E, k, C, d = 5, 4, 2, 3, 3
BAD = [E, 10**6, -5, -(2**40)]


def _ops():
    if not (backends.triton_importable() and backends.triton_interpreting()):
        pytest.skip("the Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
    return torch.ops.moe_kernels_triton


def inputs():
    g = torch.Generator().manual_seed(0)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    x = torch.randn(T, d, generator=g)
    return experts, x


@pytest.mark.parametrize("bad", BAD)
def test_capacity_positions_drops_out_of_range_experts(bad):
    ops = _ops()
    experts, _ = inputs()
    poisoned, empty = experts.clone(), experts.clone()
    poisoned[1, 0], empty[1, 0] = bad, -1
    assert all(
        torch.equal(a, b) for a, b in zip(ops.capacity_positions(poisoned, E, C), ops.capacity_positions(empty, E, C))
    )


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["experts", "positions"])
def test_dispatch_and_combine_drop_out_of_range_choices(bad, where):
    ops = _ops()
    experts, x = inputs()
    positions, _ = ops.capacity_positions(experts, E, C)
    poisoned_e, poisoned_p, empty_p = experts.clone(), positions.clone(), positions.clone()
    (poisoned_e if where == "experts" else poisoned_p)[2, 1] = bad
    empty_p[2, 1] = -1
    w = torch.rand(T, k)
    buffer = ops.dispatch(x, poisoned_e, poisoned_p, E, C)
    assert torch.equal(buffer, ops.dispatch(x, experts, empty_p, E, C))
    assert torch.equal(ops.combine(buffer, poisoned_e, poisoned_p, w), ops.combine(buffer, experts, empty_p, w))


@pytest.mark.parametrize("bad", BAD)
def test_permute_drops_out_of_range_experts(bad):
    ops = _ops()
    experts, x = inputs()
    poisoned, empty = experts.clone(), experts.clone()
    poisoned[3, 1], empty[3, 1] = bad, -1
    for a, b in zip(ops.permute(x, poisoned, E), ops.permute(x, empty, E), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", [T * k, 10**6, -5])
def test_unpermute_ignores_out_of_range_order(bad):
    ops = _ops()
    experts, x = inputs()
    y_sorted, _, order = ops.permute(x, experts, E)
    w = torch.rand(T, k)
    poisoned, empty = order.clone(), order.clone()
    poisoned[0], empty[0] = bad, -1
    assert torch.equal(ops.unpermute(y_sorted, poisoned, w, T), ops.unpermute(y_sorted, empty, w, T))
    g = torch.randn(T, d)
    for a, b in zip(ops.unpermute_backward(g, y_sorted, poisoned, w), ops.unpermute_backward(g, y_sorted, empty, w)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- public ops on the Triton backend


def _forward_and_grads(call, leaves, *args):
    """(outputs, gradients of sum(outputs * fixed weights) with respect to leaves), detached."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = call(*leaves, *args)
    outs = list(out) if isinstance(out, tuple) else [out]
    diff = [o for o in outs if o.requires_grad]
    g = torch.Generator().manual_seed(7)
    grads = torch.autograd.grad(diff, leaves, [torch.randn(o.shape, generator=g) for o in diff])
    return [o.detach() for o in outs], list(grads)


def _assert_same(a, b):
    for u, v in zip([*a[0], *a[1]], [*b[0], *b[1]], strict=True):
        assert torch.equal(u, v)


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["experts", "positions"])
def test_public_capacity_ops_drop_out_of_range_choices(bad, where):
    _ops()
    from moe_kernels.ops import capacity_positions, combine, dispatch

    experts, x = inputs()
    with moe_kernels.use_backend("triton"):
        positions, _ = capacity_positions(experts, E, C)
        poisoned_e, poisoned_p, empty_p = experts.clone(), positions.clone(), positions.clone()
        (poisoned_e if where == "experts" else poisoned_p)[2, 1] = bad
        empty_p[2, 1] = -1
        if where == "experts":
            empty_e = experts.clone()
            empty_e[2, 1] = -1
            assert all(map(torch.equal, capacity_positions(poisoned_e, E, C), capacity_positions(empty_e, E, C)))
        run_dispatch = lambda x_, e, p: dispatch(x_, e, p, E, C)  # noqa: E731
        _assert_same(
            _forward_and_grads(run_dispatch, [x], poisoned_e, poisoned_p),
            _forward_and_grads(run_dispatch, [x], experts, empty_p),
        )
        buffer, w = torch.randn(E, C, d), torch.rand(T, k)
        run_combine = lambda b, w_, e, p: combine(b, e, p, w_)  # noqa: E731
        _assert_same(
            _forward_and_grads(run_combine, [buffer, w], poisoned_e, poisoned_p),
            _forward_and_grads(run_combine, [buffer, w], experts, empty_p),
        )


@pytest.mark.parametrize("bad", BAD)
def test_public_permute_drops_out_of_range_experts(bad):
    _ops()
    from moe_kernels.ops import permute

    experts, x = inputs()
    poisoned, empty = experts.clone(), experts.clone()
    poisoned[3, 1], empty[3, 1] = bad, -1
    with moe_kernels.use_backend("triton"):
        run = lambda x_, e: permute(x_, e, E)  # noqa: E731
        _assert_same(_forward_and_grads(run, [x], poisoned), _forward_and_grads(run, [x], empty))


@pytest.mark.parametrize("bad", [T * k, 10**6, -5])
def test_public_unpermute_ignores_out_of_range_order(bad):
    ops = _ops()
    from moe_kernels.ops import unpermute

    experts, x = inputs()
    y_sorted, _, order = ops.permute(x, experts, E)
    poisoned, empty = order.clone(), order.clone()
    poisoned[0], empty[0] = bad, -1
    with moe_kernels.use_backend("triton"):
        run = lambda y, w, o: unpermute(y, o, w, T)  # noqa: E731
        w = torch.rand(T, k)
        _assert_same(_forward_and_grads(run, [y_sorted, w], poisoned), _forward_and_grads(run, [y_sorted, w], empty))


@pytest.mark.parametrize("weighted", [False, True])
def test_dispatch_one_writer_per_slot_when_positions_repeat(weighted):
    # Positions that repeat within an expert are invalid (the host backends raise); the GPU reads
    # no value to check them. Each token row is scattered to its slots, but a slot is written only
    # by the choice the slot -> choice map names, so the buffer is what the gather from that map
    # gives: one writer per slot, whatever order the programs run in; empty slots are zeros.
    from moe_kernels.triton import routing_maps as maps

    ops = _ops()
    # Slot (3, 0) is claimed by choices 1 (token 0, s = 1) and 6 (token 3, s = 0): the map names 6,
    # and a kernel that let the later store win would keep 1 (it stores s = 1 after s = 0).
    experts = torch.tensor([[0, 3], [0, 2], [1, 0], [3, 2], [0, 1]])
    positions = torch.tensor([[0, 0], [0, 1], [0, 2], [0, 1], [1, 0]])
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(T, d, generator=g), torch.rand(T, k, generator=g)
    buffer = ops.dispatch(x, experts, positions, E, C, w if weighted else None).reshape(E * C, d)
    _, source = maps.slot_maps(experts, positions, E, C)
    assert source[3 * C] == 6, "the largest choice naming a repeated slot fills it"
    for slot, choice in enumerate(source.tolist()):
        if choice < 0:
            assert torch.equal(buffer[slot], torch.zeros(d)), slot
        else:
            scale = w.reshape(-1)[choice] if weighted else 1.0
            assert torch.equal(buffer[slot], (x[choice // k] * scale).to(x.dtype)), slot


def test_unpermute_backward_writes_every_row_when_order_repeats():
    # A malformed order naming one choice from two rows: the forward reads one of them (the
    # choice -> row map's), so the other's gradient is zero, written, not left as it was allocated.
    ops = _ops()
    experts, x = inputs()
    y_sorted, _, order = ops.permute(x, experts, E)
    bad = order.clone()
    bad[1] = bad[0]
    w, g = torch.rand(T, k), torch.randn(T, d)
    ys = y_sorted.clone().requires_grad_()
    ops.unpermute(ys, bad, w, T).backward(g)
    for _ in range(3):
        torch.full((64 * T * k * d,), float("nan"))  # reused memory must not leak into the result
        grad_rows, _ = ops.unpermute_backward(g, y_sorted, bad, w)
        assert torch.equal(grad_rows, ys.grad)
    from moe_kernels.triton.routing_maps import inverse_map

    rows = inverse_map(bad, T * k)
    assert rows[bad[0]] == 1, "the largest row naming a repeated choice reads it"
    read = set(rows.tolist())
    unread = [r for r in range(T * k) if r not in read]
    assert unread and all(torch.equal(ys.grad[r], torch.zeros(d)) for r in unread)


@pytest.mark.parametrize("bad", BAD)
def test_double_backward_drops_out_of_range_ids(bad):
    # A backward that builds a graph differentiates the reference, which would index an id the
    # kernels drop: the ids are dropped before it (as -1), the gradient as for an empty choice.
    _ops()
    experts, x = inputs()
    positions, _ = moe_kernels.reference.capacity_positions(experts, E, C)
    _, _, order = moe_kernels.reference.permute(x, experts, E)
    w = torch.rand(T, k)
    buffer = torch.randn(E, C, d)

    def second(f, t, poisoned):
        t = t.clone().requires_grad_()
        with moe_kernels.use_backend("triton"):
            (grad,) = torch.autograd.grad(f(t, poisoned).square().sum(), t, create_graph=True)
            return torch.autograd.grad(grad.square().sum(), t)[0]

    def combine(b, e):
        return moe_kernels.ops.combine(b, e, positions, w)

    def unpermute(y, o):
        return torch.ops.moe_kernels_triton.unpermute(y, o, w, T)

    poisoned_e, empty_e = experts.clone(), experts.clone()
    poisoned_e[2, 1], empty_e[2, 1] = bad, -1
    empty_p = positions.clone()
    empty_p[2, 1] = -1
    got = second(combine, buffer, poisoned_e)
    with moe_kernels.use_backend("torch"):
        b = buffer.clone().requires_grad_()
        (grad,) = torch.autograd.grad(
            moe_kernels.ops.combine(b, experts, empty_p, w).square().sum(), b, create_graph=True
        )
        expected = torch.autograd.grad(grad.square().sum(), b)[0]
    torch.testing.assert_close(got, expected)
    y_sorted = torch.randn(T * k, d)
    poisoned_o, empty_o = order.clone(), order.clone()
    poisoned_o[0], empty_o[0] = bad, -1
    torch.testing.assert_close(second(unpermute, y_sorted, poisoned_o), second(unpermute, y_sorted, empty_o))
