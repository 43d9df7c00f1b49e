"""Readable PyTorch implementations of every op: the specification (loops are fine here)."""

from moe_kernels.reference.batchwise_mask import batchwise_mask, threshold_mask
from moe_kernels.reference.capacity_positions import capacity_for, capacity_positions
from moe_kernels.reference.combine import combine
from moe_kernels.reference.dispatch import dispatch
from moe_kernels.reference.permute import permute, unpermute
from moe_kernels.reference.topk_softmax import topk_softmax

__all__ = [
    "capacity_for",
    "capacity_positions",
    "combine",
    "dispatch",
    "permute",
    "topk_softmax",
    "unpermute",
    "batchwise_mask",
    "threshold_mask",
]

from moe_kernels.reference.dselect_k import dselect_k  # noqa: E402
from moe_kernels.reference.smooth_step import smooth_step  # noqa: E402

__all__ += ["dselect_k", "smooth_step"]
