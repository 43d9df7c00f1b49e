"""moe_kernels.ops.capacity_positions: the slot of every (token, choice) in its expert's buffer.

Implementations: reference (moe_kernels/reference/capacity_positions.py), C++ CPU
(csrc/cpu/capacity_positions.cpp), Triton (moe_kernels/triton/capacity_positions.py), CUDA
(csrc/cuda/capacity_positions.cu, registered in csrc/cuda_ops.cpp: segments of the fill order, ranked
32 choices at a time; the default order's [128, k] tiles through shared memory where 2 <= k <= 16 and
k E <= 8192, else a warp a segment: docs/dispatch.md). backends.py chooses among them.
"""

import math

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _validate
from moe_kernels.reference.capacity_positions import capacity_for as _capacity_for

_cpp = None
if backends._extension.defines("capacity_positions"):

    @torch.library.register_fake("moe_kernels::capacity_positions")
    def _fake(experts, num_experts, capacity, priority=None):
        return experts.new_empty(experts.shape), experts.new_empty(num_experts)

    def _cpp(experts, num_experts, capacity, *, priority=None):
        return torch.ops.moe_kernels.capacity_positions(experts, num_experts, capacity, priority)


_triton = None
if backends.triton_importable():
    from moe_kernels.triton import capacity_positions as _triton_module

    def _triton(experts, num_experts, capacity, *, priority=None):
        return _triton_module.capacity_positions(experts, num_experts, capacity, priority)


# The extension op is one schema with a CPU and (CUDA builds) a CUDA kernel: `_cpp` serves both
# backends; backends.py uses each only where the extension registered that device's kernel.
backends.register("capacity_positions", torch=reference.capacity_positions, cpu=_cpp, triton=_triton, cuda=_cpp)

__all__ = ["capacity_for", "capacity_positions"]


def capacity_for(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int = 0) -> int:
    """max(min_capacity, ceil(capacity_factor * T * k / E)): the GShard / Switch capacity.

    num_tokens T >= 0, num_experts E >= 1, k >= 1 (ints); capacity_factor a finite real > 0;
    min_capacity >= 0.
    """
    _validate.integer("num_tokens", num_tokens, low=0)
    _validate.integer("num_experts", num_experts, low=1)
    _validate.integer("k", k, low=1)
    _validate.integer("min_capacity", min_capacity, low=0)
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, int | float):
        raise TypeError(f"capacity_factor must be a float, got {type(capacity_factor).__name__}")
    if not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor}")
    return _capacity_for(num_tokens, num_experts, k, capacity_factor, min_capacity)


def capacity_positions(experts: torch.Tensor, num_experts: int, capacity: int, *, priority=None):
    """Assign each choice a slot in its expert's buffer of `capacity` slots; overflow is dropped.

    Args:
      experts: [T, k] int64 expert of each choice, -1 = empty choice (e.g. from topk_softmax).
      num_experts: E >= 1.
      capacity: C >= 0 slots per expert (a Python int: no host sync; see capacity_for).
      priority: optional [T, k] float. Default order (GShard / Switch): every token's first
        choice before any second choice, by token index within a choice. With priority: by
        descending priority, ties in the default order (Megatron's "probs" policy; batch
        prioritised routing of V-MoE is priority = max_gate[t] - 2 * s). Priorities are
        compared as float32 on every backend and in the reference: float64 priorities that
        round to the same float32 tie (the fill order's key is a float32 rank key and a
        32-bit index in one int64).

    Returns:
      positions: [T, k] int64 slot in [0, C), -1 if the choice is empty or overflowed.
      counts: [E] int64 choices routed to each expert before dropping. Dropped choices =
        (positions < 0) & (experts >= 0); per expert, max(counts - C, 0).
    """
    _validate.integer("num_experts", num_experts, low=1)
    _validate.integer("capacity", capacity, low=0)
    _validate.routing_indices("experts", experts)
    if priority is not None:
        _validate.tensor("priority", priority, dim=2, shape="[T, k]", dtypes=_validate.FLOAT_DTYPES)
        if priority.shape != experts.shape:
            raise ValueError(f"priority must be [T, k] = {list(experts.shape)}, got {tuple(priority.shape)}")
    _validate.same_device(experts=experts, priority=priority)
    if _validate.host_readable("capacity_positions", experts):
        _validate.index_range("experts", experts, num_experts)
    kernel = backends.implementation("capacity_positions", experts, size=num_experts)
    return kernel(experts, num_experts, capacity, priority=priority)
