"""DSelectKGate: Routing contract, convergence, selected experts, regularisers."""

import pytest
import torch
from tolerances import assert_close

from moe_kernels import reference
from moe_kernels.gates import DSelectKGate


def binarise(gate, codes):
    """Set the static gate's Z so that selector i picks expert codes[i] (S(Z) binary)."""
    bits = (torch.tensor(codes)[:, None] >> torch.arange(gate.m)) & 1
    with torch.no_grad():
        gate.z.copy_(torch.where(bits == 1, gate.gamma, -gate.gamma))


def test_static_routing_matches_reference():
    torch.manual_seed(0)
    gate = DSelectKGate(6, 3, gamma=1.0)
    x = torch.randn(4, 5)
    routing = gate(x)
    expected = reference.dselect_k(gate.alpha, gate.z, 6, 1.0).expand(4, 6)
    assert_close(routing.dense(), expected)
    assert routing.num_experts == 6 and routing.experts.dtype == torch.int64


def test_initialisation_is_fractional():
    torch.manual_seed(1)
    for gate in (DSelectKGate(16, 4), DSelectKGate(5, 2, input_dim=8)):
        _, z = gate.parameters_for(torch.randn(64, 8))
        s = reference.smooth_step(z, gate.gamma)
        assert ((s > 0) & (s < 1)).float().mean() > 0.95  # per example: inputs beyond 3 sigma may saturate
        assert not gate.is_converged() if gate.static else not gate.is_converged(torch.randn(3, 8)).any()


def test_converged_static_gate_selects_at_most_k():
    gate = DSelectKGate(8, 3)
    binarise(gate, [5, 2, 5])  # two selectors agree: 2 distinct experts
    assert gate.is_converged()
    assert gate.selected_experts().tolist() == [5, 2, 5]
    routing = gate(torch.randn(7, 4))
    assert routing.k <= 3
    assert sorted(routing.experts[0][routing.experts[0] >= 0].tolist()) == [2, 5]
    p = torch.softmax(gate.alpha.detach(), -1)
    assert_close(routing.dense()[0], torch.zeros(8).index_add(0, torch.tensor([5, 2, 5]), p))
    assert routing.stats["converged"].all()
    # S'(Z) = 0: Z receives no gradient any more; alpha still does.
    routing.weights.sum().backward()
    assert torch.equal(gate.z.grad, torch.zeros_like(gate.z))


def test_unconverged_gate_routes_every_nonzero_expert():
    torch.manual_seed(2)
    gate = DSelectKGate(8, 2)
    routing = gate(torch.randn(3, 4))
    assert routing.k == 8 and (routing.experts >= 0).all()
    assert_close(routing.weights.sum(-1), torch.ones(3))


def test_non_expert_selection_reported_as_minus_one_and_lost_mass():
    gate = DSelectKGate(5, 2)  # m = 3: entries 5, 6, 7 are not experts
    binarise(gate, [6, 1])
    assert gate.selected_experts().tolist() == [-1, 1]
    routing = gate(torch.randn(2, 3))
    assert routing.experts[0].tolist() == [1]
    assert_close(routing.stats["non_expert_mass"], torch.tensor(0.5))  # one of two selectors
    assert_close(routing.aux_loss, torch.tensor(1.0))  # beta = 1 times the lost selector mass


def test_per_example_convergence_is_per_token():
    torch.manual_seed(3)
    gate = DSelectKGate(4, 2, input_dim=3, gamma=1.0)
    with torch.no_grad():
        gate.z_proj.weight.zero_()
        gate.z_proj.bias.zero_()
        gate.z_proj.weight[:, 0] = torch.tensor([5.0, -5.0, 5.0, 5.0])  # z = 5 x_0 (+-) per bit
    x = torch.tensor([[1.0, 0.3, 0.2], [0.01, 0.0, 1.0]])  # token 0: |z| = 5 (binary); token 1: 0.05
    assert gate.is_converged(x).tolist() == [True, False]
    routing = gate(x)
    assert (routing.experts[0] >= 0).sum() <= 2
    assert (routing.experts[1] >= 0).sum() == 4
    assert gate.selected_experts(x)[0].tolist() == [1, 3]  # bits (1, 0) -> 1, (1, 1) -> 3


