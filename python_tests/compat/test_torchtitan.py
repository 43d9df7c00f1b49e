"""moe_kernels.compat.torchtitan.TokenChoiceTopKRouter against a transcription of torchtitan's.

`TitanRouter` below was written from pytorch/torchtitan's torchtitan/models/common/moe.py at
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (TokenChoiceTopKRouter: __init__, forward,
_get_node_limited_routing_scores, _debug_force_load_balance_routing), with a plain nn.Linear as
its gate and `tk` standing for torch.topk: `torch.topk` itself, or `pinned_topk` (equal values to
the lower index, sorted) where torchtitan's result depends on torch.topk's unspecified tie order.
"""

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F
from tolerances import TOL, assert_close
from torch import nn

import moe_kernels
from moe_kernels.compat import TokenChoiceTopKRouter
from moe_kernels.compat.torchtitan import Linear

# The transcription's float32 autocast warns on CPU (torch disables it there), as torchtitan's does.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")


def pinned_topk(x, k, dim=-1, sorted=True):
    """torch.topk with equal values to the lower index, sorted by descending value."""
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


class TitanRouter(nn.Module):
    """Transcription of torchtitan's TokenChoiceTopKRouter at b5bcd76c (gate: nn.Linear)."""

    def __init__(
        self,
        gate,
        num_experts,
        num_expert_groups=None,
        num_limited_groups=None,
        top_k=1,
        score_func="sigmoid",
        route_norm=False,
        route_scale=1.0,
        _debug_force_load_balance=False,
        tk=torch.topk,
    ):
        super().__init__()
        self.gate = gate
        self.num_experts = num_experts
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self._debug_force_load_balance = _debug_force_load_balance
        self.tk = tk

    def _debug_force_load_balance_routing(self, scores_TE):
        num_tokens = scores_TE.shape[0]
        topk_expert_ids_TK = (
            torch.arange(num_tokens * self.top_k, device=scores_TE.device, dtype=torch.int64).reshape(
                num_tokens, self.top_k
            )
            % self.num_experts
        )
        topk_scores_TK = scores_TE.gather(dim=-1, index=topk_expert_ids_TK)
        return topk_expert_ids_TK, topk_scores_TK

    def _get_node_limited_routing_scores(self, scores_for_choice_TE):
        if self.num_limited_groups is None:
            raise ValueError("num_limited_groups must be set when num_expert_groups is set")
        assert self.num_expert_groups is not None
        if self.num_experts % self.num_expert_groups != 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by num_expert_groups ({self.num_expert_groups})"
            )
        experts_per_group = self.num_experts // self.num_expert_groups
        if experts_per_group < 2:
            raise ValueError(f"experts_per_group ({experts_per_group}) must be >= 2")
        scores_grouped = scores_for_choice_TE.unflatten(-1, (self.num_expert_groups, experts_per_group))
        top2_scores_in_group, _ = self.tk(scores_grouped, 2, dim=-1)
        group_scores = top2_scores_in_group.sum(dim=-1)
        _, group_idx = self.tk(group_scores, k=self.num_limited_groups, dim=-1, sorted=False)
        group_mask = torch.ones_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(-1, group_idx, False)
        scores_for_choice_TE = scores_grouped.masked_fill(group_mask.unsqueeze(-1), float("-inf")).flatten(-2)
        return scores_for_choice_TE

    def forward(self, x_TD, expert_bias_E=None):
        with torch.autocast(device_type=x_TD.device.type, dtype=torch.float32):
            scores_TE = self.gate(x_TD)
        if self.score_func == "sigmoid":
            scores_TE = torch.sigmoid(scores_TE)
        elif self.score_func == "softmax":
            scores_TE = F.softmax(scores_TE, dim=-1)
        else:
            raise NotImplementedError(f"Unknown score function {self.score_func}")
        scores_for_choice_TE = scores_TE if expert_bias_E is None else scores_TE + expert_bias_E
        if self.num_expert_groups is not None:
            scores_for_choice_TE = self._get_node_limited_routing_scores(scores_for_choice_TE)
        self.last_choice = scores_for_choice_TE.detach()
        _, topk_expert_ids_TK = self.tk(scores_for_choice_TE, k=self.top_k, dim=-1, sorted=False)
        topk_scores_TK = scores_TE.gather(dim=-1, index=topk_expert_ids_TK)
        if self._debug_force_load_balance:
            (topk_expert_ids_TK, topk_scores_TK) = self._debug_force_load_balance_routing(scores_TE)
        if self.route_norm:
            denominator = topk_scores_TK.sum(dim=-1, keepdim=True) + 1e-20
            topk_scores_TK = topk_scores_TK / denominator
        topk_scores_TK = topk_scores_TK * self.route_scale
        return topk_scores_TK, topk_expert_ids_TK, scores_TE


