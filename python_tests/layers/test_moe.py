"""MoE and HierarchicalMoE: eq 1 against a dense computation, capacity drops counted, dropless,
expert-choice routing, [..., d] input, masks, stats, training on a tiny task, bad arguments."""

import pytest
import torch
from tolerances import assert_close

from moe_kernels import HierarchicalMoE, MoE, NoisyTopKGate, TopKGate, losses
from moe_kernels.ops import capacity_for, capacity_positions
from moe_kernels.routing import Routing

D, E, H = 8, 5, 16


def randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def tokens(T=30, seed=1):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


def dense_moe(moe, x, routing):
    """Eq 1 computed densely: every expert on every token, weighted by G(x)."""
    G = routing.dense()  # [T, E]
    outs = torch.stack([moe.experts.forward_expert(e, x) for e in range(moe.num_experts)], 1)  # [T, E, d]
    return (G.unsqueeze(-1) * outs).sum(1)


def module_experts():
    return [torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.GELU(), torch.nn.Linear(H, D)) for _ in range(E)]


@pytest.mark.parametrize("capacity_factor", [100.0, None], ids=["capacity", "dropless"])
@pytest.mark.parametrize("expert_kind", ["batched", "modules"])
def test_eq1_against_dense(capacity_factor, expert_kind):
    experts = module_experts() if expert_kind == "modules" else None
    moe = randomise(MoE(D, E, H, k=2, capacity_factor=capacity_factor, experts=experts)).eval()
    x = tokens()
    y = moe(x)
    routing = moe.gate(x)
    assert_close(y, dense_moe(moe, x, routing), dtype=torch.float32)
    assert moe.stats["dropped_fraction"].item() == 0.0
    load = torch.bincount(routing.experts.reshape(-1), minlength=E)
    assert torch.equal(moe.stats["load"], load.float())
    assert_close(moe.stats["importance"], routing.dense().sum(0))
    assert_close(moe.stats["cv_load"], losses.cv_squared(load.float()).sqrt())
    assert_close(moe.stats["max_mean_load"], load.max() / load.float().mean())


def test_capacity_drops_are_counted():
    moe = randomise(MoE(D, E, H, k=2, capacity_factor=0.5)).eval()
    x = tokens(40)
    y = moe(x)
    routing = moe.gate(x)
    C = capacity_for(40, E, 2, 0.5, 1)
    positions, counts = capacity_positions(routing.experts, E, C)
    dropped = ((positions < 0) & (routing.experts >= 0)).sum().item()
    assert dropped > 0
    assert moe.stats["dropped_fraction"].item() == pytest.approx(dropped / 80)
    assert torch.equal(moe.stats["load"], counts.float())  # load is measured before the drops
    # The kept choices only: eq 1 with the dropped choices' gate values set to 0.
    kept = Routing(routing.experts, torch.where(positions >= 0, routing.weights, 0.0), E, routing.aux_loss)
    assert_close(y, dense_moe(moe, x, kept), dtype=torch.float32)


def test_leading_dims_and_mask():
    moe = randomise(MoE(D, E, H, k=2, capacity_factor=None)).eval()
    x = tokens(24).view(2, 3, 4, D)
    y = moe(x)
    assert y.shape == x.shape
    assert_close(y.view(-1, D), moe(x.view(-1, D)))
    mask = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(3)) < 0.6
    ym = moe(x, mask=mask)
    assert (ym[~mask] == 0).all()
    assert_close(ym[mask], y[mask])
    assert moe.stats["load"].sum().item() == 2 * mask.sum().item()


class FixedGate(torch.nn.Module):
    """A gate returning a Routing built by hand (how an expert-choice gate's output looks)."""

    def __init__(self, routing):
        super().__init__()
        self.routing = routing
        self.num_experts = routing.num_experts

    def forward(self, x, mask=None):
        return self.routing


def expert_choice_routing(T=6):
    # Expert e picked tokens expert_tokens[e] (-1 = unused slot); token 5 was picked by nobody.
    expert_tokens = torch.tensor([[0, 1], [1, 2], [3, -1], [0, 4], [2, 3]])
    expert_weights = torch.tensor([[0.5, 0.25], [0.75, 0.5], [1.0, 0.0], [0.5, 0.25], [0.5, 0.5]])
    # The token view of the same routing (k = the most experts any token got).
    experts = torch.full((T, 2), -1)
    weights = torch.zeros(T, 2)
    fill = [0] * T
    for e in range(E):
        for s in range(2):
            t = expert_tokens[e, s].item()
            if t >= 0:
                experts[t, fill[t]] = e
                weights[t, fill[t]] = expert_weights[e, s]
                fill[t] += 1
    return Routing(
        experts,
        weights,
        E,
        torch.zeros(()),
        layout="expert_choice",
        expert_tokens=expert_tokens,
        expert_weights=expert_weights,
    )


