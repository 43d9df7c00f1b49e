"""Gates: nn.Modules that map tokens to a moe_kernels.routing.Routing."""

from moe_kernels.gates.dselect_k import DSelectKGate  # noqa: F401
