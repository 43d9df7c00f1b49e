"""BatchwiseGate inside moe_kernels.MoE: in training each expert's buffer is exactly [m, d] (no
capacity, no slot dropped), the output is sum_i G(x)_i E_i(x), the threshold loss reaches the
layer's aux_loss; in eval the thresholds route through the dropless path with nothing dropped."""

import torch
from tolerances import assert_close

from moe_kernels.gates import BatchwiseGate
from moe_kernels.gates.batchwise import tokens_per_expert
from moe_kernels.layers.moe import MoE


def make(capacity_factor=1.25):
    torch.manual_seed(0)
    gate = BatchwiseGate(8, 4, 2, threshold_loss_weight=0.1)
    return MoE(8, 4, d_hidden=16, gate=gate, k=2, capacity_factor=capacity_factor)


def direct(layer, x, routing):
    """sum_i G(x)_i E_i(x), every expert run on every token (the definition)."""
    dense = routing.dense()
    y = torch.zeros_like(x)
    for e in range(4):
        y += dense[:, e : e + 1] * layer.experts.forward_expert(e, x)
    return y


def test_training_exactly_m_per_expert_no_drops():
    layer = make().train()
    x = torch.randn(2, 11, 8)  # T = 22
    y = layer(x)
    m = tokens_per_expert(22, 4, 2)
    gate_stats = layer.stats["gate"]
    assert layer.stats["capacity"] == m  # each expert's buffer is [m, d]
    assert layer.stats["load"].tolist() == [float(m)] * 4
    # the layer counts tokens no expert picked as dropped: exactly the gate's tokens without expert
    assert int(round(layer.stats["dropped_fraction"].item() * 22)) == int(gate_stats["tokens_without_expert"])
    xf = x.reshape(-1, 8)
    routing = layer.gate(xf)
    assert_close(y.reshape(-1, 8), direct(layer, xf, routing))
    assert layer.aux_loss.item() > 0
    layer.aux_loss.backward()
    assert layer.gate.thresholds.grad is not None and layer.gate.thresholds.grad.abs().sum() > 0


def test_eval_thresholds_dropless():
    layer = make(capacity_factor=None).eval()
    with torch.no_grad():
        layer.gate.thresholds.fill_(0.2)
    x = torch.randn(30, 8)
    y = layer(x)
    assert layer.stats["dropped_fraction"].item() == 0.0
    assert layer.stats["gate"]["mode"] == "threshold"
    assert_close(y, direct(layer, x, layer.gate(x)))
    assert layer.aux_loss.item() == 0.0
