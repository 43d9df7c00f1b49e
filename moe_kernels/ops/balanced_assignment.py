"""moe_kernels.ops.balanced_assignment: exact capacity-constrained token-to-expert assignment.

Implementations: reference (moe_kernels/reference/balanced_assignment.py), C++ CPU
(csrc/cpu/balanced_assignment.cpp, the fast path here) and CUDA (csrc/cuda/balanced_assignment.cu,
host-emulated by a test, run on an H100 and an H200 by make gpu-check: docs/balanced_assignment.md).
No Triton kernel. backends.py chooses among them.
"""

import math

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _validate

SCORE_DTYPES = (torch.float64, *_validate.ROUTING_DTYPES)

_cpp = None
if backends._extension.defines("balanced_assignment"):
    _cpp = torch.ops.moe_kernels.balanced_assignment

    @torch.library.register_fake("moe_kernels::balanced_assignment")
    def _fake(scores, capacity):
        n, k = scores.shape
        return (
            scores.new_empty((n,), dtype=torch.int64),
            scores.new_empty((), dtype=torch.float64),
            scores.new_empty((k, k), dtype=torch.float64),
        )


# CUDA tensors take the CUDA solver by default. It passed its GPU cases on an H100 and an H200, and
# on the H200 (bench/results/gpu-nvidia-h200.md, 2026-11-29) it solved (8192, 64) in 10.8 ms and
# (16384, 128) in 19.6 ms, exact, where the reference (the default until then) runs its auction in
# Python, a few tensor ops a bid: 0.47 s at (8192, 64) on this project's CPU, and each op a kernel
# launch and host reads on a GPU. The CPU solver on 16 cores was faster still (4.0 and 14.9 ms),
# and far faster on all-equal scores at (8192, 64), where the CUDA solver took 656 ms (issue 33).
# It rejects NaN / inf itself, inside the op (csrc/cuda_ops.cpp).
backends.register(
    "balanced_assignment",
    torch=reference.balanced_assignment,
    cpu=_cpp,
    cuda=_cpp,
)


def check_scores(name: str, scores, capacity, *, check_finite: bool = False):
    """Validate [n, k] scores and the capacity; returns the capacity (default ceil(n / k)).

    Reads no tensor value unless check_finite (a host sync): the solvers reject NaN / inf
    themselves, so balanced_assignment compiles without a graph break.
    """
    _validate.tensor(name, scores, dim=2, shape="[n, k]", dtypes=SCORE_DTYPES)
    n, k = scores.shape
    if k < 1:
        raise ValueError(f"{name} must be [n, k] with k >= 1 experts, got shape {tuple(scores.shape)}")
    if capacity is None:
        capacity = max(1, math.ceil(n / k))
    _validate.integer("capacity", capacity, low=1)
    if capacity * k < n:
        raise ValueError(f"capacity * k must be >= n (every token needs a slot), got {capacity} * {k} < {n}")
    if check_finite and n and not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf)")
    # More than n slots per expert constrain nothing more than n do; the kernels then never see
    # a capacity whose products overflow int64 (e.g. capacity = 2**62).
    return min(capacity, max(n, 1))


def balanced_assignment(scores: torch.Tensor, capacity: int | None = None, *, return_distances: bool = False):
    """The assignment of n tokens to k experts, at most `capacity` per expert, that maximises
    sum_i scores[i, experts[i]] (eq 4 of Kool et al. with scores = a / tau + g; BASE layers).

    Args:
      scores: [n, k] float64 / float32 / float16 / bfloat16, finite: NaN / inf raise ValueError
        from the solver (no host sync here, so torch.compile(fullgraph=True) works on the C++
        and CUDA backends). Adding a constant to a row changes nothing, so log-probabilities and logits give
        the same assignment.
      capacity: slots per expert, capacity * k >= n. Default ceil(n / k) (exactly n / k tokens per
        expert when k divides n).
      return_distances: also return the optimal value and d*.

    Returns:
      experts [n] int64; with return_distances, (experts, value, distances): value a 0-dim float64,
      sum_i scores[i, experts[i]]; distances [k, k] float64, d*[j, j'] = the cheapest total score
      lost by moving one token out of expert j and into j' through a chain of moves (a chain may
      also end in a free slot when capacity * k > n), at the optimum; d*[j, j] = 0; +inf where no
      chain exists. Appendix D.3: forcing token i into expert j costs s[i, z_i] - s[i, j] + d*[j, z_i].

    Exactly optimal (cycle cancelling stops only when no improving cycle of moves is left, up to
    float64 rounding). On ties any optimal assignment may be returned; each backend is deterministic.
    Not differentiable (an argmax).
    """
    # Every backend rejects NaN / inf itself (no host read here, so torch.compile(fullgraph=True)
    # works on the C++ and CUDA kernels): the CPU kernel and the reference in their pass, the CUDA op before its
    # solve.
    capacity = check_scores("scores", scores, capacity)
    if not isinstance(return_distances, bool):
        raise TypeError(f"return_distances must be a bool, got {type(return_distances).__name__}")
    experts, value, distances = backends.implementation("balanced_assignment", scores)(scores, capacity)
    return (experts, value, distances) if return_distances else experts
