"""Layers: Routing -> dispatch -> experts -> combine."""

from moe_kernels.layers.hierarchical import HierarchicalMoE  # noqa: F401
from moe_kernels.layers.moe import MoE  # noqa: F401
