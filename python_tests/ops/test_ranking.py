"""reference/ranking.py: the one ranking every reference op uses, built so that it does not depend
on a device's sort (CUDA's stable descending sort put NaN last; make gpu-check found it). On the
CPU it must equal the plain stable torch.sort the references used before, whose order is the
documented convention."""

import pytest
import torch

from moe_kernels.reference.ranking import descending_order

SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0]


def rows(seed: int, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(SPECIALS) + 3, shape, generator=g)
    x = torch.randn(shape, generator=g).round()  # small integers: many ties
    for i, v in enumerate(SPECIALS):
        x[pick == i] = v
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [0, -1])
def test_matches_the_cpu_sort_convention(dtype, dim):
    for seed in range(20):
        x = rows(seed, (7, 13), dtype)
        expected = torch.sort(x, dim=dim, descending=True, stable=True).indices
        assert torch.equal(descending_order(x, dim), expected), x


def test_nan_last_matches_the_ascending_sort_of_the_negation():
    # capacity_positions' priorities: by descending priority, NaN priorities last (what
    # torch.sort(-p, stable=True) gave on the CPU).
    for seed in range(20):
        p = rows(seed, (40,), torch.float32)
        assert torch.equal(descending_order(p, 0, nan_last=True), torch.sort(-p, stable=True).indices)


def test_explicit_order():
    x = torch.tensor([1.0, float("nan"), float("inf"), -0.0, 0.0, float("nan"), float("-inf"), 1.0])
    assert descending_order(x).tolist() == [1, 5, 2, 0, 7, 3, 4, 6]
    assert descending_order(x, nan_last=True).tolist() == [2, 0, 7, 3, 4, 6, 1, 5]


def test_empty():
    assert descending_order(torch.empty(0, 3)).shape == (0, 3)
    assert descending_order(torch.empty(3, 0)).shape == (3, 0)