T, D, E = 40, 24, 32


def _config_id(sf, k, norm, scale, groups, bias):
    limit = f"g{groups['num_limited_groups']}of{groups['num_expert_groups']}" if groups else "nogroups"
    return f"{sf}-k{k}-norm{int(norm)}-scale{scale}-{limit}-{'bias' if bias else 'nobias'}"


CONFIGS = [
    pytest.param(
        dict(score_func=sf, route_norm=norm, route_scale=scale, top_k=k, **groups),
        bias,
        id=_config_id(sf, k, norm, scale, groups, bias),
    )
    for sf in ("sigmoid", "softmax")
    for norm, scale in ((False, 1.0), (True, 2.5))
    for k in (1, 4)
    for groups in (
        {},
        {"num_expert_groups": 8, "num_limited_groups": 3},
        {"num_expert_groups": 8, "num_limited_groups": 8},
    )
    for bias in (False, True)
]


def pair(config, seed, dtype=torch.float32, tk=torch.topk, gate_in=D):
    """Our router and the transcription with the same gate weights."""
    ours = TokenChoiceTopKRouter(
        TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=gate_in, out_features=E), **config)
    )
    with torch.no_grad():
        ours.gate.weight.copy_(torch.randn(E, gate_in, generator=torch.Generator().manual_seed(seed)) / gate_in**0.5)
    ours = ours.to(dtype)
    theirs = TitanRouter(nn.Linear(gate_in, E, bias=False), E, tk=tk, **config).to(dtype)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def by_expert(ids, scores):
    """Rows sorted by expert id: torchtitan's sorted=False leaves the order of the k unspecified."""
    order = ids.argsort(dim=1)
    return ids.gather(1, order), scores.gather(1, order)


def exact_selection(config, bias):
    """No bias and no group limit: topk_router ranks by the logits, which order the scores the same
    way, so the selection is exactly torchtitan's. Otherwise the choice values go through exp, whose
    last bit may differ between torch and our kernel: rows with a near tie may route differently."""
    limited = config.get("num_expert_groups") and config["num_limited_groups"] < config["num_expert_groups"]
    return bias is None and not limited


def near_tie_rows(scores_TE, bias, config):
    choice = scores_TE.float() + (0 if bias is None else bias)
    rows = [choice]
    if config.get("num_expert_groups"):
        top2 = choice.view(choice.shape[0], config["num_expert_groups"], -1).sort(dim=-1, descending=True).values
        rows.append(top2[..., :2].sum(-1))
    near = torch.zeros(choice.shape[0], dtype=torch.bool)
    for v in rows:
        s = v.sort(dim=-1).values
        near |= ((s[:, 1:] - s[:, :-1]) < 1e-6).any(dim=1)
    return near


def call(backend, router, *args):
    with moe_kernels.use_backend(backend):
        return router(*args)