def test_entropy_regulariser_and_b2_penalty_values():
    torch.manual_seed(4)
    gate = DSelectKGate(6, 3, entropy_weight=0.3, non_expert_weight=2.0)
    _, sel = reference.dselect_k(gate.alpha, gate.z, 6, 1.0, True)
    h = -(sel * sel.log()).sum(-1).sum()
    lost = sel[:, 6:].sum()
    assert_close(gate(torch.randn(2, 3)).aux_loss, 0.3 * h + 2.0 * lost)
    # n a power of two: no B.2 penalty, only the entropy.
    gate8 = DSelectKGate(8, 3, entropy_weight=0.3, non_expert_weight=2.0)
    _, sel8 = reference.dselect_k(gate8.alpha, gate8.z, 8, 1.0, True)
    assert_close(gate8(torch.randn(2, 3)).aux_loss, 0.3 * -(sel8 * sel8.log()).sum())


def test_entropy_drives_convergence():
    """Minimising only the entropy regulariser makes S(Z) binary (Section 3.1.3)."""
    torch.manual_seed(5)
    gate = DSelectKGate(16, 4, entropy_weight=1.0)
    opt = torch.optim.Adam(gate.parameters(), lr=0.05)
    x = torch.zeros(1, 1)
    for _ in range(300):
        opt.zero_grad()
        gate(x).aux_loss.backward()
        opt.step()
    assert gate.is_converged()
    assert gate(x).k <= 4


def test_b2_penalty_moves_mass_to_experts():
    torch.manual_seed(6)
    gate = DSelectKGate(5, 2, non_expert_weight=1.0)
    opt = torch.optim.Adam(gate.parameters(), lr=0.05)
    x = torch.zeros(1, 1)
    start = gate(x).stats["non_expert_mass"]
    for _ in range(100):
        opt.zero_grad()
        gate(x).aux_loss.backward()
        opt.step()
    assert gate(x).stats["non_expert_mass"] < 0.1 * start


def test_mask_and_empty_batch():
    torch.manual_seed(7)
    gate = DSelectKGate(4, 2, input_dim=3, entropy_weight=1.0)
    x = torch.randn(5, 3)
    mask = torch.tensor([True, False, True, True, False])
    routing = gate(x, mask=mask)
    assert (routing.experts[~mask] == -1).all() and (routing.weights[~mask] == 0).all()
    full = gate(x[mask])
    assert_close(routing.aux_loss, full.aux_loss)
    empty = gate(torch.empty(0, 3))
    assert empty.experts.shape[0] == 0 and empty.aux_loss.item() == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_experts": 0, "k": 1},
        {"num_experts": 4, "k": 0},
        {"num_experts": 4, "k": 2, "gamma": 0.0},
        {"num_experts": 4, "k": 2, "input_dim": 0},
        {"num_experts": 4, "k": 2, "entropy_weight": -1.0},
        {"num_experts": 4, "k": 2, "z_init": 1.0},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        DSelectKGate(**kwargs)


def test_bad_input():
    gate = DSelectKGate(4, 2, input_dim=3)
    with pytest.raises(ValueError, match="x must be"):
        gate(torch.randn(5, 4))
    with pytest.raises(ValueError, match="mask"):
        gate(torch.randn(5, 3), mask=torch.ones(4, dtype=torch.bool))


def test_sparse_evaluation_matches_dense_once_converged():
    """The Routing of a converged gate, evaluated through capacity_positions/dispatch/combine on only
    the selected experts, gives the dense MoE sum_e gates_e f_e(x) (what the layer will do)."""
    from moe_kernels.ops import capacity_positions, combine, dispatch

    torch.manual_seed(8)
    n, k, d, T = 6, 2, 5, 9
    gate = DSelectKGate(n, k, input_dim=d)
    with torch.no_grad():
        gate.z_proj.weight.mul_(0)
        gate.z_proj.bias.copy_(torch.tensor([3.0, -3.0, 3.0, -3.0, 3.0, -3.0]))  # binary: experts 5 and 2
    experts_w = torch.randn(n, d, d)
    x = torch.randn(T, d)
    assert gate.is_converged(x).all()
    routing = gate(x)
    assert routing.k <= k
    dense = torch.einsum("te,ted->td", gate.gates(x), torch.einsum("td,edf->tef", x, experts_w))
    positions, counts = capacity_positions(routing.experts, n, T * routing.k)
    buffer = dispatch(x, routing.experts, positions, n, T * routing.k)
    evaluated = [e for e in range(n) if counts[e] > 0]
    assert evaluated == [2, 5]  # only the selected experts run
    out = torch.zeros_like(buffer)
    for e in evaluated:
        out[e] = buffer[e] @ experts_w[e]
    assert_close(combine(out, routing.experts, positions, routing.weights), dense)
