"""moe_kernels.ops.combine: gather expert outputs back to their tokens, weighted.

Implementations: reference (moe_kernels/reference/combine.py); kernels per backend as they land.
"""

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _validate

backends.register("combine", torch=reference.combine)


def combine(buffer: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor):
    """y [T, d] = sum over kept choices s of weights[t, s] * buffer[experts[t, s], positions[t, s]].

    Args:
      buffer: [E, C, d] expert outputs, float32 / float16 / bfloat16 / float64.
      experts, positions: [T, k] int64 from capacity_positions.
      weights: [T, k] float gate values.
    Dropped (positions -1) and empty choices add nothing: a token whose choices were all dropped
    gets y = 0 (the caller's residual carries it). Accumulated in float32; y in buffer's dtype.
    Deterministic (no atomics). Differentiable with respect to buffer and weights.
    """
    _validate.tensor("buffer", buffer, dim=3, shape="[E, C, d]", dtypes=_validate.FLOAT_DTYPES)
    E, C, _ = buffer.shape
    _validate.routing_indices("experts", experts, high=E)
    _validate.routing_indices("positions", positions, shape=experts.shape, high=max(C, 1))
    _validate.tensor("weights", weights, dim=2, shape="[T, k]", dtypes=_validate.FLOAT_DTYPES)
    if weights.shape != experts.shape:
        raise ValueError(f"weights must be [T, k] = {list(experts.shape)}, got {tuple(weights.shape)}")
    return backends.implementation("combine", buffer)(buffer, experts, positions, weights)