def test_expert_choice_routing():
    routing = expert_choice_routing()
    moe = randomise(MoE(D, E, H, gate=FixedGate(routing), capacity_factor=1.0)).eval()
    x = tokens(6)
    y = moe(x)
    assert_close(y, dense_moe(moe, x, routing), dtype=torch.float32)
    assert (y[5] == 0).all()
    assert torch.equal(moe.stats["load"], torch.tensor([2.0, 2.0, 1.0, 2.0, 2.0]))
    assert moe.stats["dropped_fraction"].item() == pytest.approx(1 / 6)  # token 5
    mask = torch.tensor([True, True, False, True, True, True])
    ym = moe(x, mask=mask)
    assert (ym[2] == 0).all()
    assert_close(ym[0], y[0])


def test_unknown_layout_is_an_error():
    routing = expert_choice_routing()
    routing.layout = "something_else"
    moe = MoE(D, E, H, gate=FixedGate(routing))
    with pytest.raises(ValueError, match="layout"):
        moe(tokens(6))


@pytest.mark.parametrize("gate_cls", [NoisyTopKGate, TopKGate])
@pytest.mark.parametrize("capacity_factor", [1.25, None], ids=["capacity", "dropless"])
def test_trains_on_a_tiny_task(gate_cls, capacity_factor):
    """Regression onto 4 different linear maps chosen by cluster: the MoE fits it."""
    torch.manual_seed(0)
    centers = torch.randn(4, D) * 3
    maps = torch.randn(4, D, D) / D**0.5
    moe = MoE(D, 4, H, gate=gate_cls(D, 4, 2), capacity_factor=capacity_factor)
    opt = torch.optim.Adam(moe.parameters(), lr=0.02)
    first = None
    for _ in range(60):
        label = torch.randint(0, 4, (64,))
        x = centers[label] + torch.randn(64, D)
        target = torch.einsum("td,tde->te", x, maps[label])
        loss = (moe(x) - target).pow(2).mean()
        first = loss.item() if first is None else first
        opt.zero_grad()
        (loss + moe.aux_loss).backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_eval_is_deterministic():
    moe = randomise(MoE(D, E, H, k=2)).eval()
    x = tokens()
    assert torch.equal(moe(x), moe(x))


def test_bad_arguments():
    with pytest.raises(ValueError, match="k"):
        MoE(D, E, H, k=E + 1)
    with pytest.raises(ValueError, match="k"):
        MoE(D, E, H, k=0)
    moe = MoE(D, E, H)
    with pytest.raises(ValueError, match="d_model"):
        moe(torch.randn(4, D + 1))
    with pytest.raises(ValueError, match="experts"):
        MoE(D, E, H, gate=NoisyTopKGate(D, E + 1, 2))
    with pytest.raises(ValueError, match="experts"):
        MoE(D, E, experts=module_experts()[:3])
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(D, E, H, capacity_factor=0.0)


def test_hierarchical_against_composition():
    hmoe = randomise(HierarchicalMoE(D, 3, 4, H, k_primary=2, k_secondary=2, capacity_factor=None)).eval()
    x = tokens(20)
    y = hmoe(x)
    G = hmoe.primary_gate(x).dense()  # [T, groups]
    groups = hmoe.groups.groups
    expected = sum(G[:, g : g + 1] * groups[g](x) for g in range(3))
    assert_close(y, expected, dtype=torch.float32)
    assert hmoe.stats["load"].sum().item() == 40
    assert len(hmoe.stats["groups"]) == 3


def test_hierarchical_trains_and_sums_losses():
    torch.manual_seed(0)
    hmoe = HierarchicalMoE(D, 2, 3, H, k_primary=1, k_secondary=2)
    opt = torch.optim.Adam(hmoe.parameters(), lr=0.03)
    x = torch.randn(32, D)
    target = torch.sin(x)
    first = None
    for _ in range(20):
        loss = (hmoe(x) - target).pow(2).mean()
        first = loss.item() if first is None else first
        opt.zero_grad()
        (loss + hmoe.aux_loss).backward()
        opt.step()
    assert loss.item() < 0.7 * first
    hmoe.eval()  # deterministic gates: the primary loss can be recomputed
    hmoe(x)
    total = hmoe.primary_gate(x).aux_loss + sum(g.aux_loss for g in hmoe.groups.groups)
    assert_close(hmoe.aux_loss, total)
