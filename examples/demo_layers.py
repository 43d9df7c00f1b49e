"""Second half of `make demo`: every gate of moe_kernels trained inside the MoE layer on a small
clustered regression task, with a progress bar, reporting what each gate did to the load.

The task: tokens x in R^d come from `experts` Gaussian clusters; the target of cluster c is a fixed
random linear map W_c x. A MoE whose gate learns to send each cluster to one expert can fit it.

    .venv/bin/python examples/demo_layers.py [--steps 60] [--tokens 512]
"""

import argparse

import torch
from tqdm import tqdm

import moe_kernels
from moe_kernels.gates import (
    BalancedAssignmentGate,
    BatchwiseGate,
    DSelectKGate,
    NoisyTopKGate,
    SinkhornGate,
    TopKGate,
)


def make_task(d: int, num_clusters: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_clusters, d, generator=g) * 3
    maps = torch.randn(num_clusters, d, d, generator=g) / d**0.5

    def batch(T: int, step: int):
        gb = torch.Generator().manual_seed(seed * 1_000_003 + step)
        c = torch.randint(0, num_clusters, (T,), generator=gb)
        x = centres[c] + torch.randn(T, d, generator=gb)
        return x, torch.einsum("tij,tj->ti", maps[c], x)

    return batch


def gates(d: int, E: int, k: int):
    """(name, gate, capacity_factor): each gate in the layer mode it is meant for."""
    return [
        ("TopKGate (Switch/Mixtral)", TopKGate(d, E, k), 1.25),
        ("NoisyTopKGate (Shazeer)", NoisyTopKGate(d, E, k), 1.25),
        ("BatchwiseGate (expert choice)", BatchwiseGate(d, E, k), None),
        ("DSelectKGate (per example)", DSelectKGate(E, k, input_dim=d), None),
        ("BalancedAssignmentGate (BASE)", BalancedAssignmentGate(d, E), None),
        ("SinkhornGate", SinkhornGate(d, E), None),
    ]


def train_gates(steps: int = 60, tokens: int = 512, d: int = 16, experts: int = 8, k: int = 2):
    torch.manual_seed(0)
    batch = make_task(d, experts)
    rows = []
    candidates = gates(d, experts, k)
    bar = tqdm(total=steps * len(candidates), desc="training gates in MoE", unit="step")
    for name, gate, capacity_factor in candidates:
        moe = moe_kernels.MoE(d, experts, d_hidden=4 * d, gate=gate, capacity_factor=capacity_factor)
        opt = torch.optim.Adam(moe.parameters(), lr=1e-2)
        first = None
        for step in range(steps):
            x, y = batch(tokens, step)
            mse = (moe(x) - y).square().mean()
            (mse + moe.aux_loss).backward()
            opt.step()
            opt.zero_grad()
            first = mse.item() if first is None else first
            bar.update(1)
        moe.eval()
        with torch.no_grad():
            x, y = batch(tokens, 10_000)  # held-out batch
            test = (moe(x) - y).square().mean().item()
        s = moe.stats
        rows.append(
            (
                name,
                "dropless" if capacity_factor is None else f"cf {capacity_factor}",
                first,
                test,
                float(s["max_mean_load"]),
                float(s["dropped_fraction"]),
            )
        )
    bar.close()
    print(
        f"\nMoE({d=}, E={experts}, k={k}) trained {steps} steps of {tokens} tokens per gate; eval on a held-out batch:"
    )
    print(f"  {'gate':<31} {'mode':<9} {'MSE step 0':>10} {'eval MSE':>9} {'max/mean load':>14} {'dropped':>8}")
    for name, mode, first, test, max_mean, dropped in rows:
        print(f"  {name:<31} {mode:<9} {first:10.3f} {test:9.3f} {max_mean:14.2f} {dropped:8.2%}")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    train_gates(args.steps, args.tokens)


if __name__ == "__main__":
    main()
