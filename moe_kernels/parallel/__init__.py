"""Expert parallelism over torch.distributed (docs/expert_parallel.md): the experts are spread over
the ranks of a process group and tokens travel to them by all-to-all.

exchange.py         the all_to_all autograd Functions, capacity agreement, error propagation
expert_parallel.py  one expert-parallel MoE step (capacity or dropless mode)
global_routing.py   gates solved over the global batch (all-gathered scores)
sharding.py         expert weights / state dicts between [E, ...] and [E/W, ...]
"""

from moe_kernels.parallel.exchange import (
    ExchangeClock,
    RemoteRankError,
    agree_capacity,
    all_to_all,
    exchange_counts,
    local_experts,
    return_capacity,
    send_capacity,
)
from moe_kernels.parallel.expert_parallel import (
    LocalFFN,
    expert_ffn,
    expert_parallel_moe,
    expert_parallel_route,
)
from moe_kernels.parallel.global_routing import all_gather_rows, batch_offsets, local_routing, route_global_batch
from moe_kernels.parallel.sharding import (
    gather_experts,
    gather_state_dict,
    shard_experts,
    shard_state_dict,
    sync_replicated_grads,
)

__all__ = [
    "ExchangeClock",
    "LocalFFN",
    "RemoteRankError",
    "agree_capacity",
    "all_gather_rows",
    "all_to_all",
    "batch_offsets",
    "exchange_counts",
    "expert_ffn",
    "expert_parallel_moe",
    "expert_parallel_route",
    "gather_experts",
    "gather_state_dict",
    "local_experts",
    "local_routing",
    "return_capacity",
    "route_global_batch",
    "send_capacity",
    "shard_experts",
    "shard_state_dict",
    "sync_replicated_grads",
]
