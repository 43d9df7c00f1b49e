"""The public ops. Each validates its arguments and asks moe_kernels.backends for a kernel."""

from moe_kernels.ops.balanced_assignment import balanced_assignment
from moe_kernels.ops.batchwise_mask import batchwise_mask, threshold_mask
from moe_kernels.ops.capacity_positions import capacity_for, capacity_positions
from moe_kernels.ops.combine import combine
from moe_kernels.ops.dispatch import dispatch
from moe_kernels.ops.dselect_k import dselect_k
from moe_kernels.ops.gumbel_matching import gumbel_matching
from moe_kernels.ops.load_probabilities import load_probabilities
from moe_kernels.ops.noisy_topk_gate import noisy_topk_gate
from moe_kernels.ops.permute import permute, unpermute
from moe_kernels.ops.sinkhorn import sinkhorn
from moe_kernels.ops.skip_sample import skip_sample
from moe_kernels.ops.smooth_step import smooth_step
from moe_kernels.ops.topk_router import topk_router
from moe_kernels.ops.topk_softmax import topk_softmax

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
