"""Strictly balanced gating (Shazeer et al. 2017, Appendix F): train a BatchwiseGate on a synthetic
mixture-of-regressions task, then measure on held-out batches how well the learned thresholds
(eq 19) reproduce the batchwise mask (eq 18) they were trained to imitate (eq 20), and how evenly
they load the experts.

Task: inputs come from `clusters` Gaussian clusters in R^d; cluster c's target is y = A_c x. The
model is the gate plus E linear experts, y_hat = sum_i G(x)_i E_i(x); loss = MSE + aux_loss.

    .venv/bin/python examples/batchwise_thresholds.py                 # the documented full run
    .venv/bin/python examples/batchwise_thresholds.py --tune          # + choose the loss weight on validation seeds
    .venv/bin/python examples/batchwise_thresholds.py --steps 30 --seeds 0 --eval-batches 2   # smoke test

Reported per held-out seed, on `eval-batches` fresh batches of the training batch size (m from the
same rule as in training):
  agreement   fraction of the T x E entries where M_threshold == M_batchwise (goal >= 95%)
  jaccard     |M_threshold & M_batchwise| / |M_threshold | M_batchwise| (agreement counts the many
              entries both masks leave empty; this does not)
  max/mean    the largest expert load under the thresholds over the mean load (1 = balanced)
  none, >k    fraction of tokens with no expert / with more than k experts under the thresholds
  mse         test MSE with the threshold mask (inference) and with the batchwise mask
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from moe_kernels.gates import BatchwiseGate
from moe_kernels.gates.batchwise import tokens_per_expert
from moe_kernels.ops import batchwise_mask, threshold_mask

VALIDATION_SEEDS = [100, 101]
HELD_OUT_SEEDS = [0, 1, 2]


class Task:
    """Mixture of linear regressions: x ~ N(center_c, noise^2 I), y = A_c x."""

    def __init__(self, d: int, d_out: int, clusters: int, seed: int):
        g = torch.Generator().manual_seed(10_000 + seed)
        self.centers = torch.randn(clusters, d, generator=g) * 2.0
        self.maps = torch.randn(clusters, d, d_out, generator=g) / d**0.5
        self.clusters = clusters

    def batch(self, n: int, g: torch.Generator):
        c = torch.randint(0, self.clusters, (n,), generator=g)
        x = self.centers[c] + 0.5 * torch.randn(n, self.centers.shape[1], generator=g)
        y = torch.einsum("nd,ndo->no", x, self.maps[c])
        return x, y


class BatchwiseMoE(nn.Module):
    """Gate + E linear experts; combines the gate's Routing in either layout (what
    moe_kernels.MoE does with it: expert_choice dispatches each expert's [m] tokens, topk the
    token view)."""

    def __init__(self, d: int, d_out: int, experts: int, k: int, threshold_loss_weight: float):
        super().__init__()
        self.gate = BatchwiseGate(d, experts, k, threshold_loss_weight=threshold_loss_weight)
        self.experts = nn.ModuleList(nn.Linear(d, d_out) for _ in range(experts))

    def forward(self, x):
        r = self.gate(x)
        y = x.new_zeros(x.shape[0], self.experts[0].out_features)
        for e, expert in enumerate(self.experts):
            if r.layout == "expert_choice":
                tokens, w = r.expert_tokens[e], r.expert_weights[e]
            else:
                hit = r.experts == e
                tokens, w = hit.nonzero()[:, 0], r.weights[hit]
            y = y.index_add(0, tokens, w[:, None] * expert(x[tokens]))
        return y, r


def run(seed: int, args, weight: float) -> dict:
    torch.manual_seed(seed)
    task = Task(args.d, args.d_out, args.clusters, seed)
    model = BatchwiseMoE(args.d, args.d_out, args.experts, args.k, weight)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(args.steps):
        x, y = task.batch(args.batch, g)
        y_hat, r = model(x)
        loss = (y_hat - y).pow(2).mean() + r.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()

    # Held-out batches from a generator the training never touched.
    g_test = torch.Generator().manual_seed(1_000_000 + seed)
    m = tokens_per_expert(args.batch, args.experts, args.k)
    out = {k: [] for k in ("agreement", "jaccard", "max_load", "none", "over_k", "mse_threshold", "mse_batchwise")}
    with torch.no_grad():
        for _ in range(args.eval_batches):
            x, y = task.batch(args.batch, g_test)
            probs = torch.softmax(model.gate.w_gate(x).float(), -1)
            m_thr = threshold_mask(probs, model.gate.thresholds)
            m_bw = batchwise_mask(probs, m)
            out["agreement"].append((m_thr == m_bw).float().mean().item())
            union = (m_thr | m_bw).sum().item()
            out["jaccard"].append((m_thr & m_bw).sum().item() / max(union, 1))
            load = m_thr.sum(0).float()
            out["max_load"].append((load.max() / load.mean().clamp_min(1e-9)).item())
            counts = m_thr.sum(1)
            out["none"].append((counts == 0).float().mean().item())
            out["over_k"].append((counts > args.k).float().mean().item())
            model.eval()
            out["mse_threshold"].append((model(x)[0] - y).pow(2).mean().item())
            model.train()
            out["mse_batchwise"].append((model(x)[0] - y).pow(2).mean().item())
    return {k: statistics.mean(v) for k, v in out.items()}


def report(rows: dict[int, dict]) -> str:
    cols = ["agreement", "jaccard", "max_load", "none", "over_k", "mse_threshold", "mse_batchwise"]
    lines = ["| seed | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for seed, r in rows.items():
        lines.append(f"| {seed} | " + " | ".join(f"{r[c]:.4f}" for c in cols) + " |")
    mean = {c: statistics.mean(r[c] for r in rows.values()) for c in cols}
    lines.append("| mean | " + " | ".join(f"{mean[c]:.4f}" for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict[int, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--d", type=int, default=16)
    parser.add_argument("--d-out", type=int, default=4)
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--threshold-loss-weight", type=float, default=1e-2)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=HELD_OUT_SEEDS)
    parser.add_argument("--tune", action="store_true", help="pick the loss weight on the validation seeds first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (small ops: 1 is fastest)")
    args = parser.parse_args(argv)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(previous_threads)


def _main(args) -> dict[int, dict]:
    weight = args.threshold_loss_weight
    if args.tune:
        scores = {}
        for w in (1e-3, 1e-2, 1e-1):
            rows = {s: run(s, args, w) for s in VALIDATION_SEEDS}
            scores[w] = statistics.mean(r["agreement"] for r in rows.values())
            print(f"validation seeds {VALIDATION_SEEDS}, threshold_loss_weight={w:g}: agreement {scores[w]:.4f}")
        weight = max(scores, key=scores.get)
        print(f"chosen threshold_loss_weight={weight:g}")
    start = time.perf_counter()
    rows = {s: run(s, args, weight) for s in args.seeds}
    print(
        f"held-out seeds {args.seeds}: steps={args.steps} batch={args.batch} E={args.experts} k={args.k} "
        f"m={tokens_per_expert(args.batch, args.experts, args.k)} threshold_loss_weight={weight:g} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    print(report(rows))
    return rows


if __name__ == "__main__":
    main()
