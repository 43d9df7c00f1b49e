"""BalancedAssignmentGate and SinkhornGate: Routing contract, balance, gradients, eval mode."""

import torch

from moe_kernels.gates import BalancedAssignmentGate, SinkhornGate
from moe_kernels.ops import balanced_assignment
from moe_kernels.routing import Routing


def skewed_tokens(T=64, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, d, generator=g) + 2.0  # a shared direction: plain argmax piles up


def test_balanced_gate_training_and_eval():
    torch.manual_seed(0)
    gate = BalancedAssignmentGate(8, 4, tau=1.0)
    x = skewed_tokens()
    r = gate(x)
    assert isinstance(r, Routing) and r.experts.shape == (64, 1) and r.weights.shape == (64, 1)
    assert torch.equal(torch.bincount(r.experts[:, 0], minlength=4), torch.full((4,), 16))
    q = r.stats["conditionals"]
    assert q.shape == (64,) and (q > 0).all() and (q <= 1).all()
    (r.weights.sum() + r.stats["log_probs"].sum()).backward()
    assert gate.router.weight.grad is not None and gate.router.weight.grad.abs().sum() > 0
    gate.eval()
    r1, r2 = gate(x), gate(x)
    assert torch.equal(r1.experts, r2.experts)
    assert torch.equal(r1.experts[:, 0], balanced_assignment(gate.router(x).detach()))
    assert "conditionals" not in r1.stats
    # Odd batch: ceil(T / E) slots, every token routed.
    r = gate(skewed_tokens(T=13))
    assert torch.bincount(r.experts[:, 0], minlength=4).max() <= 4 and (r.experts >= 0).all()


def test_sinkhorn_gate_balances_better_than_argmax():
    torch.manual_seed(0)
    gate = SinkhornGate(8, 4)
    x = skewed_tokens(T=256)
    r = gate(x)
    gate.eval()
    r_eval = gate(x)
    assert r.experts.shape == (256, 1) and r.weights.requires_grad
    assert float(r.stats["max_load"]) < float(r_eval.stats["max_load"])
    assert torch.equal(r_eval.experts[:, 0], gate.router(x).argmax(-1))
