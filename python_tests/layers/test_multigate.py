"""MultiGateMoE (DSelect-k paper, Figure 1 right) and DSelect-k inside MoE: every expert with a
nonzero gate value is evaluated before convergence; only the selected ones (at most k per token)
once S(Z) is binary, with the same output as the dense y = sum_i G(x)_i E_i(x)."""

import pytest
import torch
from tolerances import assert_close

from moe_kernels import MoE, MultiGateMoE, NoisyTopKGate, TopKGate
from moe_kernels.gates import BatchwiseGate, DSelectKGate
from moe_kernels.ops import capacity_for

D, E, H = 6, 5, 8


class Recording(torch.nn.Module):
    """A linear expert that records the rows it is applied to (to count expert evaluations)."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(D, D, generator=g) / D**0.5)
        self.seen = []

    def forward(self, rows):
        self.seen.append(rows.detach().clone())
        return torch.tanh(rows @ self.w)

    def rows(self):
        """Rows evaluated since the last reset, as [n, D] (the zero padding of capacity slots excluded)."""
        seen = torch.cat(self.seen) if self.seen else torch.empty(0, D)
        return seen[seen.abs().sum(-1) > 0]


def recording_experts(n=E):
    return [Recording(100 + e) for e in range(n)]


def tokens(T=12, seed=1):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def dense(experts, gates, x):
    """y = sum_i G(x)_i E_i(x), every expert on every token (recordings reset afterwards)."""
    outs = torch.stack([e(x) for e in experts], 1)  # [T, n, D]
    for e in experts:
        e.seen.clear()
    return (gates.unsqueeze(-1) * outs).sum(1)


def reset(experts):
    for e in experts:
        e.seen.clear()


def assert_evaluated_exactly(experts, gates, x):
    """Expert e saw exactly the tokens whose gate value for e is nonzero, once each."""
    for e, expert in enumerate(experts):
        want = x[gates[:, e] != 0]
        got = expert.rows()
        assert got.shape[0] == want.shape[0], f"expert {e}: {got.shape[0]} rows evaluated, {want.shape[0]} expected"
        key = lambda r: r[:, 0].argsort()  # noqa: E731 (row order differs between layouts)
        assert torch.equal(got[key(got)], want[key(want)])


# --- DSelect-k inside MoE ---------------------------------------------------------------------


def binarise_static(gate, codes):
    bits = (torch.tensor(codes)[:, None] >> torch.arange(gate.m)) & 1
    with torch.no_grad():
        gate.z.copy_(torch.where(bits == 1, gate.gamma, -gate.gamma))


def binarise_per_example(gate):
    """z_i = W_i x with a large W: S(z) binary for every token whose features are not tiny, and
    the selected experts depend on the token."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        gate.z_proj.weight.copy_(torch.randn(gate.z_proj.weight.shape, generator=g) * 50)
        gate.z_proj.bias.zero_()
        gate.alpha_proj.weight.copy_(torch.randn(gate.alpha_proj.weight.shape, generator=g))


