"""Gates: nn.Modules that map tokens to a moe_kernels.routing.Routing (one class per file)."""

from moe_kernels.gates.aux_loss_free import AuxLossFreeGate, update_selection_bias
from moe_kernels.gates.balanced_assignment import BalancedAssignmentGate
from moe_kernels.gates.batchwise import BatchwiseGate
from moe_kernels.gates.dselect_k import DSelectKGate
from moe_kernels.gates.noisy_topk import NoisyTopKGate
from moe_kernels.gates.sinkhorn import SinkhornGate
from moe_kernels.gates.sparse_mask import sparse_gates
from moe_kernels.gates.topk import TopKGate

__all__ = [
    "AuxLossFreeGate",
    "update_selection_bias",
    "BalancedAssignmentGate",
    "DSelectKGate",
    "SinkhornGate",
    "NoisyTopKGate",
    "TopKGate",
    "BatchwiseGate",
    "sparse_gates",
]
