"""The public ops. Each validates its arguments and asks moe_kernels.backends for a kernel."""

from moe_kernels.ops.batchwise_mask import batchwise_mask, threshold_mask
from moe_kernels.ops.capacity_positions import capacity_for, capacity_positions
from moe_kernels.ops.combine import combine
from moe_kernels.ops.dispatch import dispatch
from moe_kernels.ops.permute import permute, unpermute
from moe_kernels.ops.topk_softmax import topk_softmax

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

from moe_kernels.ops.dselect_k import dselect_k  # noqa: E402
from moe_kernels.ops.smooth_step import smooth_step  # noqa: E402

__all__ += ["dselect_k", "smooth_step"]
