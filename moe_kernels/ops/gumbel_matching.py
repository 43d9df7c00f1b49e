"""moe_kernels.ops.gumbel_matching: n x k Gumbel-Matching samples and their conditionals.

Built on moe_kernels.ops.balanced_assignment (which picks the solver backend); the conditionals
are a few tensor ops on d* (moe_kernels/reference/gumbel_matching.py), no re-solving.
"""

import torch

from moe_kernels.ops import _validate
from moe_kernels.ops.balanced_assignment import SCORE_DTYPES, balanced_assignment, check_scores
from moe_kernels.reference.gumbel_matching import conditionals, sample_gumbels


def gumbel_matching(
    logits: torch.Tensor,
    tau: float = 1.0,
    capacity: int | None = None,
    gumbels: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
):
    """A balanced assignment sampled from the n x k Gumbel-Matching distribution (eq 4) and the
    conditionals q(z_i = j | A, G_-i) of eq 9.

    Args:
      logits: [n, k] float, finite: a_ij (e.g. log p(z_i = j | x_i); any per-row shift is fine).
      tau: temperature > 0; s = logits / tau + gumbels.
      capacity: per expert, capacity * k >= n; default ceil(n / k).
      gumbels: [n, k] the noise G (standard Gumbel) to use; sampled with `generator` if None.

    Returns:
      (experts [n] int64, the optimal assignment of s;
       conditionals [n, k] in the logits' dtype: q_ij = P(z_i = j | A, G_-i), rows sum to 1,
       q[i, experts[i]] is the importance-weight denominator of eq 6). Not differentiable (the
       estimators treat q as a constant proposal).
    """
    capacity = check_scores("logits", logits, capacity, check_finite=True)
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau must be a positive number, got {tau!r}")
    if gumbels is None:
        gumbels = sample_gumbels(logits.shape, device=logits.device, generator=generator)
    else:
        _validate.tensor("gumbels", gumbels, dim=2, shape="[n, k]", dtypes=SCORE_DTYPES)
        if gumbels.shape != logits.shape:
            raise ValueError(f"gumbels must have the logits' shape {tuple(logits.shape)}, got {tuple(gumbels.shape)}")
        _validate.same_device(logits=logits, gumbels=gumbels)
        if gumbels.numel() and not bool(torch.isfinite(gumbels).all()):  # logits are checked (a sync) already
            raise ValueError("gumbels must be finite (no NaN or inf)")
    with torch.no_grad():
        s = logits.detach().double() / tau + gumbels.double()
        experts, _, distances = balanced_assignment(s, capacity, return_distances=True)
        q = conditionals(logits.detach(), tau, experts, distances)
    return experts, q.to(logits.dtype)
