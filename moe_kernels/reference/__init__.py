"""Readable PyTorch implementations of every op: the specification (loops are fine here)."""

from moe_kernels.reference.batchwise_mask import batchwise_mask, threshold_mask
from moe_kernels.reference.topk_softmax import topk_softmax

__all__ = ["topk_softmax", "batchwise_mask", "threshold_mask"]
