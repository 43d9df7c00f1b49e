"""Train a small MoE layer with its experts spread over processes (gloo on CPU), printing per-rank
tokens/s and the share of each step spent in the token exchange.

    torchrun --nproc_per_node 2 examples/expert_parallel.py [--steps 60] [--tokens 2048] [--dropless]
    .venv/bin/python examples/expert_parallel.py          # the same model in one process (W = 1)

The task: fit a fixed random "teacher" MoE (same shapes, different weights) on Gaussian inputs.
Every rank builds the full model from the same seed, keeps its E/W experts (shard_experts) and a
replica of the gate; each rank draws its own share of the global batch. The gate's gradients are
summed over ranks (sync_replicated_grads); the experts' gradients are already complete on their
owner. At the end the full expert weights are gathered (gather_experts) as for a checkpoint.
"""

import argparse
import datetime
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_kernels.ops import topk_softmax
from moe_kernels.parallel import (
    ExchangeClock,
    expert_parallel_moe,
    gather_experts,
    shard_experts,
    sync_replicated_grads,
)
from moe_kernels.routing import Routing


def switch_balance_loss(logits, experts, num_experts):
    """Switch Transformer load balancing (eq. 4 of Fedus et al.): E * sum_e f_e * P_e, over this
    rank's tokens (each rank balances its own batch)."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    fraction = torch.bincount(experts[:, 0], minlength=num_experts).to(logits.dtype) / logits.shape[0]
    return num_experts * (fraction * torch.softmax(logits, -1).mean(0)).sum()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=2048, help="global batch (split over the ranks)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--d-hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--dropless", action="store_true", help="dropless mode (permute + split-size all-to-all)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (torchrun's default)")
    args = parser.parse_args()

    group = None
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        group = dist.group.WORLD
    rank = dist.get_rank() if group else 0
    world = dist.get_world_size() if group else 1
    torch.set_num_threads(args.threads)

    d, h, E, k = args.d_model, args.d_hidden, args.experts, args.k
    g = torch.Generator().manual_seed(0)  # the same full model and teacher on every rank
    gate = (torch.randn(d, E, generator=g) / math.sqrt(d)).requires_grad_()
    w1 = shard_experts(torch.randn(E, d, h, generator=g) / math.sqrt(d), group).requires_grad_()
    w2 = shard_experts(torch.randn(E, h, d, generator=g) / math.sqrt(h), group).requires_grad_()
    teacher = [torch.randn(d, E, generator=g), torch.randn(E, d, h, generator=g) / math.sqrt(d),
               torch.randn(E, h, d, generator=g) / math.sqrt(h)]  # fmt: skip
    optimizer = torch.optim.Adam([gate, w1, w2], lr=args.lr)

    local_tokens = args.tokens // world + (1 if rank < args.tokens % world else 0)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own share of the batch
    opts = {"dropless": True} if args.dropless else {"capacity_factor": args.capacity_factor}
    if rank == 0:
        mode = "dropless" if args.dropless else f"capacity factor {args.capacity_factor}"
        print(f"W={world} ranks, E={E} experts ({E // world} per rank), k={k}, {mode}, global batch {args.tokens}")

    step_seconds, tokens_done, exchange_seconds, dropped = 0.0, 0, 0.0, 0
    for step in range(args.steps):
        x = torch.randn(local_tokens, d, generator=data)
        with torch.no_grad():  # the teacher: the same MoE computed densely, single process
            tw, te = topk_softmax(x @ teacher[0], k)
            every = torch.einsum("teh,ehd->ted", F.gelu(torch.einsum("td,edh->teh", x, teacher[1])), teacher[2])
            target = (every.gather(1, te.unsqueeze(-1).expand(-1, -1, d)) * tw.unsqueeze(-1)).sum(1)

        start = time.perf_counter()
        ExchangeClock.reset()
        logits = x @ gate
        weights, experts = topk_softmax(logits, k)
        routing = Routing(experts=experts, weights=weights, num_experts=E, aux_loss=logits.new_zeros(()))
        y, stats = expert_parallel_moe(x, routing, w1, w2, group, **opts)
        # each rank's share of the global mean, so summed gradients are the global loss's
        loss = ((y - target) ** 2).sum() / (args.tokens * d)
        loss = loss + 0.01 * switch_balance_loss(logits, experts, E) / world
        optimizer.zero_grad()
        loss.backward()
        sync_replicated_grads([gate], group)
        optimizer.step()
        if step >= 3:  # skip warm-up
            step_seconds += time.perf_counter() - start
            exchange_seconds += ExchangeClock.seconds
            tokens_done += local_tokens
        dropped += int(stats["dropped"])

        if step % 20 == 0 or step == args.steps - 1:
            total = loss.detach().clone()
            if group:
                dist.all_reduce(total, group=group)
            if rank == 0:
                print(f"step {step:4d}  loss {float(total):.5f}", flush=True)

    rate = tokens_done / step_seconds if step_seconds else float("nan")
    share = exchange_seconds / step_seconds if step_seconds else float("nan")
    line = (
        f"rank {rank}: {rate:,.0f} tokens/s, {100 * share:.1f}% of step time in the exchange "
        f"(all-to-alls + their agreement collective, incl. waiting for peers), {dropped} choices dropped"
    )
    if group:  # print in rank order
        lines = [None] * world
        dist.all_gather_object(lines, line, group=group)
        line = "\n".join(lines)
    full = {"w1": gather_experts(w1, group), "w2": gather_experts(w2, group)}  # a checkpoint, on every rank
    if rank == 0:
        print(line)
        print(f"gathered checkpoint: w1 {tuple(full['w1'].shape)}, w2 {tuple(full['w2'].shape)}")
    if group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