@pytest.mark.parametrize("config, bias", CONFIGS)
def test_router_matches_torchtitan_random(backend, config, bias):
    ours, theirs = pair(config, seed=config["top_k"])
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    b = 0.05 * torch.randn(E, generator=torch.Generator().manual_seed(2)) if bias else None
    scores, ids, scores_TE = call(backend, ours, x, b)
    want_scores, want_ids, want_TE = theirs(x, b)
    assert ids.dtype == torch.int64 and scores.dtype == torch.float32 and ids.shape == (T, config["top_k"])
    assert torch.equal(scores_TE, want_TE)
    ids_s, scores_s = by_expert(ids, scores)
    want_ids_s, want_scores_s = by_expert(want_ids, want_scores)
    same = (ids_s == want_ids_s).all(dim=1)
    if exact_selection(config, b):
        assert bool(same.all()), f"experts differ on rows {(~same).nonzero().flatten().tolist()}"
    else:
        near = near_tie_rows(want_TE.detach(), b, config)
        assert bool((same | near).all()) and float(near.float().mean()) < 0.5
    assert_close(scores_s[same], want_scores_s[same])
    # Our experts come by descending choice value (torchtitan's order is unspecified).
    choice = scores_TE.detach() + (0 if b is None else b)
    assert bool((choice.gather(1, ids).diff(dim=1) <= 0).all())
    # Gradients wrt the input and the router weight (the scores of the chosen experts and the full
    # scores both carry them); compared on the rows routed alike.
    w = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    v = torch.randn(T, E, generator=torch.Generator().manual_seed(4))
    mask = same.float().unsqueeze(1)
    loss = ((scores * w.gather(1, ids)) * mask).sum() + (scores_TE * v).sum()
    want_loss = ((want_scores * w.gather(1, want_ids)) * mask).sum() + (want_TE * v).sum()
    gx, gw = torch.autograd.grad(loss, (x, ours.gate.weight))
    want_gx, want_gw = torch.autograd.grad(want_loss, (x, theirs.gate.weight))
    assert_close(gx, want_gx)
    assert_close(gw, want_gw)


def tied_logits(seed):
    """[T, E] logits with few distinct values: many exact ties, no accidental near ties."""
    levels = torch.randint(0, 5, (T, E), generator=torch.Generator().manual_seed(seed))
    return 0.7 * levels + 0.1


@pytest.mark.parametrize("config, bias", CONFIGS)
def test_router_ties_to_the_lower_index(backend, config, bias):
    # Identity gate: x is the logits, and its gradient the gradient wrt the logits.
    ours, theirs = pair(config, seed=0, tk=pinned_topk, gate_in=E)
    with torch.no_grad():
        ours.gate.weight.copy_(torch.eye(E))
        theirs.gate.weight.copy_(torch.eye(E))
    x = tied_logits(config["top_k"]).requires_grad_()
    # One bias per group of 4 experts (a bias varying within a group makes groups with swapped
    # biases tie in exact arithmetic only).
    b = 0.25 * ((torch.arange(E) // 4) % 2).float() if bias else None
    scores, ids, scores_TE = call(backend, ours, x, b)
    want_scores, want_ids, want_TE = theirs(x, b)
    assert torch.equal(ids, want_ids)
    assert_close(scores, want_scores)
    g = torch.randn(T, config["top_k"], generator=torch.Generator().manual_seed(5))
    grad = torch.autograd.grad((scores * g).sum() + scores_TE.sum(), x)[0]
    assert_close(grad, torch.autograd.grad((want_scores * g).sum() + want_TE.sum(), x)[0])


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_router_bf16_gate(backend, score_func):
    # On CPU the float32 autocast is off: torchtitan's scores are bf16 and ties among them are
    # frequent; ours select on the float32 scores of the bf16 logits. Rows with equal bf16 choice
    # values at the k-th place are the only ones allowed to differ.
    config = dict(score_func=score_func, top_k=4, route_norm=True)
    ours, theirs = pair(config, seed=7, dtype=torch.bfloat16, tk=pinned_topk)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8)).bfloat16()
    b = 0.05 * torch.randn(E, generator=torch.Generator().manual_seed(9))
    for bias in (None, b):
        scores, ids, scores_TE = call(backend, ours, x, bias)
        want_scores, want_ids, want_TE = theirs(x, bias)
        assert scores_TE.dtype == torch.bfloat16 and scores.dtype == torch.bfloat16
        assert torch.equal(scores_TE, want_TE)
        ranked = theirs.last_choice.sort(dim=1, descending=True).values
        # With a bias the choice adds float32 to bf16 scores: a gap within two bf16 ulps (of a
        # score below 1) may then be ordered otherwise by the float32 scores.
        boundary_tie = (ranked[:, 3] - ranked[:, 4]).abs() <= (8e-3 if bias is not None else 0)
        # Equal bf16 values inside the top k may also be ordered otherwise: compare by expert.
        (ids, scores), (want_ids, want_scores) = by_expert(ids, scores), by_expert(want_ids, want_scores)
        same = (ids == want_ids).all(dim=1)
        assert bool((same | boundary_tie).all())
        torch.testing.assert_close(scores[same], want_scores[same], **TOL[torch.bfloat16])


