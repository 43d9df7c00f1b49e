"""gumbel_matching: samples are optimal for logits / tau + G, conditionals (eqs 7-9) against brute
force (re-solving without token i), their independence of g_i, and a Monte Carlo check."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

import moe_kernels
from moe_kernels.ops import gumbel_matching
from moe_kernels.reference.gumbel_matching import sample_gumbels


def run(backend, *args, **kw):
    if backend == "triton":
        pytest.skip("gumbel_matching uses balanced_assignment, which has no Triton kernel")
    with moe_kernels.use_backend(backend):
        return gumbel_matching(*args, **kw)


def best_value(s: np.ndarray, caps: list[int]) -> float:
    """Optimal value with per-expert capacities caps (scipy on the expanded matrix); -inf if the
    slots cannot hold every token."""
    if s.shape[0] == 0:
        return 0.0
    if sum(caps) < s.shape[0]:
        return -math.inf
    big = np.concatenate([np.repeat(s[:, j : j + 1], c, axis=1) for j, c in enumerate(caps)], axis=1)
    r, c = linear_sum_assignment(big, maximize=True)
    return float(big[r, c].sum())


def brute_force_conditionals(logits, tau, capacity, gumbels):
    """Eq 9 by re-solving: q_ij = softmax_j(v*_{-ij}(A_-i, G_-i) + a_ij / tau), where v*_{-ij}
    is the optimum of the other n - 1 tokens with one slot of expert j taken by token i."""
    n, k = logits.shape
    s = (logits.double() / tau + gumbels.double()).numpy()
    q = np.zeros((n, k))
    for i in range(n):
        rest = np.delete(s, i, axis=0)
        scores = []
        for j in range(k):
            caps = [capacity - (jp == j) for jp in range(k)]
            v = best_value(rest, caps) if caps[j] >= 0 else -math.inf
            scores.append(v + float(logits[i, j]) / tau)
        scores = np.array(scores)
        q[i] = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    return torch.from_numpy(q)


@pytest.mark.parametrize("n,k,capacity", [(6, 3, 2), (7, 3, 3), (8, 4, 2), (5, 2, 4), (6, 6, 1), (4, 1, 4)])
@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
def test_conditionals_against_brute_force(backend, n, k, capacity, tau):
    g = torch.Generator().manual_seed(n * 10 + k)
    logits = torch.randn(n, k, generator=g, dtype=torch.float64)
    gumbels = sample_gumbels((n, k), generator=g)
    experts, q = run(backend, logits, tau, capacity, gumbels=gumbels)
    assert torch.allclose(q, brute_force_conditionals(logits, tau, capacity, gumbels), atol=1e-9, rtol=0)
    assert torch.allclose(q.sum(1), torch.ones(n, dtype=torch.float64))
    # The sample is the optimum of eq 4.
    s = (logits / tau + gumbels).numpy()
    assert math.isclose(float(s[np.arange(n), experts.numpy()].sum()), best_value(s, [capacity] * k), abs_tol=1e-9)


def test_conditionals_do_not_depend_on_own_noise(backend):
    """q(z_i | A, G_-i): resampling g_i changes z_i but not q_i; z_i follows q_i (Monte Carlo)."""
    n, k, i = 9, 3, 4
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(n, k, generator=g, dtype=torch.float64) * 2
    gumbels = sample_gumbels((n, k), generator=g)
    _, q0 = run(backend, logits, 1.0, gumbels=gumbels)
    counts = torch.zeros(k)
    trials = 400
    for _ in range(trials):
        gumbels[i] = sample_gumbels((k,), generator=g)
        z, q = run(backend, logits, 1.0, gumbels=gumbels)
        assert torch.allclose(q[i], q0[i], atol=1e-12, rtol=0)
        counts[z[i]] += 1
    freq = counts / trials
    sigma = (q0[i] * (1 - q0[i]) / trials).sqrt().float()
    assert ((freq - q0[i].float()).abs() <= 4 * sigma + 1e-3).all(), (freq, q0[i])


def test_tau_to_zero_is_the_balanced_argmax(backend):
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    z, _ = run(backend, logits, 1e-6, gumbels=torch.zeros(12, 4))
    assert torch.equal(torch.bincount(z, minlength=4), torch.full((4,), 3))


def test_generator_reproducible_and_dtype(backend):
    logits = torch.randn(20, 5, dtype=torch.float32)
    z1, q1 = run(backend, logits, generator=torch.Generator().manual_seed(5))
    z2, q2 = run(backend, logits, generator=torch.Generator().manual_seed(5))
    assert torch.equal(z1, z2) and torch.equal(q1, q2) and q1.dtype == torch.float32


def test_bad_arguments():
    logits = torch.randn(6, 3)
    with pytest.raises(ValueError, match="tau"):
        gumbel_matching(logits, tau=0.0)
    with pytest.raises(ValueError, match="gumbels"):
        gumbel_matching(logits, gumbels=torch.zeros(6, 2))
    with pytest.raises(ValueError, match="capacity"):
        gumbel_matching(logits, capacity=1)
    logits[0, 0] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        gumbel_matching(logits)
