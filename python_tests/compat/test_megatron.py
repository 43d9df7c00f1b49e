"""moe_kernels.compat.megatron against transcriptions of Megatron-Core's own functions.

The transcriptions below were written from NVIDIA/Megatron-LM's
megatron/core/transformer/moe/moe_utils.py:
- at d98e8a64ddf34856e74b24714e3bedb2f5a39553: get_capacity, group_limited_topk,
  topk_routing_with_score_function (its unfused path, without router_replay and
  precomputed_indices), apply_router_token_dropping;
- at 0d3368255c59b2e4ed666721682ca779e20526e3 (the last commit with it): topk_softmax_with_capacity.
Each takes `tk`, standing for torch.topk: `torch.topk` itself, or `pinned_topk` (equal values to the
lower index) where Megatron's result depends on torch.topk's unspecified tie order.
"""

import math

import pytest
import torch
from tolerances import TOL, assert_close

import moe_kernels
from moe_kernels.compat import (
    apply_router_token_dropping,
    get_capacity,
    topk_routing_with_score_function,
    topk_softmax_with_capacity,
)
from moe_kernels.ops import capacity_for


def pinned_topk(x, k, dim=-1, sorted=True):
    """torch.topk with equal values to the lower index (NaN first, as torch.topk ranks it)."""
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


# ---- Transcription of moe_utils.py at d98e8a64 ----------------------------------------------------


def mt_get_capacity(num_tokens, num_experts, capacity_factor, min_capacity=None):
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def mt_group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk, tk=torch.topk):
    group_scores = tk(scores.view(num_tokens, num_groups, -1), topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = tk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)
    )
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    probs, top_indices = tk(masked_scores, k=topk, dim=-1)
    return probs, top_indices


def mt_topk_routing_with_score_function(
    logits,
    topk,
    use_pre_softmax=False,
    num_groups=None,
    group_topk=None,
    scaling_factor=None,
    score_function="softmax",
    expert_bias=None,
    dense_output=False,
    tk=torch.topk,
):
    num_tokens, num_experts = logits.shape

    def compute_topk(scores, topk, num_groups=None, group_topk=None):
        if group_topk:
            return mt_group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk, tk)
        return tk(scores, k=topk, dim=1, sorted=torch.is_grad_enabled())

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
            probs, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        else:
            scores, top_indices = compute_topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:
            scores_for_routing = scores + expert_bias.float()
            _, top_indices = compute_topk(scores_for_routing, topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=top_indices)
        else:
            scores, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"Invalid score_function: {score_function}")
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    if dense_output:
        return probs, top_indices
    routing_probs = torch.zeros_like(logits).scatter(1, top_indices, probs)
    routing_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    return routing_probs, routing_map


def mt_apply_router_token_dropping(
    routing_probs, routing_map, router_topk, capacity_factor, drop_policy="probs", pad_to_capacity=False, tk=torch.topk
):
    num_tokens, num_experts = routing_probs.shape
    expert_capacity = mt_get_capacity(
        num_tokens=num_tokens * router_topk, num_experts=num_experts, capacity_factor=capacity_factor
    )
    if expert_capacity > num_tokens:
        capacity_mask = torch.ones_like(routing_probs).bool()
    else:
        if drop_policy == "probs":
            _, capacity_indices = tk(routing_probs, k=expert_capacity, dim=0, sorted=False)
        elif drop_policy == "position":
            _, capacity_indices = tk(routing_map.int(), k=expert_capacity, dim=0, sorted=False)
        else:
            raise ValueError(f"Invalid drop_policy: {drop_policy}")
        capacity_mask = torch.zeros_like(routing_probs).scatter(0, capacity_indices, 1).bool()
    if pad_to_capacity:
        final_map = capacity_mask
    else:
        final_map = torch.logical_and(routing_map, capacity_mask)
    return routing_probs * final_map, final_map


# ---- Transcription of topk_softmax_with_capacity at 0d336825 --------------------------------------


