"""Gates: nn.Modules that map tokens to a moe_kernels.routing.Routing."""

from moe_kernels.gates.balanced_assignment import BalancedAssignmentGate  # noqa: F401
from moe_kernels.gates.sinkhorn import SinkhornGate  # noqa: F401
