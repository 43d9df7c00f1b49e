"""The public ops. Each validates its arguments and asks moe_kernels.backends for a kernel."""

from moe_kernels.ops.batchwise_mask import batchwise_mask, threshold_mask
from moe_kernels.ops.topk_softmax import topk_softmax

__all__ = ["topk_softmax", "batchwise_mask", "threshold_mask"]
