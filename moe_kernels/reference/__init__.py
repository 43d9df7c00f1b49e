"""Readable PyTorch implementations of every op: the specification (loops are fine here)."""

from moe_kernels.reference.balanced_assignment import balanced_assignment
from moe_kernels.reference.batchwise_mask import batchwise_mask, threshold_mask
from moe_kernels.reference.capacity_positions import capacity_for, capacity_positions
from moe_kernels.reference.combine import combine
from moe_kernels.reference.dispatch import dispatch
from moe_kernels.reference.dselect_k import dselect_k
from moe_kernels.reference.gumbel_matching import gumbel_matching
from moe_kernels.reference.load_probabilities import load_probabilities
from moe_kernels.reference.noisy_topk_gate import noisy_topk_gate
from moe_kernels.reference.permute import permute, unpermute
from moe_kernels.reference.sinkhorn import sinkhorn
from moe_kernels.reference.skip_sample import skip_sample
from moe_kernels.reference.smooth_step import smooth_step
from moe_kernels.reference.topk_router import topk_router
from moe_kernels.reference.topk_softmax import topk_softmax

__all__ = [
    "balanced_assignment",
    "capacity_for",
    "capacity_positions",
    "combine",
    "dispatch",
    "dselect_k",
    "gumbel_matching",
    "permute",
    "sinkhorn",
    "skip_sample",
    "smooth_step",
    "topk_softmax",
    "topk_router",
    "unpermute",
    "load_probabilities",
    "noisy_topk_gate",
    "batchwise_mask",
    "threshold_mask",
]
