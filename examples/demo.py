"""`make demo`: route a stream of token batches through moe_kernels' ops on this machine's
backends, with a progress bar, and print which backend each op used and what routing did.

    .venv/bin/python examples/demo.py [--batches 40] [--tokens 8192] [--experts 64] [--k 2]
"""

import argparse
import time

import torch
from tqdm import tqdm

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import topk_softmax


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)

    print("moe_kernels", moe_kernels.__version__, "| torch", torch.__version__, "| threads", torch.get_num_threads())
    print("backend per op (CPU tensors / CUDA tensors):")
    for op, row in moe_kernels.backends().items():
        print(f"  {op:<24} cpu: {row['cpu']:<8} cuda: {row['cuda']}")

    router = torch.nn.Linear(args.d_model, args.experts, bias=False)
    load = torch.zeros(args.experts, dtype=torch.int64)
    kernel_s = reference_s = 0.0
    mismatches = 0
    for _ in tqdm(range(args.batches), desc="routing batches", unit="batch"):
        x = torch.randn(args.tokens, args.d_model)
        with torch.no_grad():
            logits = router(x)
            t0 = time.perf_counter()
            weights, experts = topk_softmax(logits, args.k)
            t1 = time.perf_counter()
            ref_weights, ref_experts = reference.topk_softmax(logits, args.k)
            t2 = time.perf_counter()
        kernel_s += t1 - t0
        reference_s += t2 - t1
        mismatches += int((experts != ref_experts).sum())
        load += torch.bincount(experts.flatten(), minlength=args.experts)

    tokens = args.batches * args.tokens
    print(f"\nrouted {tokens} tokens to {args.k} of {args.experts} experts")
    print(
        f"  topk_softmax: {tokens / kernel_s / 1e6:.1f} M tokens/s "
        f"({moe_kernels.backends()['topk_softmax']['cpu']}), reference {tokens / reference_s / 1e6:.1f} M tokens/s, "
        f"speed-up {reference_s / kernel_s:.1f}x"
    )
    print(f"  expert choices differing from the reference: {mismatches} (must be 0)")
    frac = load.float() / load.sum()
    print(
        f"  load per expert: min {frac.min():.4f} max {frac.max():.4f} (uniform {1 / args.experts:.4f}), "
        f"max/mean {frac.max() * args.experts:.2f}"
    )
    if mismatches:
        raise SystemExit("kernel and reference disagree")


if __name__ == "__main__":
    main()
