"""`make demo`: a capacity-limited MoE routing step on this machine's backends, batch after batch,
with a progress bar:

    topk_softmax -> capacity_positions -> dispatch -> experts (one linear map each) -> combine

checked against moe_kernels.reference on every batch, then a report of which backend each op used,
each op's throughput, and what capacity did to the tokens (drops are counted, never silent).
Then every gate (top-k, noisy top-k, batchwise, DSelect-k, balanced assignment, Sinkhorn) is
trained inside the MoE layer on a small task (examples/demo_layers.py).

    .venv/bin/python examples/demo.py [--batches 30] [--tokens 4096] [--experts 64] [--k 2]
                                      [--d-model 256] [--capacity-factor 1.0] [--threads N]
"""

import argparse
import time
from collections import defaultdict

import torch
from demo_layers import train_gates  # examples/ is on sys.path when this file runs as a script
from tqdm import tqdm

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import capacity_for, capacity_positions, combine, dispatch, topk_softmax

ROUTING_OPS = ("topk_softmax", "capacity_positions", "dispatch", "combine")
# The registered op behind each step (backends() lists ops; topk_softmax is topk_router's function).
REGISTERED = {"topk_softmax": "topk_router"}


def route(ops, x, logits, experts_weight, k, capacity):
    """One routing step with the given op set; returns the output, the routing and each op's time."""
    seconds = {}
    t0 = time.perf_counter()
    weights, experts = ops["topk_softmax"](logits, k)
    t1 = time.perf_counter()
    positions, counts = ops["capacity_positions"](experts, logits.shape[1], capacity)
    t2 = time.perf_counter()
    buffer = ops["dispatch"](x, experts, positions, logits.shape[1], capacity)
    t3 = time.perf_counter()
    expert_out = torch.bmm(buffer, experts_weight)  # [E, C, d] @ [E, d, d]
    t4 = time.perf_counter()
    y = ops["combine"](expert_out, experts, positions, weights)
    t5 = time.perf_counter()
    seconds.update(topk_softmax=t1 - t0, capacity_positions=t2 - t1, dispatch=t3 - t2, experts=t4 - t3, combine=t5 - t4)
    return y, experts, positions, counts, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:  # on a busy machine, fewer threads than cores avoids waiting at every fork/join
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    T, E, k, d = args.tokens, args.experts, args.k, args.d_model
    C = capacity_for(T, E, k, args.capacity_factor)

    print("moe_kernels", moe_kernels.__version__, "| torch", torch.__version__, "| threads", torch.get_num_threads())
    print("backend per op (CPU tensors / CUDA tensors):")
    for op, row in moe_kernels.backends().items():
        f64 = row["cpu float64"]
        note = f" (float64: {f64})" if f64 != row["cpu"] else ""
        print(f"  {op:<24} cpu: {row['cpu'] + note:<25} cuda: {row['cuda']}")
    print(f"routing {T} tokens per batch to {k} of {E} experts, capacity factor {args.capacity_factor}: C = {C} slots")

    kernels = {
        "topk_softmax": topk_softmax,
        "capacity_positions": capacity_positions,
        "dispatch": dispatch,
        "combine": combine,
    }
    references = {op: getattr(reference, op) for op in ROUTING_OPS}
    # A skewed router (a few popular experts), so that capacity has something to drop.
    router = torch.nn.Linear(d, E, bias=False)
    with torch.no_grad():
        router.weight[: max(1, E // 8)] *= 1.5
    experts_weight = torch.randn(E, d, d) / d**0.5
    kernel_s, reference_s = defaultdict(float), defaultdict(float)
    load = torch.zeros(E, dtype=torch.int64)
    kept = dropped = empty = all_dropped_tokens = mismatches = 0
    max_error = 0.0
    for _ in tqdm(range(args.batches), desc="routing batches", unit="batch"):
        x = torch.randn(T, d)
        with torch.no_grad():
            logits = router(x)
            y, experts, positions, counts, seconds = route(kernels, x, logits, experts_weight, k, C)
            y_ref, experts_ref, positions_ref, counts_ref, seconds_ref = route(
                references, x, logits, experts_weight, k, C
            )
        for op in seconds:
            kernel_s[op] += seconds[op]
            reference_s[op] += seconds_ref[op]
        mismatches += int((experts != experts_ref).sum() + (positions != positions_ref).sum())
        mismatches += int((counts != counts_ref).sum())
        max_error = max(max_error, (y - y_ref).abs().max().item())
        load += counts
        is_kept, is_empty = positions >= 0, experts < 0
        kept += int(is_kept.sum())
        empty += int(is_empty.sum())
        dropped += int((~is_kept & ~is_empty).sum())
        all_dropped_tokens += int((~is_kept).all(1).sum())

    tokens = args.batches * T
    choices = tokens * k
    print(f"\nrouted {tokens} tokens ({choices} choices)")
    print(
        f"  kept {kept} ({kept / choices:.2%}), dropped by capacity {dropped} ({dropped / choices:.2%}), "
        f"empty {empty}; kept + dropped + empty = {kept + dropped + empty} (must be {choices})"
    )
    print(f"  tokens that lost every choice (output 0, carried by the residual): {all_dropped_tokens}")
    frac = load.float() / load.sum()
    print(f"  load per expert before dropping: max/mean {frac.max() * E:.2f}, min/mean {frac.min() * E:.2f}")
    print("  per op (tokens/s; speed-up over the reference):")
    for op in (*ROUTING_OPS, "experts"):
        backend = moe_kernels.backends()[REGISTERED.get(op, op)]["cpu"] if op in ROUTING_OPS else "torch.bmm"
        rate = tokens / kernel_s[op] / 1e6
        speedup = f"{reference_s[op] / kernel_s[op]:5.1f}x" if op in ROUTING_OPS else "   - "
        print(f"    {op:<20} {backend:<10} {rate:8.1f} M tokens/s  {speedup}")
    routing = sum(kernel_s[op] for op in ROUTING_OPS)
    routing_ref = sum(reference_s[op] for op in ROUTING_OPS)
    print(
        f"  routing ops together: {tokens / routing / 1e6:.1f} M tokens/s, {routing_ref / routing:.1f}x the reference"
    )
    print(f"  routing differing from the reference: {mismatches} (must be 0); max |y - y_ref| = {max_error:.2e}")
    if mismatches or kept + dropped + empty != choices or max_error > 1e-4:
        raise SystemExit("kernels and reference disagree")

    print()
    train_gates()  # part two: every gate trained inside the MoE layer (examples/demo_layers.py)


if __name__ == "__main__":
    main()
