"""Gates: nn.Modules that map tokens to a moe_kernels.routing.Routing."""

from moe_kernels.gates.batchwise import BatchwiseGate  # noqa: F401
from moe_kernels.gates.dselect_k import DSelectKGate  # noqa: F401
from moe_kernels.gates.sparse_mask import sparse_gates  # noqa: F401
