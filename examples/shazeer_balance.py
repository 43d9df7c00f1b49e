"""Table 6 of Shazeer et al. 2017 (Appendix A, 001_5d5a678b212947b9.txt) at a size this machine
trains in minutes: a noisy top-k MoE trained with six (w_importance, w_load) settings, reporting
test loss, CV(Importance(X)), CV(Load(X)) and max(Load(X)) / mean(Load(X)).

The task (instead of the paper's MoE-256 language model): synthetic clustered regression. A fixed
"task" draws 32 cluster centres in R^16 and one random tanh map per cluster; a token is a centre
plus unit noise, its target the map of its cluster. One MoE layer (E = 16 experts, k = 2, FFN
experts 16 -> 32 -> 16, NoisyTopKGate with zero-initialised W_g and W_noise, dropless) is trained
with Adam on fresh batches. Balance metrics are averaged over the last `--avg` training batches
(as the paper averages "over several training batches"); Load is the smooth estimator of eq 10,
and max/mean of the *counted* tokens per expert is printed too.

Protocol: the learning rate is chosen on validation seeds (their validation-set loss, averaged
over the six rows); the table reports held-out seeds on a separate test set.

    .venv/bin/python examples/shazeer_balance.py                # the full table (a few minutes)
    .venv/bin/python examples/shazeer_balance.py --steps 5 --avg 2 --rows 2 --lrs 0.01 \
        --val-seeds 0 --test-seeds 1                              # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_kernels import MoE, NoisyTopKGate, losses

ROWS = [(0.0, 0.0), (0.2, 0.0), (0.0, 0.2), (0.1, 0.1), (0.01, 0.01), (1.0, 1.0)]  # Table 6's rows
TASK_SEED = 1234


class Task:
    """Clustered regression: x = centre_c + N(0, I), y = tanh(x A_c) B_c."""

    def __init__(self, d=16, clusters=32, seed=TASK_SEED):
        g = torch.Generator().manual_seed(seed)
        self.d, self.clusters = d, clusters
        self.centres = torch.randn(clusters, d, generator=g) * 2.0
        self.A = torch.randn(clusters, d, d, generator=g) / d**0.5
        self.B = torch.randn(clusters, d, d, generator=g) / d**0.5

    def sample(self, n, g):
        c = torch.randint(0, self.clusters, (n,), generator=g)
        x = self.centres[c] + torch.randn(n, self.d, generator=g)
        y = torch.einsum("nd,nde->ne", torch.tanh(torch.einsum("nd,nde->ne", x, self.A[c])), self.B[c])
        return x, y


def train_one(task, w_importance, w_load, lr, seed, *, steps, batch, avg, experts, k, hidden, eval_set):
    torch.manual_seed(seed)
    gate = NoisyTopKGate(task.d, experts, k, w_importance=w_importance, w_load=w_load)
    moe = MoE(task.d, experts, hidden, gate=gate, capacity_factor=None)
    opt = torch.optim.Adam(moe.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1_000_000)
    history = []
    for step in range(steps):
        x, y = task.sample(batch, g)
        loss = (moe(x) - y).pow(2).mean()
        opt.zero_grad()
        (loss + moe.aux_loss).backward()
        opt.step()
        if step >= steps - avg:
            smooth_load = moe.stats["gate"]["load"]
            counted = moe.stats["load"]
            history.append(
                (
                    moe.stats["cv_importance"].item(),
                    losses.cv_squared(smooth_load).sqrt().item(),
                    (smooth_load.max() / smooth_load.mean()).item(),
                    (counted.max() / counted.mean()).item(),
                )
            )
    moe.eval()
    with torch.no_grad():
        x, y = eval_set
        eval_loss = (moe(x) - y).pow(2).mean().item()
    cols = list(zip(*history))
    return {
        "loss": eval_loss,
        "cv_importance": statistics.mean(cols[0]),
        "cv_load": statistics.mean(cols[1]),
        "max_mean_load": statistics.mean(cols[2]),
        "max_mean_counted": statistics.mean(cols[3]),
    }


def mean_runs(runs):
    return {key: statistics.mean(r[key] for r in runs) for key in runs[0]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--avg", type=int, default=50, help="training batches the balance metrics average over")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-2], help="candidates, tuned on val seeds")
    parser.add_argument("--val-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--test-seeds", type=int, nargs="+", default=[100, 101, 102])
    parser.add_argument("--rows", type=int, default=len(ROWS), help="use the first N rows of Table 6")
    args = parser.parse_args(argv)
    rows = ROWS[: args.rows]
    task = Task()
    val_set = task.sample(4096, torch.Generator().manual_seed(7))
    test_set = task.sample(4096, torch.Generator().manual_seed(8))
    common = dict(steps=args.steps, batch=args.batch, avg=args.avg, experts=args.experts, k=args.k, hidden=args.hidden)
    start = time.time()

    # Tuning: one learning rate for all rows, the best mean validation loss over rows and seeds.
    val_loss = {}
    for lr in args.lrs:
        runs = [train_one(task, wi, wl, lr, s, eval_set=val_set, **common) for wi, wl in rows for s in args.val_seeds]
        val_loss[lr] = statistics.mean(r["loss"] for r in runs)
        print(f"lr {lr:g}: validation loss {val_loss[lr]:.4f} (seeds {args.val_seeds})", flush=True)
    lr = min(val_loss, key=val_loss.get)

    lines = [
        f"learning rate {lr:g} (chosen on validation seeds {args.val_seeds}); held-out seeds {args.test_seeds}; "
        f"E={args.experts} k={args.k} steps={args.steps} batch={args.batch}",
        "",
        "| w_importance | w_load | test loss (MSE) | CV(Importance(X)) | CV(Load(X)) | max/mean Load(X) "
        "| max/mean counted load |",
        "|---|---|---|---|---|---|---|",
    ]
    for wi, wl in rows:
        r = mean_runs([train_one(task, wi, wl, lr, s, eval_set=test_set, **common) for s in args.test_seeds])
        lines.append(
            f"| {wi:g} | {wl:g} | {r['loss']:.4f} | {r['cv_importance']:.2f} | {r['cv_load']:.2f} "
            f"| {r['max_mean_load']:.2f} | {r['max_mean_counted']:.2f} |"
        )
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(f"\n{table}\n\n({time.time() - start:.0f} s)")
    return table


if __name__ == "__main__":
    main()