def mt_topk_softmax_with_capacity(
    logits,
    topk,
    capacity_factor=None,
    pad_to_capacity=False,
    drop_policy="probs",
    use_pre_softmax=False,
    num_groups=None,
    group_topk=None,
    scaling_factor=None,
    deterministic_mode=False,
    score_function="softmax",
    expert_bias=None,
    tk=torch.topk,
):
    num_tokens, num_experts = logits.shape

    def compute_topk(scores, topk, num_groups=None, group_topk=None):
        if group_topk:
            return mt_group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk, tk)
        return tk(scores, k=topk, dim=1)

    if score_function == "softmax":
        if use_pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        else:
            scores, top_indices = compute_topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            scores_for_routing = scores + expert_bias
            _, top_indices = compute_topk(scores_for_routing, topk, num_groups, group_topk)
            scores = torch.gather(scores, dim=1, index=top_indices).type_as(logits)
        else:
            scores, top_indices = compute_topk(scores, topk, num_groups, group_topk)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else scores
    else:
        raise ValueError(f"Invalid score_function: {score_function}")
    if scaling_factor:
        probs = probs * scaling_factor
    topk_masked_gates = torch.zeros_like(logits).scatter(1, top_indices, probs)
    topk_map = torch.zeros_like(logits).int().scatter(1, top_indices, 1).bool()
    tokens_per_expert = topk_map.sum(dim=0)
    if capacity_factor is None:
        return topk_masked_gates, topk_map, tokens_per_expert
    expert_capacity = mt_get_capacity(
        num_tokens=num_tokens * topk, num_experts=num_experts, capacity_factor=capacity_factor
    )
    if drop_policy == "probs":
        _, capacity_indices = tk(topk_masked_gates, k=expert_capacity, dim=0, sorted=False)
    elif drop_policy == "position":
        _, capacity_indices = tk(topk_map.int(), k=expert_capacity, dim=0, sorted=False)
    else:
        raise ValueError(f"Invalid drop_policy: {drop_policy}")
    capacity_mask = torch.zeros_like(logits).scatter(0, capacity_indices, 1).bool()
    if pad_to_capacity:
        final_map = capacity_mask
    else:
        final_map = torch.logical_and(topk_map, capacity_mask)
    return topk_masked_gates * final_map, final_map, tokens_per_expert


# ---- Helpers --------------------------------------------------------------------------------------

T, E = 48, 32

# (id, keyword arguments, topk values). Groups: 8 groups of 4 experts; a group's score sums its
# topk // group_topk largest values (1 or 2 here, and 3 for softmax without pre-softmax).
CONFIGS = [
    ("softmax", {}, (1, 2, 6)),
    ("softmax-pre", {"use_pre_softmax": True}, (1, 2, 6)),
    ("softmax-groups", {"num_groups": 8, "group_topk": 2}, (2, 4, 6)),
    ("softmax-pre-groups", {"use_pre_softmax": True, "num_groups": 8, "group_topk": 2}, (2, 4)),
    ("sigmoid", {"score_function": "sigmoid"}, (1, 2, 6)),
    ("sigmoid-bias", {"score_function": "sigmoid", "expert_bias": True}, (1, 4)),
    (
        "sigmoid-bias-groups",
        {"score_function": "sigmoid", "expert_bias": True, "num_groups": 8, "group_topk": 4},
        (4, 8),
    ),
    ("sigmoid-groups", {"score_function": "sigmoid", "num_groups": 8, "group_topk": 3}, (3, 6)),
    ("sigmoid-all-groups", {"score_function": "sigmoid", "num_groups": 8, "group_topk": 8}, (8,)),
]
CASES = [
    pytest.param(kw, k, scale, id=f"{name}-k{k}-scale{scale}")
    for name, kw, ks in CONFIGS
    for k in ks
    for scale in (None, 2.5)
]


def make_kwargs(kw, scale, seed, bias_values=None):
    out = dict(kw, scaling_factor=scale)
    if out.get("expert_bias"):
        gen = torch.Generator().manual_seed(seed + 1)
        out["expert_bias"] = 0.05 * torch.randn(E, generator=gen) if bias_values is None else bias_values
    else:
        out.pop("expert_bias", None)
    return out


