"""moe_kernels: kernel-backed routing for Mixture-of-Experts models in PyTorch.

`moe_kernels.backends()` says which implementation each op uses; `moe_kernels.use_backend(name)`
forces one for a block of code.
"""

from moe_kernels import backends, ops, reference
from moe_kernels.backends import use_backend
from moe_kernels.gates import NoisyTopKGate, TopKGate
from moe_kernels.layers import HierarchicalMoE, MoE

__all__ = ["backends", "ops", "reference", "use_backend"]
__all__ += ["NoisyTopKGate", "TopKGate", "MoE", "HierarchicalMoE"]
__version__ = "0.1.0"
