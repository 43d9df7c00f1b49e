"""Appendix C.2.2 of DSelect-k (003_a1a58754fcb6a991.txt): can a trained gate recover the experts
that generated the data?

A data-generating MoE: 4 experts, each a ReLU dense layer 10 -> 4, averaged, fed to one logistic
unit 4 -> 1; X = 20,000 x 10 standard normal; label = sign of the output logit (10,000 train,
10,000 validation). The student MoE has 16 frozen experts: the 4 true ones (at random positions)
and 12 random ones of the same form, the true logistic unit (frozen), and a trainable static gate
choosing 4 of 16: DSelect-k (k = 4) or Top-k (k = 4, softmax over the 4 largest logits). Only the
gate is trained (cross-entropy, Adam, batch 256). The learning rate (and DSelect-k's entropy
weight) is chosen on validation loss over the tuning seeds; recovery is reported on held-out seeds.

    PYTHONPATH=. .venv/bin/python examples/dselect_recovery.py            # the documented run
    PYTHONPATH=. .venv/bin/python examples/dselect_recovery.py --smoke    # seconds (the test)
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from moe_kernels.gates import DSelectKGate
from moe_kernels.ops import topk_softmax

NUM_EXPERTS, TRUE_EXPERTS, K, FEATURES, UNITS = 16, 4, 4, 10, 4


def make_problem(seed: int, samples: int):
    """(H [N, 16, 4] frozen expert outputs, y [N] labels in {0, 1}, true expert positions, head)."""
    g = torch.Generator().manual_seed(seed)
    # Keras-like Glorot-uniform dense layers (the paper's experts are Keras Dense layers).
    limit = (6 / (FEATURES + UNITS)) ** 0.5
    w = (torch.rand(NUM_EXPERTS, FEATURES, UNITS, generator=g) * 2 - 1) * limit
    b = torch.zeros(NUM_EXPERTS, UNITS)
    head_w = (torch.rand(UNITS, generator=g) * 2 - 1) * (6 / (UNITS + 1)) ** 0.5
    true = torch.randperm(NUM_EXPERTS, generator=g)[:TRUE_EXPERTS].sort().values
    x = torch.randn(samples, FEATURES, generator=g)
    h = torch.relu(torch.einsum("nf,efu->neu", x, w) + b)  # [N, 16, 4], frozen: computed once
    logit = h[:, true].mean(1) @ head_w
    y = (logit > 0).float()
    return h, y, true, head_w


class TopKStatic(torch.nn.Module):
    """Static Top-k gate: weights = softmax over the k largest of 16 learned logits."""

    def __init__(self, n, k):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(n) * 0.01)
        self.k = k

    def weights(self):
        """(gate values [16], auxiliary loss)."""
        w, e = topk_softmax(self.logits[None], self.k)
        return torch.zeros(self.logits.shape[0]).scatter(0, e[0], w[0]), torch.zeros(())

    def selected(self):
        return set(topk_softmax(self.logits[None].detach(), self.k)[1][0].tolist())


class DSelectStatic(torch.nn.Module):
    def __init__(self, n, k, entropy_weight, gamma):
        super().__init__()
        self.gate = DSelectKGate(n, k, gamma=gamma, entropy_weight=entropy_weight)

    def weights(self):
        """(gate values [16], entropy regulariser): one fused dselect_k call."""
        w, selectors = self.gate.gates(return_selectors=True)
        return w, self.gate.regulariser(selectors)

    def selected(self):
        return {e for e in self.gate.selected_experts().tolist() if e >= 0}


def train(gate, h, y, head_w, lr, epochs, seed, n_train):
    opt = torch.optim.Adam(gate.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed + 1000)
    for _ in range(epochs):
        for idx in torch.randperm(n_train, generator=g).split(256):
            w, aux = gate.weights()
            logit = torch.einsum("e,neu->nu", w, h[idx]) @ head_w
            loss = F.binary_cross_entropy_with_logits(logit, y[idx]) + aux
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        w, _ = gate.weights()
        val = slice(n_train, None)
        logit = torch.einsum("e,neu->nu", w, h[val]) @ head_w
        val_loss = F.binary_cross_entropy_with_logits(logit, y[val]).item()
        val_acc = ((logit > 0).float() == y[val]).float().mean().item()
    return val_loss, val_acc


def run(kind, config, seed, samples, epochs):
    torch.manual_seed(seed)
    h, y, true, head_w = make_problem(seed, samples)
    lr = config["lr"]
    gate = TopKStatic(NUM_EXPERTS, K) if kind == "topk" else DSelectStatic(NUM_EXPERTS, K, config["entropy"], 1.0)
    val_loss, val_acc = train(gate, h, y, head_w, lr, epochs, seed, samples // 2)
    chosen = gate.selected()
    out = {"val_loss": val_loss, "val_acc": val_acc, "recovered": len(chosen & set(true.tolist())), "chosen": chosen}
    if kind == "dselect":
        out["converged"] = gate.gate.is_converged()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny data, one config, one seed")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--tune-seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--test-seeds", type=int, nargs="+", default=[10, 11, 12, 13, 14])
    args = parser.parse_args(argv)
    samples, epochs = (20000, args.epochs) if not args.smoke else (1024, 2)
    grids = {
        "topk": [{"lr": lr} for lr in (1e-1, 1e-2, 1e-3)],
        "dselect": [{"lr": lr, "entropy": e} for lr, e in itertools.product((1e-1, 1e-2, 1e-3), (0.0, 1e-2))],
    }
    tune, test = args.tune_seeds, args.test_seeds
    if args.smoke:
        grids = {kind: grid[:1] for kind, grid in grids.items()}
        tune, test = [0], [1]
    results = {}
    for kind, grid in grids.items():
        scores = []
        for config in grid:
            runs = [run(kind, config, s, samples, epochs) for s in tune]
            mean_loss = sum(r["val_loss"] for r in runs) / len(runs)
            print(f"tune {kind} {config}: val loss {mean_loss:.4f} recovered {[r['recovered'] for r in runs]}")
            scores.append((mean_loss, config))
        best = min(scores, key=lambda s: s[0])[1]
        held = [run(kind, best, s, samples, epochs) for s in test]
        results[kind] = {"config": best, "runs": held}
        for s, r in zip(test, held):
            extra = f" converged={r['converged']}" if "converged" in r else ""
            print(
                f"test {kind} {best} seed {s}: recovered {r['recovered']}/4, val acc {r['val_acc']:.4f}, "
                f"val loss {r['val_loss']:.4f}{extra}"
            )
        mean = sum(r["recovered"] for r in held) / len(held)
        print(f"== {kind}: mean true experts recovered {mean:.2f} / 4 over held-out seeds {test}")
    return results


if __name__ == "__main__":
    main()