def exact_selection(kw):
    """True where our selection compares the same numbers Megatron's torch.topk does: the logits
    (no bias, no groups: topk_router ranks by the logits), or groups of logits chosen in torch
    (softmax without pre-softmax). Elsewhere the choice values go through exp, whose last bit may
    differ between torch and our kernel: rows with a near tie may then route differently."""
    grouped = bool(kw.get("group_topk")) and kw.get("group_topk") != kw.get("num_groups")
    if kw.get("score_function", "softmax") == "softmax" and not kw.get("use_pre_softmax"):
        return True
    return kw.get("expert_bias") is None and not grouped


def near_tie_rows(logits, kw):
    """[T] bool: rows whose routing values (and the group scores, if grouped) hold two values
    closer than 1e-6: the only rows allowed to route differently when not exact_selection."""
    x = logits.float()
    if kw.get("score_function", "softmax") == "sigmoid":
        values = torch.sigmoid(x)
        if kw.get("expert_bias") is not None:
            values = values + kw["expert_bias"].float()
    else:
        values = torch.softmax(x, dim=-1)
    rows = [values]
    if kw.get("group_topk"):
        top2 = values.view(x.shape[0], kw["num_groups"], -1).sort(dim=-1, descending=True).values[..., :2]
        rows += [top2[..., 0], top2.sum(-1)]
    near = torch.zeros(x.shape[0], dtype=torch.bool)
    for v in rows:
        s = v.sort(dim=-1).values
        near |= ((s[:, 1:] - s[:, :-1]) < 1e-6).any(dim=1)
    return near


def routing(backend, fn, *args, **kwargs):
    with moe_kernels.use_backend(backend):
        return fn(*args, **kwargs)


# ---- get_capacity ---------------------------------------------------------------------------------


def test_capacity_matches_megatron_on_a_grid():
    tokens = torch.arange(1, 2049, 11, dtype=torch.float64)
    experts = torch.tensor([1, 2, 3, 5, 7, 8, 12, 16, 24, 60, 64, 100, 128, 160], dtype=torch.float64)
    ks = torch.tensor([1, 2, 3, 4, 6, 8], dtype=torch.float64)
    factors = torch.tensor([0.1, 0.3, 0.5, 0.7, 1.0, 1.1, 1.2, 1.25, 1.3, 1.5, 2.0, 3.3], dtype=torch.float64)
    Tg, Eg, kg, fg = torch.meshgrid(tokens, experts, ks, factors, indexing="ij")
    Tg, Eg, kg, fg = Tg.flatten(), Eg.flatten(), kg.flatten(), fg.flatten()
    # Megatron's formula, vectorised: float64 / and * round as Python's float operations do.
    want = torch.ceil(((Tg * kg) / Eg) * fg).to(torch.int64)
    cases = list(zip(Tg.long().tolist(), Eg.long().tolist(), kg.long().tolist(), fg.tolist(), strict=True))
    got = torch.tensor([get_capacity(t * k, e, f) for t, e, k, f in cases])
    assert len(cases) > 100_000
    assert torch.equal(got, want), f"{int((got != want).sum())} of {len(cases)} capacities differ"
    # The vectorised formula is the Python transcription's, spot-checked on every 97th case.
    assert [mt_get_capacity(t * k, e, f) for t, e, k, f in cases[::97]] == want[::97].tolist()
    # ceil(cf * T * k / E) rounds otherwise on some of this grid (the 149 of 86,184).
    ours_before = torch.tensor([capacity_for(t, e, k, f) for t, e, k, f in cases[::7]])
    assert int((ours_before != want[::7]).sum()) > 0
    # min_capacity: max with it, None = none.
    for t, e, k, f in cases[::1009]:
        for m in (None, 0, 5, 400):
            assert get_capacity(t * k, e, f, m) == mt_get_capacity(t * k, e, f, m)
            assert get_capacity(t * k, e, f, min_capacity=m) == get_capacity(t * k, e, f, m)


