"""NoisyTopKGate and TopKGate: the Routing they return, their losses by hand, noise only in
training, masks, torch.compile(fullgraph=True), bad arguments."""

import pytest
import torch
from tolerances import assert_close

from moe_kernels import NoisyTopKGate, TopKGate, losses, reference
from moe_kernels.routing import Routing


def randomised(gate, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return gate


def tokens(T=24, d=8, seed=1):
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed))


def test_noisy_gate_starts_at_zero():
    gate = NoisyTopKGate(8, 6, 2)
    assert (gate.w_gate == 0).all() and (gate.w_noise == 0).all()
    r = gate(tokens())
    assert isinstance(r, Routing) and r.experts.shape == (24, 2) and r.num_experts == 6
    assert r.aux_loss.dim() == 0
    # No signal and some noise: training spreads the tokens over the experts.
    assert len(torch.unique(r.experts)) > 2


def test_noisy_gate_training_matches_the_paper_by_hand():
    gate = randomised(NoisyTopKGate(8, 6, 2, w_importance=0.3, w_load=0.7)).train()
    x = tokens()
    torch.manual_seed(5)
    r = gate(x)
    torch.manual_seed(5)
    clean = x @ gate.w_gate
    stddev = torch.nn.functional.softplus(x @ gate.w_noise) + 1e-2
    noisy = clean + torch.randn_like(clean) * stddev
    w_ref, e_ref = reference.topk_softmax(noisy, 2)  # eqs 3-5
    P = reference.load_probabilities(clean, noisy, stddev, 2)  # eq 9
    assert torch.equal(r.experts, e_ref)
    assert_close(r.weights, w_ref)
    importance = r.dense().sum(0)
    expected = 0.3 * losses.cv_squared(importance) + 0.7 * losses.cv_squared(P.sum(0))
    assert_close(r.aux_loss, expected.detach())
    assert_close(r.stats["load"], P.sum(0))


def test_noisy_gate_losses_train_both_matrices():
    gate = randomised(NoisyTopKGate(8, 6, 2)).train()
    r = gate(tokens())
    r.aux_loss.backward()
    assert gate.w_gate.grad.abs().sum() > 0 and gate.w_noise.grad.abs().sum() > 0


def test_noisy_gate_eval_is_deterministic_and_noise_free():
    gate = randomised(NoisyTopKGate(8, 6, 2)).eval()
    x = tokens()
    a, b = gate(x), gate(x)
    assert torch.equal(a.experts, b.experts) and torch.equal(a.weights, b.weights)
    w_ref, e_ref = reference.topk_softmax(x @ gate.w_gate, 2)
    assert torch.equal(a.experts, e_ref)
    assert_close(a.weights, w_ref)
    gate.train()
    c = gate(x)
    assert not torch.equal(c.weights, a.weights)  # noise on in training


def test_noisy_false_is_deterministic_in_training():
    gate = randomised(NoisyTopKGate(8, 6, 2, noisy=False)).train()
    x = tokens()
    assert torch.equal(gate(x).weights, gate(x).weights)


@pytest.mark.parametrize("make", [lambda: NoisyTopKGate(8, 6, 2, noisy=False), lambda: TopKGate(8, 6, 2)])
def test_mask_equals_the_real_tokens_only(make):
    gate = randomised(make()).eval()
    x = tokens()
    mask = torch.rand(24, generator=torch.Generator().manual_seed(2)) < 0.5
    assert_close(gate(x, mask=mask).aux_loss, gate(x[mask]).aux_loss)
    assert not torch.allclose(gate(x, mask=mask).aux_loss, gate(x).aux_loss)


def test_topk_gate_by_hand():
    gate = randomised(TopKGate(8, 6, 2, w_aux=0.5, w_z=0.25, renormalize=False)).train()
    x = tokens()
    r = gate(x)
    logits = x @ gate.w_router
    w_ref, e_ref = reference.topk_softmax(logits, 2, renormalize=False)
    assert torch.equal(r.experts, e_ref)
    assert_close(r.weights, w_ref)
    expected = 0.5 * losses.switch_aux_loss(torch.softmax(logits, -1), e_ref) + 0.25 * losses.z_loss(logits)
    assert_close(r.aux_loss, expected)


def test_topk_gate_jitter_only_in_training():
    gate = randomised(TopKGate(8, 6, 1, jitter=0.1, renormalize=False))
    x = tokens()
    gate.train()
    assert not torch.equal(gate(x).weights, gate(x).weights)
    gate.eval()
    assert torch.equal(gate(x).weights, gate(x).weights)


@pytest.mark.parametrize("make", [lambda: NoisyTopKGate(8, 6, 2), lambda: TopKGate(8, 6, 2, jitter=0.05)])
def test_torch_compile_fullgraph(make):
    gate = randomised(make())
    x = tokens()
    compiled = torch.compile(gate, fullgraph=True, backend="aot_eager")
    gate.eval()
    got, want = compiled(x), gate(x)
    assert torch.equal(got.experts, want.experts)
    assert_close(got.weights, want.weights)
    assert_close(got.aux_loss, want.aux_loss)
    gate.train()
    r = compiled(x)  # the noisy / jittered training path traces too, and is differentiable
    (r.weights.sum() + r.aux_loss).backward()
    assert next(gate.parameters()).grad is not None


@pytest.mark.parametrize("cls", [NoisyTopKGate, TopKGate])
def test_bad_arguments(cls):
    with pytest.raises(ValueError, match="k"):
        cls(8, 4, 5)  # k > E
    with pytest.raises(ValueError, match="k"):
        cls(8, 4, 0)  # k < 1
    gate = cls(8, 4, 2)
    with pytest.raises(ValueError, match="d_model"):
        gate(torch.randn(5, 7))  # wrong d
    with pytest.raises(ValueError, match="mask"):
        gate(torch.randn(5, 8), mask=torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize("cls", [NoisyTopKGate, TopKGate])
def test_gates_learn_a_tiny_task(cls):
    """The gate alone learns to send each of 4 clusters to its own expert (reward = weight on it)."""
    torch.manual_seed(0)
    gate = cls(4, 4, 2, renormalize=False) if cls is TopKGate else cls(4, 4, 2)
    centers = torch.eye(4) * 3
    opt = torch.optim.Adam(gate.parameters(), lr=0.1)
    for _ in range(60):
        label = torch.randint(0, 4, (64,))
        x = centers[label] + 0.3 * torch.randn(64, 4)
        r = gate(x)
        loss = -(r.dense().gather(1, label[:, None])).mean() + r.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    gate.eval()
    label = torch.arange(4).repeat(16)
    r = gate(centers[label])
    assert (r.experts[:, 0] == label).float().mean() > 0.9
