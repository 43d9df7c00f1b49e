"""Reference DSelect-k gate (003_a1a58754fcb6a991.txt, eqs 4 and 6, Sections 3.1 and 3.2)."""

import torch

from moe_kernels.reference.smooth_step import smooth_step


def num_bits(num_experts: int) -> int:
    """m, the smallest integer with num_experts <= 2^m (Appendix B.2): the columns of z."""
    return (num_experts - 1).bit_length()


def selectors(s: torch.Tensor) -> torch.Tensor:
    """Single expert selectors r(s) of eq 4 for s = S(z) in [0, 1]: [..., m] -> [..., 2^m].

    Entry l (0-based: the paper's expert l + 1) is prod_j (s_j if bit j of l is set else 1 - s_j),
    bit 0 being the least significant (the paper's z_1). On the simplex for s in [0, 1]
    (Proposition 2); one-hot at l = sum_j s_j 2^j when s is binary.
    """
    m = s.shape[-1]
    index = torch.arange(2**m, device=s.device)
    bits = ((index[:, None] >> torch.arange(m, device=s.device)) & 1).bool()  # [2^m, m]
    factors = torch.where(bits, s[..., None, :], 1 - s[..., None, :])  # [..., 2^m, m]
    if m == 0:  # one expert: the empty product, 1 (prod keeps z, with no column, in the graph)
        return factors.prod(-1)
    # The product in order of j, by multiplications: torch's prod backward reads on the host
    # whether a factor is zero (a sync in the op's double backward, which differentiates this).
    out = factors[..., 0]
    for j in range(1, m):
        out = out * factors[..., j]
    return out


def dselect_k(alpha: torch.Tensor, z: torch.Tensor, num_experts: int, gamma: float, return_selectors: bool = False):
    """DSelect-k gate q~(alpha, Z) = sum_i softmax(alpha)_i r(S(z_i)) (eq 6).

    Args:
      alpha: [k] (static gate) or [B, k] (per example: alpha = G x), float.
      z: [k, m] or [B, k, m] (z_i = W_i x per example), same dtype as alpha, with
        m = ceil(log2(num_experts)) (0 for one expert).
      num_experts: n >= 1. The selectors have 2^m entries; those past n are not experts
        (Appendix B.2): they are dropped from the gates, which are NOT renormalised (their mass
        is what the gate's Appendix B.2 penalty pushes towards the experts).
      gamma: smooth-step width, > 0.
      return_selectors: also return r(S(z_i)) for every selector (for the entropy regulariser).

    Returns:
      gates [n] or [B, n] in alpha's dtype (computed in float32, float64 for float64), and if
      return_selectors, selectors [k, 2^m] or [B, k, 2^m] (each row on the simplex).
    """
    compute = torch.float64 if alpha.dtype == torch.float64 else torch.float32
    p = torch.softmax(alpha.to(compute), dim=-1)  # [..., k]
    r = selectors(smooth_step(z.to(compute), gamma))  # [..., k, 2^m]
    gates = (p[..., None] * r[..., :num_experts]).sum(-2)
    if return_selectors:
        return gates.to(alpha.dtype), r.to(alpha.dtype)
    return gates.to(alpha.dtype)