# ---- topk_routing_with_score_function --------------------------------------------------------------


@pytest.mark.parametrize("kw, k, scale", CASES)
def test_routing_matches_megatron_random(backend, kw, k, scale):
    for dtype, seed in ((torch.float32, k), (torch.bfloat16, k + 100)):
        logits = (2 * torch.randn(T, E, generator=torch.Generator().manual_seed(seed))).to(dtype).requires_grad_()
        kwargs = make_kwargs(kw, scale, seed)
        # bf16 logits tie often: Megatron's torch.topk order is then unspecified, pin it.
        tk = torch.topk if dtype == torch.float32 else pinned_topk
        probs, rmap = routing(backend, topk_routing_with_score_function, logits, k, **kwargs)
        want_probs, want_map = mt_topk_routing_with_score_function(logits, k, tk=tk, **kwargs)
        assert probs.dtype == dtype and rmap.dtype == torch.bool and probs.shape == (T, E)
        same = ~(rmap != want_map).any(dim=1)
        if exact_selection(kwargs):
            assert bool(same.all()), f"maps differ on rows {(~same).nonzero().flatten().tolist()}"
        else:
            near = near_tie_rows(logits.detach(), kwargs)
            assert bool((same | near).all()), f"maps differ on rows without a near tie: {(~(same | near)).nonzero()}"
            assert float(near.float().mean()) < 0.5
        assert bool((rmap.sum(1) == k).all())
        assert_close(probs[same], want_probs[same])
        g = torch.randn(T, E, generator=torch.Generator().manual_seed(seed + 2))
        grad = torch.autograd.grad((probs * g).sum(), logits)[0]
        want_grad = torch.autograd.grad((want_probs * g).sum(), logits)[0]
        assert_close(grad[same], want_grad[same])


def tied_logits(seed, dtype):
    """Few distinct values, many exact ties; no two distinct pairs with equal score sums."""
    levels = torch.randint(0, 5, (T, E), generator=torch.Generator().manual_seed(seed))
    return (0.7 * levels + 0.1).to(dtype)


