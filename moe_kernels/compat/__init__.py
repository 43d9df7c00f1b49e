"""Drop-in adapters: other libraries' routing functions, with their own signatures, defaults and
return values, computed with our ops.

- `moe_kernels.compat.deepspeed`: DeepSpeed's `top1gating`, `top2gating`, `topkgating`.
- `moe_kernels.compat.megatron`: Megatron-Core's `topk_routing_with_score_function`,
  `apply_router_token_dropping`, `get_capacity`, `topk_softmax_with_capacity`.
- `moe_kernels.compat.torchtitan`: torchtitan's `TokenChoiceTopKRouter`.

`deepspeed_gating` and `megatron_routing` are this package's earlier, simplified readings, kept
for code written against them. docs/compat.md says what matches each library exactly and what
differs (tie order), and the commit each was checked against.
"""

from moe_kernels.compat._legacy import deepspeed_gating, megatron_routing
from moe_kernels.compat.deepspeed import top1gating, top2gating, topkgating
from moe_kernels.compat.megatron import (
    apply_router_token_dropping,
    get_capacity,
    topk_routing_with_score_function,
    topk_softmax_with_capacity,
)
from moe_kernels.compat.torchtitan import TokenChoiceTopKRouter

__all__ = [
    "deepspeed_gating",
    "megatron_routing",
    "top1gating",
    "top2gating",
    "topkgating",
    "apply_router_token_dropping",
    "get_capacity",
    "topk_routing_with_score_function",
    "topk_softmax_with_capacity",
    "TokenChoiceTopKRouter",
]
