"""Gates: nn.Modules that map tokens to a moe_kernels.routing.Routing."""

from moe_kernels.gates.noisy_topk import NoisyTopKGate  # noqa: F401
from moe_kernels.gates.topk import TopKGate  # noqa: F401