@pytest.mark.parametrize("kw, k, scale", CASES)
def test_routing_ties_to_the_lower_index(backend, kw, k, scale):
    for dtype in (torch.float32, torch.bfloat16):
        logits = tied_logits(k, dtype).requires_grad_()
        # One bias per group of 4 experts: a bias differing within a group would let two groups
        # holding the same two scores with the biases swapped tie in exact arithmetic only.
        bias = 0.25 * ((torch.arange(E) // 4) % 2).float()
        kwargs = make_kwargs(kw, scale, 0, bias_values=bias)
        probs, rmap = routing(backend, topk_routing_with_score_function, logits, k, **kwargs)
        want_probs, want_map = mt_topk_routing_with_score_function(logits, k, tk=pinned_topk, **kwargs)
        assert torch.equal(rmap, want_map)
        assert_close(probs, want_probs)
        dense_probs, idx = routing(backend, topk_routing_with_score_function, logits, k, dense_output=True, **kwargs)
        want_dense, want_idx = mt_topk_routing_with_score_function(
            logits, k, dense_output=True, tk=pinned_topk, **kwargs
        )
        assert torch.equal(idx, want_idx)
        assert_close(dense_probs, want_dense)
        g = torch.randn(T, k, generator=torch.Generator().manual_seed(3))
        grad = torch.autograd.grad((dense_probs * g).sum(), logits)[0]
        assert_close(grad, torch.autograd.grad((want_dense * g).sum(), logits)[0])


def test_routing_options(backend):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(11))
    want = mt_topk_routing_with_score_function(logits, 4, use_pre_softmax=True)
    for extra in ({"fused": True}, {"scaling_factor": 0}, {"scaling_factor": 0.0}, {"expert_bias": torch.randn(E)}):
        # fused: TE's kernel in Megatron, ours either way; a zero scaling_factor is "no scaling";
        # expert_bias is ignored with softmax (as Megatron does).
        got = routing(backend, topk_routing_with_score_function, logits, 4, use_pre_softmax=True, **extra)
        assert torch.equal(got[1], want[1])
        assert_close(got[0], want[0])
    # num_groups without group_topk: no groups, as in Megatron.
    got = routing(backend, topk_routing_with_score_function, logits, 4, num_groups=8, group_topk=None)
    assert torch.equal(got[1], mt_topk_routing_with_score_function(logits, 4)[1])
    # A group of 0 groups is no groups; all groups eligible is no restriction either.
    for g in (0, 8):
        got = routing(backend, topk_routing_with_score_function, logits, 4, num_groups=8, group_topk=g)
        assert torch.equal(got[1], mt_topk_routing_with_score_function(logits, 4, num_groups=8, group_topk=g)[1])
    # Strided logits (a transpose) route as their contiguous copy does.
    xt = torch.randn(E, T, generator=torch.Generator().manual_seed(12)).t()
    got = routing(backend, topk_routing_with_score_function, xt, 4, num_groups=8, group_topk=2)
    want = mt_topk_routing_with_score_function(xt.contiguous(), 4, num_groups=8, group_topk=2)
    assert torch.equal(got[1], want[1])
    assert_close(got[0], want[0])
    # float64 logits: float64 probabilities; Megatron computes them in float32, ours in float64.
    got = routing(backend, topk_routing_with_score_function, logits.double(), 2, score_function="sigmoid")
    want = mt_topk_routing_with_score_function(logits.double(), 2, score_function="sigmoid")
    assert got[0].dtype == torch.float64 and torch.equal(got[1], want[1])
    assert_close(got[0], want[0], dtype=torch.float32)


def test_routing_bad_arguments():
    x = torch.randn(8, 16)
    with pytest.raises(NotImplementedError, match="sqrtsoftplus"):
        topk_routing_with_score_function(x, 2, score_function="sqrtsoftplus")
    with pytest.raises(NotImplementedError, match="router_replay"):
        topk_routing_with_score_function(x, 2, router_replay=object())
    with pytest.raises(NotImplementedError, match="precomputed_indices"):
        topk_routing_with_score_function(x, 2, precomputed_indices=torch.zeros(8, 2, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="topk // group_topk = 3"):
        topk_routing_with_score_function(x, 6, num_groups=4, group_topk=2, score_function="sigmoid")
    with pytest.raises(NotImplementedError, match="topk // group_topk = 3"):
        topk_routing_with_score_function(x, 6, num_groups=4, group_topk=2, use_pre_softmax=True)
    with pytest.raises(ValueError, match="score_function"):
        topk_routing_with_score_function(x, 2, score_function="relu")
    with pytest.raises(ValueError, match="topk"):
        topk_routing_with_score_function(x, 17)
    with pytest.raises(TypeError, match="topk"):
        topk_routing_with_score_function(x, 2.0)
    with pytest.raises(ValueError, match="logits"):
        topk_routing_with_score_function(x[0], 2)
    with pytest.raises(ValueError, match="num_groups must be set"):
        topk_routing_with_score_function(x, 2, group_topk=2)
    with pytest.raises(ValueError, match="num_groups must divide"):
        topk_routing_with_score_function(x, 2, num_groups=3, group_topk=2)
    with pytest.raises(ValueError, match="topk must be >= group_topk"):
        topk_routing_with_score_function(x, 1, num_groups=4, group_topk=2)
    with pytest.raises(ValueError, match="topk must be <="):
        topk_routing_with_score_function(x, 9, num_groups=4, group_topk=2)
    with pytest.raises(ValueError, match="expert_bias"):
        topk_routing_with_score_function(x, 2, score_function="sigmoid", expert_bias=torch.zeros(15))
    with pytest.raises(ValueError, match="scaling_factor"):
        topk_routing_with_score_function(x, 2, scaling_factor=float("nan"))
    with pytest.raises(TypeError, match="use_pre_softmax"):
        topk_routing_with_score_function(x, 2, use_pre_softmax=None)


# ---- apply_router_token_dropping -------------------------------------------------------------------


def routed(seed, T=64, E=8, k=2, dtype=torch.float32):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed))
    probs, rmap = mt_topk_routing_with_score_function(logits, k)
    return probs.to(dtype).requires_grad_(), rmap


