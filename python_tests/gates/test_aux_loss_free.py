"""AuxLossFreeGate: the bias update rule, the bias as a selection-only buffer, counting over a
step, the sequence-wise balance loss against a per-sequence loop, inside MoE."""

import pytest
import torch

import moe_kernels
from moe_kernels import losses
from moe_kernels.gates import AuxLossFreeGate, update_selection_bias


def test_update_rule():
    bias = torch.tensor([0.0, 0.5, -0.5, 0.0])
    counts = torch.tensor([10.0, 2.0, 4.0, 4.0])  # mean 5
    update_selection_bias(bias, counts, 0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.6, -0.4, 0.1]))
    update_selection_bias(bias, torch.full((4,), 3), 0.1)  # all at the mean: unchanged
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.6, -0.4, 0.1]))
    with pytest.raises(ValueError, match="both be"):
        update_selection_bias(bias, torch.ones(3), 0.1)


def test_bias_is_a_buffer_that_selects_but_gets_no_gradient():
    gate = AuxLossFreeGate(6, 4, 1, scoring="sigmoid", renormalize=False)
    assert "selection_bias" in gate.state_dict() and "step_counts" in gate.state_dict()
    assert not any(p is gate.selection_bias for p in gate.parameters())
    x = torch.randn(32, 6)
    with torch.no_grad():
        gate.selection_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    routing = gate(x)
    assert (routing.experts == 2).all()  # the bias decides the selection...
    expected = torch.sigmoid(x @ gate.w_router)[:, 2]
    torch.testing.assert_close(routing.weights[:, 0], expected)  # ...not the weight
    routing.weights.sum().backward()
    assert gate.w_router.grad is not None


def test_counts_accumulate_over_a_step_then_update_resets():
    torch.manual_seed(0)
    gate = AuxLossFreeGate(8, 4, 2, bias_update_rate=0.01)
    x = torch.randn(20, 8)
    r1, r2 = gate(x), gate(x[:7])
    expected = torch.bincount(torch.cat([r1.experts, r2.experts]).reshape(-1), minlength=4).float()
    torch.testing.assert_close(gate.step_counts, expected)
    bias = update_selection_bias(gate.selection_bias.clone(), expected, 0.01)
    gate.update_bias()
    torch.testing.assert_close(gate.selection_bias, bias)
    assert gate.step_counts.sum() == 0
    gate.eval()
    gate(x)
    assert gate.step_counts.sum() == 0  # eval forwards are not counted
    gate.update_bias()
    torch.testing.assert_close(gate.selection_bias, bias)  # and nothing to update


def test_masked_tokens_are_not_counted():
    gate = AuxLossFreeGate(4, 4, 1)
    x = torch.randn(10, 4)
    mask = torch.arange(10) < 6
    routing = gate(x, mask=mask)
    expected = torch.bincount(routing.experts[:6].reshape(-1), minlength=4).float()
    torch.testing.assert_close(gate.step_counts, expected)


def sequence_loop(scores, experts, seq_len, mask):
    """The paper's formula, one sequence at a time."""
    T, E = scores.shape
    k = experts.shape[1]
    total = []
    for start in range(0, T, seq_len):
        s = scores[start : start + seq_len].double()
        e = experts[start : start + seq_len]
        m = mask[start : start + seq_len].double()
        tokens = max(m.sum().item(), 1.0)
        f = torch.zeros(E, dtype=torch.float64)
        for t in range(s.shape[0]):
            for j in range(k):
                if e[t, j] >= 0:
                    f[e[t, j]] += m[t]
        f = f * E / (k * tokens)
        P = ((s / s.sum(-1, keepdim=True)) * m[:, None]).sum(0) / tokens
        total.append((f * P).sum())
    return torch.stack(total).mean()


def test_sequence_balance_loss_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(12, 5, generator=g)
    experts = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(12)])
    experts[3, 1] = -1
    mask = torch.rand(12, generator=g) > 0.3
    for seq_len in (12, 4, 3):
        got = losses.sequence_balance_loss(scores, experts, seq_len, mask)
        torch.testing.assert_close(got.double(), sequence_loop(scores, experts, seq_len, mask))
    ones = torch.ones(12, dtype=torch.bool)
    torch.testing.assert_close(
        losses.sequence_balance_loss(scores, experts).double(), sequence_loop(scores, experts, 12, ones)
    )
    # all tokens on the same experts with all their score: E / k
    s = torch.zeros(6, 4)
    s[:, :2] = 0.5
    e = torch.tensor([[0, 1]] * 6)
    torch.testing.assert_close(losses.sequence_balance_loss(s, e), torch.tensor(2.0))
    with pytest.raises(ValueError, match="seq_len must divide"):
        losses.sequence_balance_loss(scores, experts, 5)


def test_sequence_balance_loss_gradcheck():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(8, 4, generator=g, dtype=torch.float64) + 0.1
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])

    def f(s):
        # in float64 end to end: the loss casts to float32, so check the formula's own gradient
        return sequence_loop(s, experts, 4, torch.ones(8, dtype=torch.bool))

    torch.autograd.gradcheck(f, (scores.requires_grad_(),))
    s = scores.detach().float().requires_grad_()
    losses.sequence_balance_loss(s, experts, 4).backward()
    s2 = scores.detach().clone().requires_grad_()
    f(s2).backward()
    torch.testing.assert_close(s.grad.double(), s2.grad, rtol=1e-5, atol=1e-6)


def test_gate_in_moe_with_the_sequence_loss():
    torch.manual_seed(0)
    gate = AuxLossFreeGate(16, 8, 2, num_groups=4, topk_groups=2, seq_balance_weight=1e-2, seq_len=12)
    moe = moe_kernels.MoE(16, 8, 32, gate=gate)
    x = torch.randn(2, 12, 16)
    y = moe(x)
    assert y.shape == x.shape and moe.aux_loss.item() > 0
    (y.square().mean() + moe.aux_loss).backward()
    assert gate.w_router.grad is not None and gate.w_router.grad.abs().sum() > 0
    assert gate.step_counts.sum() == 2 * 12 * 2
    AuxLossFreeGate.update_all(moe)
    assert gate.selection_bias.abs().sum() > 0 and gate.step_counts.sum() == 0
    state = moe.state_dict()
    clone = moe_kernels.MoE(16, 8, 32, gate=AuxLossFreeGate(16, 8, 2, num_groups=4, topk_groups=2))
    clone.load_state_dict(state)
    torch.testing.assert_close(clone.gate.selection_bias, gate.selection_bias)


def test_bad_arguments():
    with pytest.raises(ValueError, match="bias_update_rate"):
        AuxLossFreeGate(4, 4, 1, bias_update_rate=float("nan"))
    with pytest.raises(ValueError, match="k must be"):
        AuxLossFreeGate(4, 4, 5)


def test_torch_compile_fullgraph():
    gate = AuxLossFreeGate(8, 8, 2).eval()
    x = torch.randn(16, 8)

    def route(x):
        r = gate(x)
        return r.weights, r.experts

    compiled = torch.compile(route, fullgraph=True)
    w, e = compiled(x)
    w_ref, e_ref = route(x)
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(w, w_ref)