# capacity_factor = n: C = T * width, room for every choice even when all tokens pick the same
# experts (the static gate does; see the drop test below).
@pytest.mark.parametrize("capacity_factor", [None, 6.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("kind", ["static", "per_example", "partial"])
def test_dselect_unconverged_evaluates_every_nonzero_expert(kind, capacity_factor):
    torch.manual_seed(0)
    n, k = 6, 2
    gate = DSelectKGate(n, k, input_dim=D if kind == "per_example" else None)
    if kind == "partial":  # selector 0 binary (expert 3), selector 1 binary in bit 0 only: odd experts
        with torch.no_grad():
            gate.z.copy_(torch.tensor([[1.0, 1.0, -1.0], [1.0, 0.1, -0.2]]))
    experts = recording_experts(n)
    moe = MoE(D, n, gate=gate, experts=experts, capacity_factor=capacity_factor)
    x = tokens()
    G = gate.gates(None if gate.static else x).detach().expand(x.shape[0], n)
    want = dense(experts, G, x)
    y = moe(x)
    assert_close(y, want)
    assert_evaluated_exactly(experts, G, x)
    nonzero = (G != 0).sum(-1)
    if kind == "partial":
        assert nonzero.tolist() == [3] * x.shape[0]  # experts 1, 3, 5 (7 is not an expert)
    else:
        assert (nonzero == n).all()
    assert moe.stats["dropped_fraction"].item() == 0.0


# capacity_factor = n: C = T * width, room for every choice even when all tokens pick the same
# experts (the static gate does; see the drop test below).
@pytest.mark.parametrize("capacity_factor", [None, 6.0], ids=["dropless", "capacity"])
@pytest.mark.parametrize("kind", ["static", "per_example"])
def test_dselect_converged_evaluates_only_selected_experts(kind, capacity_factor):
    torch.manual_seed(1)
    n, k, T = 6, 2, 16
    gate = DSelectKGate(n, k, input_dim=D if kind == "per_example" else None)
    if kind == "static":
        binarise_static(gate, [4, 1])
    else:
        binarise_per_example(gate)
    experts = recording_experts(n)
    moe = MoE(D, n, gate=gate, experts=experts, capacity_factor=capacity_factor, min_capacity=1)
    x = tokens(T, seed=2)
    assert gate.is_converged(x).all() if kind == "per_example" else gate.is_converged()
    selected = gate.selected_experts(None if gate.static else x).expand(T, k)
    G = gate.gates(None if gate.static else x).detach().expand(T, n)
    # The gate's support is exactly the selected experts (no -1 here: n = 6, m = 3; the per-example
    # gate may pick a non-expert code, which then carries no weight and runs nothing).
    support = torch.zeros(T, n, dtype=torch.bool)
    for t in range(T):
        support[t, selected[t][selected[t] >= 0]] = True
    assert torch.equal(G != 0, support)
    want = dense(experts, G, x)
    y = moe(x)
    assert_close(y, want)
    assert_evaluated_exactly(experts, G, x)
    evaluations = sum(e.rows().shape[0] for e in experts)
    assert evaluations == int(support.sum()) <= k * T
    if kind == "static":
        assert [e for e in range(n) if experts[e].rows().shape[0]] == [1, 4]
    else:
        assert len({tuple(s.tolist()) for s in selected}) > 1  # tokens really route differently
    if capacity_factor is not None:  # the dispatch buffer is sized by k, not by n
        width = moe.gate(x).k
        assert width <= k and moe.stats["capacity"] == capacity_for(T, n, width, capacity_factor, 1)


def test_static_dselect_with_balanced_capacity_counts_drops():
    """A static gate sends every token to the same k experts, so a capacity sized for a balanced
    load (factor 1.25) drops most choices: counted in stats, the dropped choices contribute 0."""
    n, T = 6, 16
    gate = DSelectKGate(n, 2)
    binarise_static(gate, [4, 1])
    experts = recording_experts(n)
    moe = MoE(D, n, gate=gate, experts=experts, capacity_factor=1.25)
    x = tokens(T, seed=2)
    want = dense(experts, gate.gates().detach().expand(T, n), x)
    y = moe(x)
    C = capacity_for(T, n, 2, 1.25, 1)
    assert C == 7 and moe.stats["capacity"] == C
    assert moe.stats["dropped_fraction"].item() == pytest.approx(2 * (T - C) / (2 * T))
    assert_close(y[:C], want[:C])  # slots go in token order: the first C tokens keep both experts
    assert (y[C:] == 0).all()
    assert [experts[e].rows().shape[0] for e in range(n)] == [0, C, 0, 0, C, 0]


def test_dselect_converged_gradients_match_dense():
    """Sparse evaluation changes no gradient: alpha and the experts get the dense formula's."""
    torch.manual_seed(3)
    n, k = 6, 3
    gate = DSelectKGate(n, k)
    binarise_static(gate, [0, 5, 0])
    experts = recording_experts(n)
    moe = MoE(D, n, gate=gate, experts=experts, capacity_factor=None)
    x = tokens(10, seed=4)
    moe(x).square().sum().backward()
    sparse = [gate.alpha.grad.clone()] + [
        e.w.grad.clone() if e.w.grad is not None else torch.zeros(D, D) for e in experts
    ]
    moe.zero_grad(set_to_none=True)
    G = gate.gates().expand(10, n)
    (G.unsqueeze(-1) * torch.stack([e(x) for e in experts], 1)).sum(1).square().sum().backward()
    dense_grads = [gate.alpha.grad] + [e.w.grad for e in experts]
    for a, b in zip(sparse, dense_grads):
        assert_close(a, b)


# --- MultiGateMoE -----------------------------------------------------------------------------


def task_gates():
    torch.manual_seed(6)
    return [TopKGate(D, E, 2), DSelectKGate(E, 2, input_dim=D), DSelectKGate(E, 3), NoisyTopKGate(D, E, 1)]


@pytest.mark.parametrize("capacity_factor", [None, 100.0], ids=["dropless", "capacity"])
def test_multigate_outputs_are_per_task_eq1(capacity_factor):
    experts = recording_experts()
    # + an expert-choice task (BatchwiseGate: layout "expert_choice", no mask argument).
    gates = task_gates() + [BatchwiseGate(D, E, 2, mode="batchwise")]
    mg = MultiGateMoE(D, E, gates, experts=experts, capacity_factor=capacity_factor).eval()
    x = tokens(14).view(2, 7, D)
    ys = mg(x)
    assert mg.stats["tasks"][4]["capacity"] == 6  # m = ceil(k T / E) tokens per expert
    assert len(ys) == mg.num_tasks == 5 and all(y.shape == x.shape for y in ys)
    xf = x.reshape(-1, D)
    loads = []
    for gate, y, stats in zip(mg.gates, ys, mg.stats["tasks"]):
        routing = gate(xf)
        assert_close(y.reshape(-1, D), dense(experts, routing.dense().detach(), xf))
        load = torch.bincount(routing.experts[routing.experts >= 0], minlength=E).float()
        assert torch.equal(stats["load"], load)
        loads.append(load)
    assert torch.equal(mg.stats["load"], sum(loads))
    assert_close(mg.aux_loss, sum(g(xf).aux_loss for g in mg.gates))
    # The experts are shared: one set of parameters, not one per task.
    assert sum(p.numel() for p in mg.experts.parameters()) == E * D * D


def test_multigate_gradients_reach_shared_experts_and_only_own_gate():
    mg = MultiGateMoE(D, E, task_gates(), experts=recording_experts(), capacity_factor=None)
    x = tokens(9)
    ys = mg(x)
    ys[1].sum().backward()
    assert all(p.grad is None for p in mg.gates[0].parameters())
    assert all(p.grad is None for p in mg.gates[2].parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in mg.gates[1].parameters())
    mg.zero_grad(set_to_none=True)
    ys = mg(x)
    (ys[0].sum() + ys[2].sum()).backward()
    y0_only = MultiGateMoE(D, E, [mg.gates[0]], experts=list(mg.experts.experts), capacity_factor=None)
    # Expert gradients add over tasks: equal to the sum of the two tasks' separate gradients.
    total = [e.w.grad.clone() for e in mg.experts.experts]
    for expert in mg.experts.experts:
        expert.w.grad = None
    y0_only(x)[0].sum().backward()
    g0 = [e.w.grad.clone() for e in mg.experts.experts]
    for expert in mg.experts.experts:
        expert.w.grad = None
    MultiGateMoE(D, E, [mg.gates[2]], experts=list(mg.experts.experts), capacity_factor=None)(x)[0].sum().backward()
    for t, a, b in zip(total, g0, [e.w.grad for e in mg.experts.experts]):
        assert_close(t, a + b)


def test_multigate_mask_empty_batch_and_default_experts():
    mg = MultiGateMoE(D, E, task_gates(), d_hidden=H, capacity_factor=None).eval()
    x = tokens(10)
    mask = torch.tensor([True, False] * 5)
    ys, full = mg(x, mask=mask), mg(x)
    for y, f in zip(ys, full):
        assert (y[~mask] == 0).all()
        assert_close(y[mask], f[mask])
    empty = mg(torch.empty(2, 0, D))
    assert [y.shape for y in empty] == [(2, 0, D)] * 4 and (mg.stats["load"] == 0).all()


def test_multigate_bad_arguments():
    with pytest.raises(ValueError, match="gates"):
        MultiGateMoE(D, E, [], d_hidden=H)
    with pytest.raises(ValueError, match="gates"):
        MultiGateMoE(D, E, TopKGate(D, E, 2), d_hidden=H)  # one module, not a list
    with pytest.raises(ValueError, match=r"gates\[1\]"):
        MultiGateMoE(D, E, [TopKGate(D, E, 2), DSelectKGate(E + 1, 2)], d_hidden=H)
    mg = MultiGateMoE(D, E, [TopKGate(D, E, 2)], d_hidden=H)
    with pytest.raises(ValueError, match="x must be"):
        mg(torch.randn(3, D + 1))
    with pytest.raises(ValueError, match="mask"):
        mg(torch.randn(3, D), mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="task gates"):
        mg.shared(torch.randn(3, D))


def test_multigate_dselect_tasks_learn_their_own_experts():
    """Two tasks, frozen shared experts, task t's target made by expert (1, 3)[t]: training only the
    static DSelect-k gates (k = 1) makes each converge (S(Z) binary) onto its task's expert; the
    shared experts then run only where a task selected them (15 steps at this seed; 300 allowed)."""
    torch.manual_seed(0)
    experts = recording_experts(4)
    for e in experts:
        e.w.requires_grad_(False)
    gates = [DSelectKGate(4, 1), DSelectKGate(4, 1)]
    mg = MultiGateMoE(D, 4, gates, experts=experts, capacity_factor=None)
    opt = torch.optim.Adam([p for g in gates for p in g.parameters()], lr=0.05)
    x = tokens(64, seed=1)
    with torch.no_grad():
        targets = [experts[1](x), experts[3](x)]
    for _ in range(300):
        loss = sum((y - t).square().mean() for y, t in zip(mg(x), targets)) + mg.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if all(g.is_converged() for g in gates):
            break
    assert [g.is_converged() for g in gates] == [True, True]
    assert [g.selected_experts().tolist() for g in gates] == [[1], [3]]
    reset(experts)
    ys = mg(x)
    for y, t in zip(ys, targets):
        assert_close(y, t)
    assert [e.rows().shape[0] for e in experts] == [0, 64, 0, 64]
    assert mg.stats["load"].tolist() == [0.0, 64.0, 0.0, 64.0]