@pytest.mark.parametrize("capacity_factor", [0.25, 0.5, 1.0, 1.25, 4.0, 5.0])
@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("pad_to_capacity", [False, True])
def test_dropping_matches_megatron(backend, capacity_factor, drop_policy, pad_to_capacity):
    args = (2, capacity_factor, drop_policy, pad_to_capacity)
    for seed, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        probs, rmap = routed(seed, dtype=dtype)
        got_probs, got_map = routing(backend, apply_router_token_dropping, probs, rmap, *args)
        want_probs, want_map = mt_apply_router_token_dropping(probs, rmap, *args, tk=pinned_topk)
        assert torch.equal(got_map, want_map)
        assert got_probs.dtype == dtype and torch.equal(got_probs, want_probs)
        g = torch.randn(probs.shape, generator=torch.Generator().manual_seed(seed))
        grad = torch.autograd.grad((got_probs.float() * g).sum(), probs)[0]
        assert torch.equal(grad, torch.autograd.grad((want_probs.float() * g).sum(), probs)[0])
        C = mt_get_capacity(probs.shape[0] * 2, probs.shape[1], capacity_factor)
        per_expert = got_map.sum(0)
        if pad_to_capacity:
            assert bool((per_expert == min(C, probs.shape[0])).all())
        else:
            assert torch.equal(per_expert, torch.minimum(rmap.sum(0), torch.tensor(C)))
        if drop_policy == "probs" and not pad_to_capacity and dtype == torch.float32:
            # Distinct probabilities: torch.topk's own order cannot matter here.
            assert torch.equal(got_map, mt_apply_router_token_dropping(probs, rmap, *args)[1])


def test_position_policy_keeps_the_first_tokens(backend):
    probs, rmap = routed(3, T=96, E=6, k=2)
    for cf in (0.3, 0.6, 1.0):
        C = mt_get_capacity(96 * 2, 6, cf)
        _, got = routing(backend, apply_router_token_dropping, probs, rmap, 2, cf, "position")
        assert torch.equal(got, rmap & (rmap.long().cumsum(0) <= C))
        # torch.topk picks some C routed tokens per expert (which ones is unspecified): same counts.
        _, theirs = mt_apply_router_token_dropping(probs, rmap, 2, cf, "position")
        assert torch.equal(got.sum(0), theirs.sum(0))


