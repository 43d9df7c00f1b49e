"""Toy experiment of Kool et al. (004_62bca7777c830867.txt, Section 3, Figure 2b).

100 points x ~ U(-1, 1), y = 1[x < 0.5](0.8x - 0.2) + 1[x >= 0.5](-2x + 2) + N(0, 0.1^2); two
linear experts y_j(x) = a_j x + b_j, a Bernoulli router p(z = 1 | x) = sigmoid(w x + c), expert
capacity n / k = 50. Trained on the full batch with Adam (lr 0.1) on the REINFORCE surrogate of
each estimator (moe_kernels.estimators, EMA baseline with decay 0.99), f_i = (y_i - y_{z_i}(x_i))^2.
Success: final MSE < 0.02, evaluated with each point routed to its most probable expert
(z* = argmax p(z | x), no capacity, as at test time in the paper). Each seed draws its own data
and initialisation.

    .venv/bin/python examples/kool_toy.py                    # the full run (docs/kool_toy.md)
    .venv/bin/python examples/kool_toy.py --steps 200 --seeds 1 --taus 1 --estimators sample
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_kernels import estimators


def make_data(seed: int, n: int = 100):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g) * 2 - 1
    y = torch.where(x < 0.5, 0.8 * x - 0.2, -2.0 * x + 2.0) + 0.1 * torch.randn(n, generator=g)
    return x, y


class ToyMoE(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(10_000 + seed)
        self.a = torch.nn.Parameter(torch.randn(2, generator=g) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(2, generator=g) * 0.1)
        self.w = torch.nn.Parameter(torch.randn((), generator=g) * 0.1)
        self.c = torch.nn.Parameter(torch.zeros(()))

    def log_p(self, x):
        """[n, 2] router log-probabilities (Bernoulli: expert 1 with sigmoid(w x + c))."""
        logit = self.w * x + self.c
        return torch.stack([torch.nn.functional.logsigmoid(-logit), torch.nn.functional.logsigmoid(logit)], 1)

    def predict(self, x):
        """[n, 2] predictions of both experts."""
        return self.a[None, :] * x[:, None] + self.b[None, :]

    @torch.no_grad()
    def test_mse(self, x, y):
        z = self.log_p(x).argmax(1)
        return float(((self.predict(x)[torch.arange(len(x)), z] - y) ** 2).mean())


def train(estimator: str, tau: float, seed: int, steps: int, use_sinkhorn: bool = False) -> float:
    x, y = make_data(seed)
    model = ToyMoE(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    baseline = estimators.EMABaseline(0.99)
    gen = torch.Generator().manual_seed(20_000 + seed)
    rows = torch.arange(len(x))
    for _ in range(steps):
        log_p = model.log_p(x)
        sample = estimators.sample_routing(estimator, log_p, tau=tau, use_sinkhorn=use_sinkhorn, generator=gen)
        f = (model.predict(x)[rows, sample.experts] - y) ** 2
        loss = estimators.surrogate(log_p, sample, f, baseline())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        baseline.update(f)
    return model.test_mse(x, y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--taus", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--estimators", nargs="+", default=list(estimators.ESTIMATORS))
    parser.add_argument("--sinkhorn", action="store_true", help="Sinkhorn-balanced proposals")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    print(f"steps={args.steps} seeds={list(seeds)} sinkhorn={args.sinkhorn}")
    print("| estimator | tau | solved (MSE < 0.02) | median final MSE | seconds |")
    print("|---|---|---|---|---|")
    for name in args.estimators:
        for tau in args.taus:
            t0 = time.perf_counter()
            mses = [train(name, tau, s, args.steps, args.sinkhorn) for s in seeds]
            solved = sum(m < 0.02 for m in mses)
            med = sorted(mses)[len(mses) // 2]
            print(
                f"| {name} | {tau:g} | {solved}/{len(mses)} | {med:.4f} | {time.perf_counter() - t0:.0f} |", flush=True
            )


if __name__ == "__main__":
    main()
