"""Reference n x k Gumbel-Matching (Kool et al., 004_62bca7777c830867.txt, Section 2.2 and
Appendix D.3-D.4): the optimal balanced assignment of s = logits / tau + G (eq 4) and the
conditionals q(z_i = j | A, G_-i) (eq 9) from the optimal value and the all-pairs move costs d*.
"""

import torch

from moe_kernels.reference.balanced_assignment import balanced_assignment


def sample_gumbels(shape, *, dtype=torch.float64, device=None, generator=None) -> torch.Tensor:
    """Standard Gumbel(0) noise, -log(-log U) with U ~ Uniform(0, 1) (0 excluded)."""
    u = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    u = u.clamp_min(torch.finfo(torch.float64).tiny)
    return (-torch.log(-torch.log(u))).to(dtype)


def conditionals(logits: torch.Tensor, tau: float, experts: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """q [n, k] from eqs 7 and 9.

    Eq 7: v*_{|z_ij=1} = v* - s[i, z_i] + s[i, j] - d*[j, z_i]. Eq 9: q_ij = softmax_j(v*_{|z_ij=1}
    - g_ij). The g_ij cancel against the s[i, j] = a_ij / tau + g_ij, and v* - s[i, z_i] is the same
    for every j, so q_i = softmax_j(a_ij / tau - d*[j, z_i]): it does not depend on g_i (d* and
    z_i do, but only as far as the problem without token i does). d* = +inf (no chain of moves
    frees a slot of z_i for a token of j) gives q_ij = 0.
    """
    a = logits.double() / tau
    forced = distances[:, experts].t()  # [n, k]: d*[j, z_i]
    return torch.softmax(a - forced, dim=-1)


def gumbel_matching(logits: torch.Tensor, tau: float, capacity: int, gumbels: torch.Tensor):
    """Returns (experts [n] int64, conditionals [n, k] float64). gumbels [n, k] is given."""
    s = logits.double() / tau + gumbels.double()
    experts, _, distances = balanced_assignment(s, capacity)
    return experts, conditionals(logits, tau, experts, distances)