def test_probs_policy_ties_to_the_lower_token(backend):
    # Quantised probabilities: many equal values compete for the last slots of an expert.
    probs, rmap = routed(4, T=80, E=4, k=2)
    probs = (probs.detach() * 4).round() / 4
    for pad in (False, True):
        got = routing(backend, apply_router_token_dropping, probs, rmap, 2, 0.5, "probs", pad)
        want = mt_apply_router_token_dropping(probs, rmap, 2, 0.5, "probs", pad, tk=pinned_topk)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_dropping_bad_arguments():
    probs, rmap = routed(0)
    with pytest.raises(ValueError, match="drop_policy"):
        apply_router_token_dropping(probs, rmap, 2, 1.0, drop_policy="random")
    with pytest.raises(TypeError, match="routing_map"):
        apply_router_token_dropping(probs, rmap.int(), 2, 1.0)
    with pytest.raises(ValueError, match="routing_map"):
        apply_router_token_dropping(probs, rmap[:-1], 2, 1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        apply_router_token_dropping(probs, rmap, 2, -1.0)
    with pytest.raises(TypeError, match="router_topk"):
        apply_router_token_dropping(probs, rmap, None, 1.0)
    with pytest.raises(ValueError, match="num_experts"):
        get_capacity(10, 0, 1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        get_capacity(10, 2, float("inf"))


# ---- topk_softmax_with_capacity (0d336825) ----------------------------------------------------------

OLD_CASES = [
    pytest.param(kw, k, cf, policy, pad, id=f"{name}-k{k}-cf{cf}-{policy}-pad{int(pad)}")
    for name, kw, k in [
        ("softmax", {}, 2),
        ("softmax-pre", {"use_pre_softmax": True, "scaling_factor": 2.0}, 2),
        ("softmax-groups", {"num_groups": 8, "group_topk": 2}, 4),
        ("sigmoid-bias", {"score_function": "sigmoid", "expert_bias": True}, 4),
        ("sigmoid-k1", {"score_function": "sigmoid"}, 1),
    ]
    for cf, policy, pad in [
        (None, "probs", False),
        (1.0, "probs", False),
        (0.5, "position", True),
        (1.5, "probs", True),
    ]
]


@pytest.mark.parametrize("kw, k, cf, policy, pad", OLD_CASES)
def test_old_function_matches_megatron(backend, kw, k, cf, policy, pad):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(k)).requires_grad_()
    kwargs = make_kwargs(kw, kw.get("scaling_factor"), k)
    kwargs.update(capacity_factor=cf, pad_to_capacity=pad, drop_policy=policy)
    got = routing(backend, topk_softmax_with_capacity, logits, k, **kwargs)
    want = mt_topk_softmax_with_capacity(logits, k, tk=pinned_topk, **kwargs)
    assert len(got) == 3
    same = ~(got[1] != want[1]).any(dim=1)
    if not exact_selection(kwargs):
        assert bool((same | near_tie_rows(logits.detach(), kwargs)).all())
    else:
        assert bool(same.all())
    if bool(same.all()):
        assert torch.equal(got[2], want[2]) and got[2].dtype == torch.int64
    assert_close(got[0][same], want[0][same])
    g = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    grad = torch.autograd.grad((got[0] * g).sum(), logits)[0]
    assert_close(grad[same], torch.autograd.grad((want[0] * g).sum(), logits)[0][same])


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_old_function_in_bf16(backend, score_function):
    # 0d336825 rounds the scores to bf16 before its top-k; ours selects on float32 scores (on the
    # logits, here). Equal bf16 scores of different logits at the k-th place are the only rows
    # allowed to differ: torch.topk picks either there.
    logits = (3 * torch.randn(T, E, generator=torch.Generator().manual_seed(21))).bfloat16()
    k = 4
    kwargs = {"use_pre_softmax": True, "score_function": score_function}
    got = routing(backend, topk_softmax_with_capacity, logits, k, **kwargs)
    want = mt_topk_softmax_with_capacity(logits, k, tk=pinned_topk, **kwargs)
    scores = torch.softmax(logits, -1, dtype=torch.float32) if score_function == "softmax" else logits.float().sigmoid()
    ranked = scores.bfloat16().sort(dim=1, descending=True).values
    boundary_tie = ranked[:, k - 1] == ranked[:, k]
    same = ~(got[1] != want[1]).any(dim=1)
    assert bool((same | boundary_tie).all())
    assert got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[0][same], want[0][same], **TOL[torch.bfloat16])


def test_old_function_capacity_above_tokens(backend):
    # Megatron's torch.topk(k=C) raises when C > T; ours keeps every token (padded: every row),
    # as apply_router_token_dropping does.
    logits = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    probs, rmap, counts = routing(backend, topk_softmax_with_capacity, logits, 2, capacity_factor=3.0)
    want = mt_topk_softmax_with_capacity(logits, 2)
    assert torch.equal(rmap, want[1]) and torch.equal(counts, want[2])
    _, padded, _ = routing(backend, topk_softmax_with_capacity, logits, 2, capacity_factor=3.0, pad_to_capacity=True)
    assert bool(padded.all())
    with pytest.raises(RuntimeError):
        mt_topk_softmax_with_capacity(logits, 2, capacity_factor=3.0)
