"""Toy experiment of Kool et al. (004_62bca7777c830867.txt, Section 3, Figure 2b / 2c).

100 points x ~ U(-1, 1), y = 1[x < 0.5](0.8x - 0.2) + 1[x >= 0.5](-2x + 2) + N(0, 0.1^2); two
linear experts y_j(x) = a_j x + b_j, a Bernoulli router p(z = 1 | x) = sigmoid(w x + c), expert
capacity n / k = 50. Trained on the full batch with Adam (lr 0.1) for 10k steps with one of

  --loss reinforce  the REINFORCE surrogate of each estimator (moe_kernels.estimators, EMA baseline
                    with decay 0.99, no load loss), f_i = (y_i - y_{z_i}(x_i))^2 (Figure 2b);
  --loss gating     differentiable gating (Section 3.1, Figure 2c): the same samples and importance
                    weights, the expert output multiplied by the router probability,
                    f_i = (y_i - p(z_i | x_i) y_{z_i}(x_i))^2, plus 0.01 x the load loss.

Success: final MSE < 0.02 on the training set, each point routed to its most probable expert
(z* = argmax p(z | x), no capacity, as at test time in the paper); with gating the prediction is
the gated one, p(z* | x) y_{z*}(x), the model's own output. Each seed draws its own data,
initialisation and sampling noise; runs are independent, so --jobs only changes the wall time.

    .venv/bin/python examples/kool_toy.py --out examples/out/kool.jsonl     # docs/kool_toy.md
    .venv/bin/python examples/kool_toy.py --steps 200 --seeds 1 --taus 1 --estimators sample
    .venv/bin/python examples/kool_toy.py --summarize examples/out/kool.jsonl
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

import torch

from moe_kernels import estimators

LOSSES = ("reinforce", "gating")
LOAD_WEIGHT = 0.01  # Figure 2c's load-loss weight for differentiable gating
SUCCESS = 0.02  # the paper's success threshold on the final MSE


def make_data(seed: int, n: int = 100):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g) * 2 - 1
    y = torch.where(x < 0.5, 0.8 * x - 0.2, -2.0 * x + 2.0) + 0.1 * torch.randn(n, generator=g)
    return x, y


class ToyMoE(torch.nn.Module):
    """theta = (a_0, a_1, b_0, b_1, w, c) in one parameter: Adam is elementwise, so one tensor of 6
    trains exactly like four small ones, with a quarter of the optimizer's per-step overhead."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(10_000 + seed)
        a = torch.randn(2, generator=g) * 0.1
        b = torch.randn(2, generator=g) * 0.1
        w = torch.randn(1, generator=g) * 0.1
        self.theta = torch.nn.Parameter(torch.cat([a, b, w, torch.zeros(1)]))

    def log_p(self, x):
        """[n, 2] router log-probabilities (Bernoulli: expert 1 with sigmoid(w x + c))."""
        logit = self.theta[4] * x + self.theta[5]
        return torch.stack([torch.nn.functional.logsigmoid(-logit), torch.nn.functional.logsigmoid(logit)], 1)

    def predict(self, x):
        """[n, 2] predictions of both experts."""
        return self.theta[None, 0:2] * x[:, None] + self.theta[None, 2:4]

    @torch.no_grad()
    def test_mse(self, x, y, gated: bool = False):
        log_p = self.log_p(x)
        z = log_p.argmax(1)[:, None]
        pred = self.predict(x).gather(1, z).squeeze(1)
        if gated:
            pred = pred * log_p.gather(1, z).squeeze(1).exp()
        return float(((pred - y) ** 2).mean())


def train(
    estimator: str, tau: float, seed: int, steps: int, use_sinkhorn: bool = False, loss: str = "reinforce"
) -> float:
    """One run; returns the final MSE (module docstring)."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    x, y = make_data(seed)
    model = ToyMoE(seed)
    # fused: Adam's update in one kernel call instead of a dozen tensor ops per step, same rule
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    baseline = estimators.EMABaseline(0.99)
    gen = torch.Generator().manual_seed(20_000 + seed)
    for _ in range(steps):
        log_p = model.log_p(x)
        sample = estimators.sample_routing(estimator, log_p, tau=tau, use_sinkhorn=use_sinkhorn, generator=gen)
        z = sample.experts[:, None]
        pred = model.predict(x).gather(1, z).squeeze(1)
        if loss == "reinforce":
            f = (pred - y) ** 2
            objective = estimators.surrogate(log_p, sample, f, baseline())
            baseline.update(f)
        else:
            f = (log_p.gather(1, z).squeeze(1).exp() * pred - y) ** 2
            objective = estimators.gating_loss(log_p, sample, f, LOAD_WEIGHT)
        opt.zero_grad(set_to_none=True)
        objective.backward()
        opt.step()
    return model.test_mse(x, y, gated=loss == "gating")


def run_job(job: dict) -> dict:
    """One (loss, estimator, tau, sinkhorn, seed) run in a worker process: the tensors are tiny,
    so one thread per process (more only adds synchronisation)."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    mse = train(job["estimator"], job["tau"], job["seed"], job["steps"], job["sinkhorn"], job["loss"])
    return {**job, "mse": mse, "seconds": round(time.perf_counter() - t0, 2)}


