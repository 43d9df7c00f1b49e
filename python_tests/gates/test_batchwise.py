"""BatchwiseGate: batchwise (expert-choice) routing in training with exactly m tokens per expert,
threshold routing in eval, the mode switch, m's rounding, stats, and the threshold loss."""

import pytest
import torch
from tolerances import assert_close

import moe_kernels
from moe_kernels.gates import BatchwiseGate, sparse_gates
from moe_kernels.gates.batchwise import tokens_per_expert
from moe_kernels.ops import batchwise_mask, threshold_mask


def make_gate(d=8, E=4, k=2, **kw):
    torch.manual_seed(0)
    return BatchwiseGate(d, E, k, **kw)


def probs_of(gate, x):
    return torch.softmax(gate.w_gate(x.reshape(-1, x.shape[-1])).float(), -1)


@pytest.mark.parametrize("T, E, k, m", [(10, 4, 1, 3), (10, 4, 2, 5), (7, 8, 1, 1), (3, 2, 2, 3), (0, 4, 2, 0)])
def test_tokens_per_expert_rounds_up(T, E, k, m):
    assert tokens_per_expert(T, E, k) == m


def test_train_routes_exactly_m_per_expert(backend):
    gate = make_gate(E=4, k=2)
    x = torch.randn(3, 7, 8)  # leading dims are flattened: T = 21
    with moe_kernels.use_backend(backend):
        r = gate(x)
    m = tokens_per_expert(21, 4, 2)
    assert r.layout == "expert_choice" and r.stats["m"] == m == 11
    assert r.expert_tokens.shape == (4, m) and r.expert_weights.shape == (4, m)
    probs = probs_of(gate, x)
    mask, tokens = batchwise_mask(probs, m, return_indices=True)
    assert torch.equal(r.expert_tokens, tokens)
    gates = sparse_gates(probs, mask)
    assert_close(r.dense(), gates)  # the token view is the same routing
    assert_close(r.expert_weights, gates.t().gather(1, tokens))
    assert r.stats["expert_load"].tolist() == [m] * 4
    assert r.stats["max_load"].item() == 1.0
    # every token in the token view appears in its experts' lists
    for t in range(21):
        for e in r.experts[t][r.experts[t] >= 0].tolist():
            assert t in r.expert_tokens[e].tolist()


def test_eval_uses_thresholds():
    gate = make_gate(E=4, k=2)
    with torch.no_grad():
        gate.thresholds.copy_(torch.tensor([0.2, 0.25, 0.3, 0.1]))
    gate.eval()
    x = torch.randn(30, 8)
    r = gate(x)
    probs = probs_of(gate, x)
    mask = threshold_mask(probs, gate.thresholds.detach())
    assert r.layout == "topk" and r.expert_tokens is None and r.stats["m"] is None
    assert r.aux_loss.item() == 0.0
    assert_close(r.dense(), sparse_gates(probs, mask))
    assert r.experts.shape[1] == max(1, int(mask.sum(1).max()))
    counts = mask.sum(1)
    assert r.stats["tokens_without_expert"].item() == int((counts == 0).sum())
    assert r.stats["tokens_over_k"].item() == int((counts > 2).sum())
    assert torch.equal(r.stats["expert_load"], mask.sum(0))


def test_eval_single_token_batch():
    """Inference needs no batch: one token gets the experts above its thresholds."""
    gate = make_gate(E=4, k=1)
    with torch.no_grad():
        gate.thresholds.fill_(0.0)
    gate.eval()
    r = gate(torch.randn(1, 8))
    assert r.experts.shape == (1, 4) and (r.experts >= 0).all()
    with torch.no_grad():
        gate.thresholds.fill_(1.0)  # no probability exceeds 1: the token goes nowhere, gates 0
    r = gate(torch.randn(1, 8))
    assert r.experts.tolist() == [[-1]] and r.weights.tolist() == [[0.0]]
    assert r.stats["tokens_without_expert"].item() == 1


def test_mode_forces_either():
    x = torch.randn(12, 8)
    gate = make_gate(mode="batchwise").eval()
    assert gate(x).layout == "expert_choice"
    gate = make_gate(mode="threshold").train()
    r = gate(x)
    assert r.layout == "topk" and r.aux_loss.item() == 0.0