def test_debug_force_load_balance(backend):
    config = dict(top_k=3, route_norm=True, route_scale=1.5, _debug_force_load_balance=True)
    ours, theirs = pair(config, seed=4)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(6))
    got, want = call(backend, ours, x), theirs(x)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_config_and_construction():
    # torchtitan's Config fields and defaults at b5bcd76c.
    fields = {f.name: f.default for f in dataclasses.fields(TokenChoiceTopKRouter.Config)}
    expected = {
        "num_experts": dataclasses.MISSING,
        "gate": dataclasses.MISSING,
        "num_expert_groups": None,
        "num_limited_groups": None,
        "top_k": 1,
        "score_func": "sigmoid",
        "route_norm": False,
        "route_scale": 1.0,
        "_debug_force_load_balance": False,
    }
    assert {k: fields[k] for k in expected} == expected
    with pytest.raises(TypeError):
        TokenChoiceTopKRouter.Config(E, Linear.Config(in_features=D, out_features=E))  # kw_only, as theirs
    router = TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=D, out_features=E)).build()
    assert isinstance(router.gate, nn.Linear) and router.gate.bias is None
    assert list(router.state_dict()) == ["gate.weight"]
    assert (router.top_k, router.score_func, router.route_norm, router.route_scale) == (1, "sigmoid", False, 1.0)
    # A config read by attribute (torchtitan's own Config works the same way).
    duck = types.SimpleNamespace(
        num_experts=E,
        gate=types.SimpleNamespace(build=lambda: nn.Linear(D, E, bias=False)),
        num_expert_groups=None,
        num_limited_groups=None,
        top_k=2,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        _debug_force_load_balance=False,
    )
    out = TokenChoiceTopKRouter(duck)(torch.randn(5, D))
    assert [tuple(t.shape) for t in out] == [(5, 2), (5, 2), (5, E)]


def test_bad_configs():
    gate = Linear.Config(in_features=D, out_features=E)
    Config = TokenChoiceTopKRouter.Config
    with pytest.raises(ValueError, match="num_limited_groups must be set"):
        Config(num_experts=E, gate=gate, num_expert_groups=4).build()
    with pytest.raises(ValueError, match="must be divisible by num_expert_groups"):
        Config(num_experts=E, gate=gate, num_expert_groups=5, num_limited_groups=2).build()
    with pytest.raises(ValueError, match="experts_per_group"):
        Config(num_experts=E, gate=gate, num_expert_groups=32, num_limited_groups=2).build()
    with pytest.raises(ValueError, match="num_limited_groups"):
        Config(num_experts=E, gate=gate, num_expert_groups=8, num_limited_groups=9).build()
    with pytest.raises(ValueError, match="top_k"):
        Config(num_experts=E, gate=gate, top_k=9, num_expert_groups=8, num_limited_groups=2).build()
    with pytest.raises(ValueError, match="top_k"):
        Config(num_experts=E, gate=gate, top_k=E + 1).build()
    with pytest.raises(NotImplementedError, match="Unknown score function"):
        Config(num_experts=E, gate=gate, score_func="relu").build()
    with pytest.raises(ValueError, match="gate must give"):
        Config(num_experts=E, gate=Linear.Config(in_features=D, out_features=E - 1)).build()(torch.randn(3, D))