def row_key(r: dict):
    return (r["loss"], r["sinkhorn"], r["estimator"], r["tau"], r["steps"])


def format_row(runs: list[dict]) -> str:
    r = runs[0]
    mses = sorted(run["mse"] for run in runs)
    solved = sum(m < SUCCESS for m in mses)
    med = (mses[(len(mses) - 1) // 2] + mses[len(mses) // 2]) / 2
    seeds = sorted(run["seed"] for run in runs)
    secs = sum(run["seconds"] for run in runs)
    return (
        f"| {r['loss']} | {r['estimator']} | {'yes' if r['sinkhorn'] else 'no'} | {r['tau']:g} | "
        f"{seeds[0]}-{seeds[-1]} | {solved}/{len(runs)} | {med:.4f} | {secs:.0f} |"
    )


HEADER = (
    "| loss | estimator | sinkhorn | tau | seeds | solved (MSE < 0.02) | median final MSE | run seconds |\n"
    "|---|---|---|---|---|---|---|---|"
)


def summarize(paths: list[str]) -> None:
    """Print, for every (loss, sinkhorn) of the results files, a grid of estimator x tau cells
    'solved/seeds (median final MSE)' over the seeds finished so far, then
    the long table of every row, in the order the rows were first written."""
    rows: dict = {}
    for path in paths:
        with open(path) as fh:
            for line in fh:
                r = json.loads(line)
                rows.setdefault(row_key(r), {})[r["seed"]] = r
    grids: dict = {}
    for (loss, sink, name, tau, steps), runs in rows.items():
        mses = sorted(run["mse"] for run in runs.values())
        med = (mses[(len(mses) - 1) // 2] + mses[len(mses) // 2]) / 2
        cell = f"{sum(m < SUCCESS for m in mses)}/{len(mses)} ({med:.3f})"
        grids.setdefault((loss, sink, steps), {}).setdefault(name, {})[tau] = cell
    for (loss, sink, steps), grid in grids.items():
        taus = sorted({tau for cells in grid.values() for tau in cells})
        print(f"\n{loss}, {'Sinkhorn' if sink else 'plain'} proposals, {steps} steps:\n")
        print("| estimator | " + " | ".join(f"tau = {t:g}" for t in taus) + " |")
        print("|---|" + "---|" * len(taus))
        order = {name: i for i, name in enumerate(estimators.ESTIMATORS)}
        for name, cells in sorted(grid.items(), key=lambda item: order.get(item[0], len(order))):
            print(f"| {name} | " + " | ".join(cells.get(t, "-") for t in taus) + " |")
    print()
    print(HEADER)
    for runs in rows.values():
        print(format_row(list(runs.values())))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--estimators", nargs="+", default=list(estimators.ESTIMATORS))
    parser.add_argument("--sinkhorn", action="store_true", help="Sinkhorn-balanced proposals")
    parser.add_argument("--loss", choices=LOSSES, default="reinforce")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    parser.add_argument("--out", help="append one JSON line per finished run; runs already there are skipped")
    parser.add_argument("--summarize", metavar="FILE", nargs="+", help="only print the tables of results files")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    torch.set_num_threads(1)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    done = {}
    if args.out and os.path.exists(args.out):
        with open(args.out) as fh:
            for line in fh:
                r = json.loads(line)
                done[(*row_key(r), r["seed"])] = r
    config = {"loss": args.loss, "sinkhorn": args.sinkhorn, "steps": args.steps}
    rows = [
        [{**config, "estimator": name, "tau": tau, "seed": s} for s in seeds]
        for name in args.estimators
        for tau in args.taus
    ]
    todo = [job for row in rows for job in row if (*row_key(job), job["seed"]) not in done]
    print(f"steps={args.steps} seeds={seeds} loss={args.loss} sinkhorn={args.sinkhorn} jobs={args.jobs}", flush=True)
    print(HEADER, flush=True)
    out = open(args.out, "a") if args.out else None
    pool = multiprocessing.get_context("spawn").Pool(args.jobs) if args.jobs > 1 else None
    results = pool.imap(run_job, todo) if pool else map(run_job, todo)
    for row in rows:
        runs = []
        for job in row:
            key = (*row_key(job), job["seed"])
            if key not in done:
                done[key] = next(results)
                if out:
                    out.write(json.dumps(done[key]) + "\n")
                    out.flush()
            runs.append(done[key])
        print(format_row(runs), flush=True)
    if pool:
        pool.close()
        pool.join()


if __name__ == "__main__":
    main()