def test_stats_without_expert_and_over_k():
    gate = make_gate(E=4, k=1)
    x = torch.randn(16, 8)
    r = gate(x)
    mask = batchwise_mask(probs_of(gate, x), tokens_per_expert(16, 4, 1))
    counts = mask.sum(1)
    assert r.stats["tokens_without_expert"].item() == int((counts == 0).sum())
    assert r.stats["tokens_over_k"].item() == int((counts > 1).sum())
    assert int((r.experts >= 0).sum()) == 4 * 4  # E * m slots, none dropped


def test_aux_loss_is_weighted_eq20_and_trains_thresholds_and_router():
    gate = make_gate(threshold_loss_weight=0.5)
    x = torch.randn(20, 8)
    r = gate(x)
    probs = probs_of(gate, x)
    mask = batchwise_mask(probs.detach(), r.stats["m"])
    diff = threshold_mask(probs, gate.thresholds.detach()).float() - mask.float()
    expected = 0.5 * (diff * (probs - gate.thresholds[None])).sum()
    assert_close(r.aux_loss, expected)
    assert r.aux_loss.item() > 0
    r.aux_loss.backward()
    assert_close(gate.thresholds.grad, -0.5 * diff.sum(0))
    assert gate.w_gate.weight.grad is not None and gate.w_gate.weight.grad.abs().sum() > 0


def test_gate_values_get_gradients():
    gate = make_gate()
    r = gate(torch.randn(10, 8))
    r.expert_weights.pow(2).sum().backward()
    assert gate.w_gate.weight.grad.abs().sum() > 0


def test_empty_batch():
    gate = make_gate()
    r = gate(torch.randn(0, 8))
    assert r.expert_tokens.shape == (4, 0) and r.experts.shape == (0, 1)
    assert r.aux_loss.item() == 0.0
    gate.eval()
    assert gate(torch.randn(0, 8)).experts.shape == (0, 1)


def test_one_expert():
    gate = make_gate(E=1, k=1)
    r = gate(torch.randn(5, 8))
    assert r.expert_tokens.tolist() == [[0, 1, 2, 3, 4]]
    assert_close(r.weights, torch.ones(5, 1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_experts": 0}, "num_experts"),
        ({"k": 0}, "k"),
        ({"k": 5}, "k"),
        ({"mode": "topk"}, "mode"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"d_model": 8, "num_experts": 4, "k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        BatchwiseGate(**args)


def test_torch_compile():
    """The token view's width depends on the data (one sync), so the gate compiles with graph
    breaks, not fullgraph; the compiled gate gives the same routing."""
    gate = make_gate()
    x = torch.randn(12, 8)
    compiled = torch.compile(gate, backend="aot_eager")
    r1, r2 = compiled(x), gate(x)
    assert torch.equal(r1.expert_tokens, r2.expert_tokens)
    assert_close(r1.dense(), r2.dense())


@pytest.mark.parametrize("training", [True, False])
def test_routing_through_dropless_permute(training):
    """The gate's token view goes through main's dropless permute / unpermute (what the MoE layer
    will use) with nothing dropped: in training every expert gets exactly its m rows, in the
    expert lists' order, and the combined output equals the expert-choice sum computed directly."""
    from moe_kernels.ops import permute, unpermute

    gate = make_gate(E=4, k=2).train(training)
    x = torch.randn(19, 8)
    r = gate(x)
    x_sorted, offsets, order = permute(x, r.experts, 4)
    sizes = offsets.diff()
    assert int(sizes.sum()) == int((r.experts >= 0).sum())  # every chosen (token, expert) has a row
    if training:
        assert sizes.tolist() == [r.stats["m"]] * 4
        for e in range(4):  # rows of expert e, stable by token = its ascending token list
            rows = order[offsets[e] : offsets[e + 1]] // r.k
            assert torch.equal(rows, r.expert_tokens[e])
    w_exp = torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(0))
    y_sorted = torch.zeros(x_sorted.shape[0], 3)
    for e in range(4):
        y_sorted[offsets[e] : offsets[e + 1]] = x_sorted[offsets[e] : offsets[e + 1]] @ w_exp[e]
    y = unpermute(y_sorted, order, r.weights, 19)
    expected = torch.zeros(19, 3)
    dense = r.dense()
    for e in range(4):
        expected += dense[:, e : e + 1] * (x @ w_exp[e])
    assert_close(y, expected)
