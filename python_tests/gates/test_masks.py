"""Gates whose routing couples the tokens (batchwise top-m, balanced assignment, Sinkhorn) accept
mask= inside MoE(x, mask=...): padding tokens are not routed, and the real tokens are routed, and
their outputs computed, exactly as if the padding were not there."""

import pytest
import torch

import moe_kernels
from moe_kernels.gates import BalancedAssignmentGate, BatchwiseGate, SinkhornGate

D, E = 8, 4

GATES = {
    "batchwise_train": (lambda: BatchwiseGate(D, E, 2), True),
    "batchwise_eval": (lambda: BatchwiseGate(D, E, 2), False),
    "balanced_assignment_eval": (lambda: BalancedAssignmentGate(D, E), False),
    "sinkhorn": (lambda: SinkhornGate(D, E), False),
}


@pytest.mark.parametrize("name", list(GATES))
def test_padding_is_not_routed(name):
    make, training = GATES[name]
    torch.manual_seed(0)
    moe = moe_kernels.MoE(D, E, 16, gate=make(), capacity_factor=None)
    moe.train(training)
    x = torch.randn(2, 10, D)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, 7:] = False
    mask[1, 4:] = False
    flat_x, flat_mask = x.reshape(-1, D), mask.reshape(-1)

    routing = moe.gate(flat_x, mask=flat_mask)
    assert (routing.experts[~flat_mask] == -1).all() and (routing.weights[~flat_mask] == 0).all()
    alone = moe.gate(flat_x[flat_mask])
    assert torch.equal(routing.experts[flat_mask], alone.experts)
    torch.testing.assert_close(routing.weights[flat_mask], alone.weights)
    if routing.expert_tokens is not None:  # expert choice: the same tokens, by their full index
        index = flat_mask.nonzero().squeeze(1)
        expected = torch.where(alone.expert_tokens >= 0, index[alone.expert_tokens.clamp(min=0)], -1)
        assert torch.equal(routing.expert_tokens, expected)

    y = moe(x, mask=mask)
    y_alone = moe(flat_x[flat_mask])
    torch.testing.assert_close(y.reshape(-1, D)[flat_mask], y_alone)
    y.sum().backward()  # differentiable through the masked route
