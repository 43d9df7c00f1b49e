"""moe_kernels.ops.sinkhorn: log-domain Sinkhorn balancing of a routing matrix (Kool et al.,
Section 2.3). Implementations: reference (moe_kernels/reference/sinkhorn.py), C++ CPU
(csrc/cpu/sinkhorn.cpp). backends.py chooses among them.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _validate
from moe_kernels.ops.balanced_assignment import SCORE_DTYPES

_cpp = None
if backends._extension.defines("sinkhorn"):
    _cpp = torch.ops.moe_kernels.sinkhorn

    @torch.library.register_fake("moe_kernels::sinkhorn")
    def _fake(logits, num_iters, tol):
        return torch.empty_like(logits, memory_format=torch.contiguous_format), logits.new_empty(
            (2,), dtype=torch.float64
        )


backends.register("sinkhorn", torch=reference.sinkhorn, cpu=_cpp)


def sinkhorn(logits: torch.Tensor, num_iters: int = 100, tol: float = 1e-4, *, return_error: bool = False):
    """The balanced row-stochastic matrix p~ of Section 2.3: rows sum to 1, columns to n / k.

    Args:
      logits: [n, k] float64 / float32 / float16 / bfloat16 (log p, or logits: a per-row shift
        changes nothing). -inf is a forbidden (token, expert) pair; +inf / NaN propagate.
      num_iters: at most this many (row, column) iterations, >= 1.
      tol: stop when every column sum is within a factor 1 +- tol of n / k.

    Returns:
      probs [n, k] in the logits' dtype (computed in float64 for float64, else float32), rows
      summing to 1 exactly (up to rounding); with return_error also the final max relative column
      error (a float; > tol means num_iters was not enough). Not differentiable: the estimators
      use it as a constant proposal.
    """
    _validate.tensor("logits", logits, dim=2, shape="[n, k]", dtypes=SCORE_DTYPES)
    if logits.shape[1] < 1:
        raise ValueError(f"logits must be [n, k] with k >= 1, got shape {tuple(logits.shape)}")
    _validate.integer("num_iters", num_iters, low=1)
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")
    with torch.no_grad():
        probs, info = backends.implementation("sinkhorn", logits)(logits.detach(), num_iters, float(tol))
    return (probs, float(info[1])) if return_error else probs
