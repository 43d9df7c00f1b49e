"""skip_sample: capacity, the weight identities, uniform keeping and unbiasedness of eq 3's
weights against exact enumeration (Monte Carlo, within 4 sigma)."""

import itertools

import pytest
import torch

from moe_kernels.ops import skip_sample


def test_capacity_and_weight_identities():
    g = torch.Generator().manual_seed(0)
    for n, k, c in [(20, 3, 4), (7, 2, 10), (16, 4, 4), (5, 1, 2), (0, 3, 1)]:
        probs = torch.rand(n, k, generator=g)
        z, kept, w = skip_sample(probs, c, generator=g)
        assert z.shape == kept.shape == w.shape == (n,)
        counts = torch.bincount(z, minlength=k)
        kept_counts = torch.bincount(z[kept], minlength=k)
        assert torch.equal(kept_counts, counts.clamp(max=c))
        assert (w[~kept] == 0).all()
        per_expert = torch.zeros(k).index_add_(0, z, w)
        assert torch.allclose(per_expert, counts.float())  # kept weights of expert j sum to n_j


def test_keeping_is_uniform():
    """All tokens go to one expert of capacity 2: each of 5 tokens is kept w.p. 2 / 5."""
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([[1.0, 0.0]] * 5)
    trials = 2000
    hits = torch.zeros(5)
    for _ in range(trials):
        _, kept, w = skip_sample(probs, 2, generator=g)
        hits += kept.float()
        assert torch.allclose(w[kept], torch.full((2,), 2.5))
    sigma = (0.4 * 0.6 / trials) ** 0.5
    assert ((hits / trials - 0.4).abs() < 4 * sigma).all(), hits / trials


def test_unbiased_against_enumeration():
    """E[(1/n) sum_i w_i f(i, z_i)] = (1/n) sum_i sum_j p_ij f(i, j) (eq 3 without gradients);
    the uncorrected average over kept tokens (Sample Skip) is biased here."""
    g = torch.Generator().manual_seed(2)
    n, k, c = 4, 2, 2
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.4, 0.6]], dtype=torch.float64)
    f = torch.tensor([[1.0, -2.0], [3.0, 0.5], [-1.0, 2.0], [0.0, 4.0]], dtype=torch.float64)
    exact = float((probs * f).sum() / n)
    # Exact enumeration of z confirms the identity E[w_i | z] = 1 is what makes it unbiased.
    total = 0.0
    for z in itertools.product(range(k), repeat=n):
        pz = float(torch.prod(probs[torch.arange(n), torch.tensor(z)]))
        total += pz * sum(float(f[i, z[i]]) for i in range(n)) / n
    assert abs(total - exact) < 1e-12
    trials = 4000
    est, naive = torch.empty(trials, dtype=torch.float64), torch.empty(trials, dtype=torch.float64)
    for t in range(trials):
        z, kept, w = skip_sample(probs, c, generator=g)
        fz = f[torch.arange(n), z]
        est[t] = (w * fz).sum() / n
        naive[t] = fz[kept].mean()
    se = float(est.std() / trials**0.5)
    assert abs(float(est.mean()) - exact) < 4 * se, (float(est.mean()), exact, se)
    assert abs(float(naive.mean()) - exact) > 4 * float(naive.std() / trials**0.5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="capacity"):
        skip_sample(torch.rand(4, 2), 0)
    with pytest.raises(ValueError, match="non-negative"):
        skip_sample(torch.tensor([[0.5, -0.1]]), 1)
    with pytest.raises(ValueError, match="non-negative"):
        skip_sample(torch.tensor([[0.0, 0.0]]), 1)
    with pytest.raises(ValueError, match="non-negative"):
        skip_sample(torch.tensor([[float("nan"), 1.0]]), 1)
    with pytest.raises(TypeError, match="capacity"):
        skip_sample(torch.rand(4, 2), 2.0)
