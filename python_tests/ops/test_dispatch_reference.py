"""The reference capacity routing on hand-checked cases (the kernels' tests compare against it)."""

import torch

from moe_kernels import reference


def test_positions_default_order_first_choices_first():
    experts = torch.tensor([[0, 1], [0, 2], [0, -1], [1, 0]])
    positions, counts = reference.capacity_positions(experts, 3, 2)
    # choice 0 of every token before any choice 1: t0,t1 fill expert 0, t2's overflows, t3 -> e1
    assert positions.tolist() == [[0, 1], [1, 0], [-1, -1], [0, -1]]
    assert counts.tolist() == [4, 2, 1]


def test_positions_priority_order():
    experts = torch.tensor([[0, 1], [0, 2], [0, -1], [1, 0]])
    priority = torch.tensor([[0.1, 0.2], [0.9, 0.1], [0.5, 0.0], [0.3, 0.95]])
    positions, _ = reference.capacity_positions(experts, 3, 2, priority=priority)
    assert positions.tolist() == [[-1, 1], [1, 0], [-1, -1], [0, 0]]


def test_dispatch_combine_round_trip_and_gradcheck():
    experts = torch.tensor([[0, 1], [0, 2], [0, -1], [1, 0]])
    positions, _ = reference.capacity_positions(experts, 3, 2)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    y = reference.combine(reference.dispatch(x, experts, positions, 3, 2), experts, positions, w)
    kept = (positions >= 0).double()
    torch.testing.assert_close(y, x * (w * kept).sum(1, keepdim=True))
    assert torch.autograd.gradcheck(
        lambda x, w: reference.combine(reference.dispatch(x, experts, positions, 3, 2), experts, positions, w), (x, w)
    )


def test_permute_unpermute_equals_dropless_combine():
    experts = torch.tensor([[0, 1], [0, 2], [0, -1], [1, 0]])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    x_sorted, offsets, order = reference.permute(x, experts, 3)
    assert offsets.tolist() == [0, 4, 6, 7] and order.tolist() == [0, 2, 4, 7, 1, 6, 3, -1]
    positions, _ = reference.capacity_positions(experts, 3, 8)
    expected = reference.combine(reference.dispatch(x, experts, positions, 3, 8), experts, positions, w)
    torch.testing.assert_close(reference.unpermute(x_sorted, order, w, 4), expected)
    assert torch.autograd.gradcheck(
        lambda x, w: reference.unpermute(reference.permute(x, experts, 3)[0], order, w, 4), (x, w)
    )
