"""The Triton launchers with out-of-range ids (issue 15, item 1, GPU part): never an access out of
bounds and no host sync; a choice whose expert id is outside [0, E) (or whose position is outside
[0, C)) is dropped, exactly as if it were -1 (empty). Raw ops, as the public ops never pass such
ids (they range-check CPU tensors). Run in the interpreter pass; on a GPU the same launchers run."""

import pytest
import torch

import moe_kernels  # noqa: F401  (registers the moe_kernels_triton ops)
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
