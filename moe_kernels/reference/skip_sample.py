"""Reference 'skip' sampling (Kool et al., 004_62bca7777c830867.txt, Section 2.1, Appendix C):
independent expert samples, then per expert a uniformly random subset of min(n_j, c) tokens kept.
"""

import torch


def skip_sample(probs: torch.Tensor, capacity: int, generator=None):
    """probs [n, k] (rows: a distribution, need not be normalised) -> (experts [n] int64 sampled
    z_i ~ Categorical(probs_i), kept [n] bool (delta_i), weights [n] in probs' dtype:
    delta_i * n_{z_i} / min(n_{z_i}, c), so that E[weights_i | z] = 1 (eq 3's correction)).

    The kept subset is uniform: tokens of an expert are ordered by independent Uniform(0, 1) keys
    (one per token, drawn after the experts) and the first min(n_j, c) are kept.
    """
    n, k = probs.shape
    if n == 0:
        empty = torch.empty(0, dtype=torch.int64, device=probs.device)
        return empty, empty.bool(), probs.new_empty(0)
    if probs.dtype == torch.float64:
        # Divided by the row maximum in float64: rows of 1e-300 (0 in float32) or 1e300 (inf in
        # float32) sample like any other row.
        experts = torch.multinomial(probs / probs.amax(1, keepdim=True), 1, generator=generator).squeeze(1)
    else:
        experts = torch.multinomial(probs.float(), 1, generator=generator).squeeze(1)
    keys = torch.rand(n, generator=generator, dtype=torch.float64, device=probs.device)
    order = torch.argsort(experts.double() * 2 + keys)  # grouped by expert, random within
    counts = torch.bincount(experts, minlength=k)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(experts)
    rank[order] = torch.arange(n, device=probs.device) - starts[experts[order]]
    kept = rank < capacity
    # In float64, then rounded once: counts above 2048 are not exact in float16.
    n_z = counts[experts].double()
    weights = torch.where(kept, n_z / n_z.clamp(max=capacity), torch.zeros_like(n_z))
    return experts, kept, weights.to(probs.dtype)
