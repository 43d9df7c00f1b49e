"""moe_kernels.ops.skip_sample: independent samples with capacity-limited skipping (Section 2.1).
A few vectorised tensor ops (moe_kernels/reference/skip_sample.py) on every device: no kernel.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _validate
from moe_kernels.ops.balanced_assignment import SCORE_DTYPES

backends.register("skip_sample", torch=reference.skip_sample, extension=False)


def skip_sample(probs: torch.Tensor, capacity: int, generator: torch.Generator | None = None):
    """Sample z_i ~ probs_i independently, keep a uniformly random min(n_j, capacity) of the tokens
    of each expert j (n_j = tokens sampled for j), and return the unbiasing weights of eq 3.

    Args:
      probs: [n, k] non-negative, finite, each row with a positive sum (rows are normalised).
      capacity: c >= 1, slots per expert.

    Returns:
      (experts [n] int64; kept [n] bool, delta_i; weights [n] in probs' dtype,
       delta_i * n_{z_i} / min(n_{z_i}, c): E[weights_i | z] = 1, and the kept weights of expert j
       sum to n_j). Dropped tokens are reported by `kept`, never silently lost.
    """
    _validate.tensor("probs", probs, dim=2, shape="[n, k]", dtypes=SCORE_DTYPES)
    if probs.shape[1] < 1:
        raise ValueError(f"probs must be [n, k] with k >= 1, got shape {tuple(probs.shape)}")
    _validate.integer("capacity", capacity, low=1)
    if probs.shape[0] and not bool(((probs >= 0) & torch.isfinite(probs)).all() and (probs.sum(1) > 0).all()):
        raise ValueError("probs must be finite and non-negative with a positive sum in every row")
    with torch.no_grad():
        return backends.implementation("skip_sample", probs)(probs.detach(), capacity, generator)
