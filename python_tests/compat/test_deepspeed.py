"""moe_kernels.compat.deepspeed against a transcription of DeepSpeed's gating functions.

The `ds_*` functions below are a transcription, written for this test, of _capacity, top1gating,
top2gating and topkgating in deepspeed/moe/sharded_moe.py at DeepSpeed commit
edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (torch only: no deepspeed import). Kept as in the source:
the RNG calls (torch.distributions Uniform / Gumbel rsample, global RNG), the argmax / topk
selection, the cumsum slots, the in-place `logits +=` of top2gating. Left out: the process-group
branches (ep_group is None; DeepSpeed's tensor-parallel size is 1 without an mpu, which the
transcription keeps as tp = 1) and tutel (its fast_cumsum_sub_one is cumsum - 1 on CPU).
`topk=` swaps torch.topk for a stable one (equal values to the lower index): DeepSpeed's
algorithm with ties pinned, the spec of ours where torch.topk's tie order is unspecified.
"""

import inspect
import random

import pytest
import torch
import torch.nn.functional as F

from moe_kernels.compat import deepspeed as ds_compat
from moe_kernels.compat import top1gating, top2gating, topkgating
from moe_kernels.ops import capacity_for


# ---------------------------------------------------------------- the transcription (DeepSpeed edaa7221)
def ds_capacity(gates, capacity_factor, min_capacity):
    num_tokens = gates.shape[0]
    num_experts = gates.shape[1]
    capacity = torch.ceil((num_tokens / num_experts) * capacity_factor).to(torch.int64)
    if capacity < min_capacity:
        capacity = min_capacity.to(torch.int64)
    return capacity


def ds_gumbel_rsample(shape, device):
    one = torch.tensor(1.0, device=device)
    zero = torch.tensor(0.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def stable_topk(x, k, dim=-1, sorted=True):
    """torch.topk with equal values in index order (torch.sort is stable on request)."""
    idx = torch.sort(x, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, int(k))
    return x.gather(dim, idx), idx


def ds_top1gating(
    logits,
    capacity_factor,
    min_capacity,
    used_token=None,
    noisy_gate_policy=None,
    drop_tokens=True,
    use_rts=True,
    sparse_routes=False,
    topk=torch.topk,
):
    if noisy_gate_policy == "RSample":
        logits_w_noise = logits + ds_gumbel_rsample(logits.shape, device=logits.device)
    gates = F.softmax(logits, dim=1)
    capacity = ds_capacity(gates, torch.tensor(capacity_factor), torch.tensor(min_capacity))
    indices1_s = torch.argmax(logits_w_noise if noisy_gate_policy == "RSample" else gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if used_token is not None:
        mask1 = torch.einsum("s,se->se", used_token, mask1)
    exp_counts = torch.sum(mask1, dim=0).detach().to(logits.device)
    if not drop_tokens:
        new_capacity = torch.max(exp_counts).to(logits.device)
        tp = 1
        new_capacity = torch.ceil(new_capacity / tp).mul(tp).to(new_capacity.dtype)
        capacity = min(new_capacity, torch.tensor(mask1.size(0)).to(new_capacity.device))
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.sum(me * ce) * num_experts
    if use_rts:
        uniform = torch.distributions.uniform.Uniform(
            low=torch.tensor(0.0, device=logits.device), high=torch.tensor(1.0, device=logits.device)
        ).rsample
        mask1_rand = mask1 * uniform(mask1.shape)
    else:
        mask1_rand = mask1
    assert logits.shape[0] >= min_capacity
    selection_capacity = min(capacity, torch.tensor(mask1.size(0)).to(capacity.device))
    top_idx = topk(mask1_rand, k=selection_capacity, dim=0)[1]
    new_mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, top_idx, 1)
    mask1 = new_mask1
    if sparse_routes:
        indices_mask = mask1.sum(dim=1) * num_experts - 1
        indices1_s = torch.min(indices1_s, indices_mask)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    if sparse_routes:
        gates1_s = (gates * mask1).sum(dim=1)
        locations1_s = torch.sum(locations1 * mask1, dim=1)
        return (
            l_aux,
            capacity,
            num_experts,
            indices1_s.to(torch.int32).unsqueeze(0),
            locations1_s.to(torch.int32).unsqueeze(0),
            gates1_s.unsqueeze(0),
            exp_counts,
        )
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    mask1_float = mask1.float()
    gates = gates * mask1_float
    locations1_sc = F.one_hot(locations1_s, capacity).float()
    combine_weights = torch.einsum("se,sc->sec", gates, locations1_sc)
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


def ds_top2gating(
    logits, capacity_factor, min_capacity, drop_tokens=True, top2_2nd_expert_sampling=True, sparse_routes=False
):
    gates = F.softmax(logits, dim=1)
    indices1_s = torch.argmax(gates, dim=1)
    num_experts = int(gates.shape[1])
    mask1 = F.one_hot(indices1_s, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits += ds_gumbel_rsample(logits.shape, device=logits.device)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach().to(logits.device)
    if drop_tokens:
        capacity = ds_capacity(gates, torch.tensor(capacity_factor * 2), torch.tensor(min_capacity))
        mask1 *= torch.lt(locations1, capacity)
        mask2 *= torch.lt(locations2, capacity)
    else:
        new_capacity = torch.max(exp_counts)
        tp = 1
        new_capacity = torch.ceil(new_capacity / tp).mul(tp).to(new_capacity.dtype)
        capacity = new_capacity
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    mask1_float = mask1.float()
    mask2_float = mask2.float()
    gates1_s = torch.einsum("se,se->s", gates, mask1_float)
    gates2_s = torch.einsum("se,se->s", gates, mask2_float)
    denom_s = gates1_s + gates2_s
    denom_s = torch.clamp(denom_s, min=torch.finfo(denom_s.dtype).eps)
    gates1_s /= denom_s
    gates2_s /= denom_s
    if sparse_routes:
        indices1_s = torch.where(mask1.any(dim=1), indices1_s, torch.full_like(indices1_s, -1))
        indices2_s = torch.where(mask2.any(dim=1), indices2_s, torch.full_like(indices2_s, -1))
        return (
            l_aux,
            capacity,
            num_experts,
            torch.stack([indices1_s, indices2_s]).to(torch.int32),
            torch.stack([locations1_s, locations2_s]).to(torch.int32),
            torch.stack([gates1_s, gates2_s]),
            exp_counts,
        )
    gates1 = torch.einsum("s,se->se", gates1_s, mask1_float)
    gates2 = torch.einsum("s,se->se", gates2_s, mask2_float)
    locations1_sc = F.one_hot(locations1_s, int(capacity)).float()
    locations2_sc = F.one_hot(locations2_s, int(capacity)).float()
    combine1_sec = torch.einsum("se,sc->sec", gates1, locations1_sc)
    combine2_sec = torch.einsum("se,sc->sec", gates2, locations2_sc)
    combine_weights = combine1_sec + combine2_sec
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


def ds_topkgating(
    logits,
    k,
    capacity_factor,
    min_capacity,
    drop_tokens=True,
    drop_policy="probs",
    sparse_routes=False,
    topk=torch.topk,
):
    gates = F.softmax(logits, dim=1)
    num_experts = int(gates.shape[1])
    top_gate, top_idx = topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
    exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask.float(), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k
    locations = None
    if drop_tokens:
        capacity = ds_capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
        if drop_policy == "probs":
            topk_masked_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            selection_capacity = min(capacity, torch.tensor(gates.size(0)).to(capacity.device))
            _, capacity_indices = topk(topk_masked_gates, k=selection_capacity, dim=0, sorted=False)
            capacity_mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(0, capacity_indices, True)
            mask &= capacity_mask
            locations = torch.cumsum(mask, dim=0) - 1
        elif drop_policy == "position":
            locations = torch.cumsum(mask, dim=0) - 1
            mask *= torch.lt(locations, capacity)
        else:
            raise ValueError(f"Invalid drop_policy: {drop_policy}")
    else:
        new_capacity = torch.max(exp_counts)
        tp = 1
        new_capacity = torch.ceil(new_capacity / tp).mul(tp).to(new_capacity.dtype)
        capacity = new_capacity
        locations = torch.cumsum(mask, dim=0) - 1
    gates_masked = gates * mask
    gates_s = torch.sum(gates_masked, dim=-1, keepdim=True)
    denom_s = torch.clamp(gates_s, min=torch.finfo(gates_masked.dtype).eps)
    gates_masked = gates_masked / denom_s
    if sparse_routes:
        route_kept = mask.gather(1, top_idx)
        route_indices = torch.where(route_kept, top_idx, torch.full_like(top_idx, -1))
        route_locations = locations.gather(1, top_idx) * route_kept
        route_gates = gates_masked.gather(1, top_idx)
        return (
            l_aux,
            capacity,
            num_experts,
            route_indices.t().contiguous().to(torch.int32),
            route_locations.t().contiguous().to(torch.int32),
            route_gates.t().contiguous(),
            exp_counts,
        )
    locations_sc = F.one_hot((locations * mask), int(capacity)).float()
    combine_weights = torch.einsum("se,sec->sec", gates_masked, locations_sc)
    dispatch_mask = combine_weights.bool()
    return l_aux, combine_weights, dispatch_mask, exp_counts


# ---------------------------------------------------------------- helpers
def random_logits(S, E, seed, tied=False, dtype=torch.float32):
    """[S, E] N(0, 1) logits; tied=True: values in {0, 1, 2} (equal logits and probabilities in
    most rows and columns); tied="rows": every row a permutation of one row holding its largest
    value three times, so equal probabilities compete for a slot from different choice ranks."""
    g = torch.Generator().manual_seed(seed)
    if tied == "rows":
        row = torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0] + [0.0] * (E - 5))
        return torch.stack([row[torch.randperm(E, generator=g)] for _ in range(S)]).to(dtype)
    if tied:
        return torch.randint(0, 3, (S, E), generator=g).to(dtype)
    return torch.randn(S, E, generator=g).to(dtype)


def assert_same(ours, theirs, sparse):
    """Same outputs: selections, slots, counts and capacity exactly; values to tolerance."""
    assert len(ours) == len(theirs)
    if sparse:
        l_aux, C, E, idx, loc, gates, counts = ours
        assert int(C) == int(theirs[1]) and C.dtype == torch.int64 and C.dim() == 0
        assert E == theirs[2]
        for mine, want in ((idx, theirs[3]), (loc, theirs[4]), (counts, theirs[6])):
            assert mine.dtype == want.dtype and torch.equal(mine, want)
        assert gates.dtype == theirs[5].dtype
        torch.testing.assert_close(gates, theirs[5])
    else:
        l_aux, combine, dispatch, counts = ours
        assert combine.shape == theirs[1].shape and combine.dtype == theirs[1].dtype
        assert torch.equal(dispatch, theirs[2])
        assert counts.dtype == theirs[3].dtype and torch.equal(counts, theirs[3])
        torch.testing.assert_close(combine, theirs[1])
    torch.testing.assert_close(l_aux, theirs[0])


def grads(fn, logits, sparse, seed):
    """d/d logits of a random linear function of the weights output plus l_aux (run under `seed`)."""
    x = logits.clone().requires_grad_(True)
    torch.manual_seed(seed)
    out = fn(x * 1.0)  # a non-leaf, as TopKGate's logits are (DeepSpeed's top2gating adds in place)
    weights = out[5] if sparse else out[1]
    r = torch.randn(weights.shape, generator=torch.Generator().manual_seed(1))
    (weights.float() * r).sum().add(3.0 * out[0]).backward()
    return out, x.grad


def compare(ours_fn, ds_fn, logits, sparse, seed=0, grad=True):
    """Both under the same global seed: outputs, then gradients of both."""
    if grad:
        mine, g_mine = grads(ours_fn, logits, sparse, seed)
        want, g_want = grads(ds_fn, logits, sparse, seed)
        assert_same(mine, want, sparse)
        torch.testing.assert_close(g_mine, g_want)
    else:
        torch.manual_seed(seed)
        mine = ours_fn(logits.clone())
        torch.manual_seed(seed)
        want = ds_fn(logits.clone())
        assert_same(mine, want, sparse)
    return mine


# ---------------------------------------------------------------- signatures and positional calls
def params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_signatures_are_deepspeeds():
    P, K, E = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty
    assert params(top1gating) == [
        ("logits", E, P),
        ("capacity_factor", E, P),
        ("min_capacity", E, P),
        ("used_token", None, P),
        ("noisy_gate_policy", None, P),
        ("drop_tokens", True, P),
        ("use_rts", True, P),
        ("ep_group", None, P),
        ("sparse_routes", False, P),
        ("use_tutel", False, P),
        ("generator", None, K),
    ]
    assert params(top2gating) == [
        ("logits", E, P),
        ("capacity_factor", E, P),
        ("min_capacity", E, P),
        ("drop_tokens", True, P),
        ("ep_group", None, P),
        ("top2_2nd_expert_sampling", True, P),
        ("sparse_routes", False, P),
        ("generator", None, K),
    ]
    assert params(topkgating) == [
        ("logits", E, P),
        ("k", E, P),
        ("capacity_factor", E, P),
        ("min_capacity", E, P),
        ("drop_tokens", True, P),
        ("ep_group", None, P),
        ("drop_policy", "probs", P),
        ("sparse_routes", False, P),
    ]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("training", [True, False])
def test_positional_calls_as_topkgate_makes_them(k, training):
    """TopKGate.forward's calls (min_capacity 8, its default), positional argument for argument,
    against the transcription; the legacy-style (logits, 1.0, 4) call too."""
    logits = random_logits(64, 8, seed=k)
    cf, policy, drop, rts, sampling = (1.0 if training else 2.0), ("RSample" if training else None), True, True, True
    used = torch.ones(64, dtype=torch.int64)
    if k == 1:
        ours = lambda x: top1gating(x, cf, 8, used, policy, drop, rts, None, True, False)  # noqa: E731
        theirs = lambda x: ds_top1gating(x, cf, 8, used, policy, drop, rts, True)  # noqa: E731
        short = top1gating(logits, 1.0, 4)
    elif k == 2:
        ours = lambda x: top2gating(x, cf, 8, drop, None, sampling, True)  # noqa: E731
        theirs = lambda x: ds_top2gating(x, cf, 8, drop, sampling, True)  # noqa: E731
        short = top2gating(logits, 1.0, 4)
    else:
        ours = lambda x: topkgating(x, k, cf, 8, drop, None, sparse_routes=True)  # noqa: E731
        theirs = lambda x: ds_topkgating(x, k, cf, 8, drop, sparse_routes=True)  # noqa: E731
        short = topkgating(logits, k, 1.0, 4)
    compare(ours, theirs, logits, sparse=True, seed=5)
    assert len(short) == 4 and short[1].dim() == 3


# ---------------------------------------------------------------- capacity
def capacity_grid():
    """(T, E, k, factor): 122,880 cases where S / E and the factors are not all exact in binary."""
    Ts = torch.arange(1, 257)
    Es = torch.tensor([1, 2, 3, 5, 6, 7, 8, 12, 16, 24, 60, 96])
    ks = torch.tensor([1, 2, 3, 4])
    factors = torch.tensor([0.5, 1.0, 1.1, 1.2, 1.25, 1.3, 1.5, 1.7, 2.0, 3.3], dtype=torch.float64)
    grid = torch.cartesian_prod(Ts.double(), Es.double(), ks.double(), factors)
    return grid[:, 0], grid[:, 1], grid[:, 2], grid[:, 3]


def test_capacity_is_deepspeeds_float32_arithmetic_on_a_grid():
    T, E, k, f = capacity_grid()
    assert T.numel() > 40_000
    # DeepSpeed, vectorised: the double S / E and the double cf * k each rounded to float32 (the
    # scalar and the 0-dim tensor), multiplied in float32 (checked below against ds_capacity).
    want = torch.ceil((T / E).float() * (f * k).float()).to(torch.int64)
    cases = list(zip(T.long().tolist(), E.long().tolist(), k.long().tolist(), f.tolist(), strict=True))
    mine = torch.tensor([ds_compat._capacity(t, e, kk, ff, 0) for t, e, kk, ff in cases])
    assert torch.equal(mine, want)
    # the grid reaches the cases where the exact formula rounds the other way
    exact = torch.tensor([capacity_for(t, e, kk, ff) for t, e, kk, ff in cases])
    assert (exact != want).sum() > 100
    # the vectorised form is the transcription's arithmetic, on a sample of the grid
    rng = random.Random(0)
    for t, e, kk, ff in rng.sample(cases, 1500) + [(35, 3, 1, 1.2), (50, 5, 1, 1.1)]:
        ds = ds_capacity(torch.empty(t, e), torch.tensor(ff * kk), torch.tensor(0))
        assert int(ds) == ds_compat._capacity(t, e, kk, ff, 0), (t, e, kk, ff)
    assert ds_compat._capacity(35, 3, 1, 1.2, 0) == 15 and capacity_for(35, 3, 1, 1.2) == 14


def test_capacity_min_capacity_and_zero_factor():
    for t, e, kk, ff, m in [(64, 8, 1, 1.0, 4), (64, 8, 1, 1.0, 9), (10, 3, 2, 0.0, 5), (7, 60, 3, 1.3, 0)]:
        ds = ds_capacity(torch.empty(t, e), torch.tensor(ff * kk), torch.tensor(m))
        assert int(ds) == ds_compat._capacity(t, e, kk, ff, m)


# ---------------------------------------------------------------- top1gating
TOP1_CASES = [
    (drop, rts, policy, used, sparse)
    for drop in (True, False)
    for rts in (True, False)
    for policy in (None, "Jitter", "RSample")
    for used in (False, True)
    for sparse in (False, True)
]


@pytest.mark.parametrize("drop,rts,policy,used,sparse", TOP1_CASES)
def test_top1gating_matches_deepspeed(drop, rts, policy, used, sparse):
    S, E = 96, 8
    logits = random_logits(S, E, seed=11)
    used_token = (torch.rand(S, generator=torch.Generator().manual_seed(3)) > 0.2).long() if used else None
    # without rts DeepSpeed's topk over a 0/1 column leaves ties: its algorithm with ties pinned
    topk = torch.topk if rts else stable_topk
    ours = lambda x: top1gating(x, 0.75, 4, used_token, policy, drop, rts, None, sparse)  # noqa: E731
    theirs = lambda x: ds_top1gating(x, 0.75, 4, used_token, policy, drop, rts, sparse, topk=topk)  # noqa: E731
    mine = compare(ours, theirs, logits, sparse, seed=7)
    if drop:  # the case is one with drops
        assert (mine[-1] > ds_compat._capacity(S, E, 1, 0.75, 4)).any()


@pytest.mark.parametrize("sparse", [False, True])
def test_top1gating_without_rts_keeps_as_many_as_deepspeed(sparse):
    """torch.topk's own tie order: which tokens are kept may differ, how many per expert may not."""
    logits = random_logits(96, 8, seed=12)
    mine = top1gating(logits, 1.0, 4, use_rts=False, sparse_routes=sparse)
    want = ds_top1gating(logits.clone(), 1.0, 4, use_rts=False, sparse_routes=sparse)
    if sparse:
        per_expert = lambda out: torch.bincount(out[3][out[3] >= 0].long(), minlength=8)  # noqa: E731
    else:
        per_expert = lambda out: out[2].sum(dim=(0, 2))  # noqa: E731
    assert torch.equal(per_expert(mine), per_expert(want))
    # ours: an over-full expert keeps its lowest token indices
    kept = mine[3][0] if sparse else mine[2].any(dim=2).any(dim=1)
    kept = kept >= 0 if sparse else kept
    chosen = torch.argmax(logits, dim=1)
    C = ds_compat._capacity(96, 8, 1, 1.0, 4)
    for e in range(8):
        tokens = torch.nonzero(chosen == e).flatten()
        assert torch.equal(kept[tokens], torch.arange(tokens.numel()) < C)


def test_top1gating_rng_is_deepspeeds():
    """generator=None draws from the global RNG exactly as DeepSpeed does (same state after);
    a seeded generator gives the same draws as the same global seed."""
    logits = random_logits(128, 8, seed=13)
    torch.manual_seed(21)
    want = ds_top1gating(logits, 1.0, 4, None, "RSample", True, True, True)
    after_ds = torch.rand(3)
    torch.manual_seed(21)
    mine = top1gating(logits, 1.0, 4, None, "RSample", True, True, None, True)
    assert torch.equal(torch.rand(3), after_ds)
    assert_same(mine, want, sparse=True)
    seeded = top1gating(
        logits, 1.0, 4, None, "RSample", True, True, None, True, generator=torch.Generator().manual_seed(21)
    )
    assert_same(seeded, want, sparse=True)
    other = top1gating(
        logits, 1.0, 4, None, "RSample", True, True, None, True, generator=torch.Generator().manual_seed(22)
    )
    assert not torch.equal(other[3], mine[3])


def test_top1gating_rts_keeps_random_tokens():
    """Over seeds, an over-full expert's kept tokens are not its first ones: each of its tokens is
    kept with frequency near C / count."""
    logits = torch.zeros(40, 4)
    logits[:, 2] = 1.0  # every token to expert 2; C = max(4, ceil(40 / 4)) = 10
    g = torch.Generator().manual_seed(0)
    kept = torch.zeros(40)
    for _ in range(200):
        kept += top1gating(logits, 1.0, 4, sparse_routes=True, generator=g)[3][0].ge(0).float()
    freq = kept / 200
    assert kept.sum() == 2000 and (freq - 0.25).abs().max() < 0.15


def test_top1gating_floating_used_token():
    """A float used_token: DeepSpeed's exp_counts become float (einsum promotes) and its dense
    path fails in one_hot; ours gives its sparse outputs and a dense result that agrees."""
    logits = random_logits(64, 8, seed=14)
    used = (torch.arange(64) % 3 != 0).float()
    mine = top1gating(logits, 1.0, 4, used, None, True, False, None, True)
    want = ds_top1gating(logits, 1.0, 4, used, None, True, False, True, topk=stable_topk)
    assert mine[-1].dtype == torch.float32
    assert_same(mine, want, sparse=True)
    dense = top1gating(logits, 1.0, 4, used, None, True, False)
    token, expert, slot = torch.nonzero(dense[2], as_tuple=True)
    assert torch.equal(token, torch.nonzero(mine[3][0] >= 0).flatten())
    assert torch.equal(expert, mine[3][0][token].long()) and torch.equal(slot, mine[4][0][token].long())


# ---------------------------------------------------------------- top2gating
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("sparse", [False, True])
@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("drop", [True, False])
def test_top2gating_matches_deepspeed(drop, sampling, sparse, tied):
    """torch.argmax takes the first maximum: DeepSpeed is deterministic here, ties included."""
    logits = random_logits(96, 8, seed=15, tied=tied)
    ours = lambda x: top2gating(x, 1.0, 4, drop, None, sampling, sparse)  # noqa: E731
    theirs = lambda x: ds_top2gating(x, 1.0, 4, drop, sampling, sparse)  # noqa: E731
    compare(ours, theirs, logits, sparse, seed=8)


def test_top2gating_leaves_the_logits_alone_and_draws_like_deepspeed():
    logits = random_logits(64, 6, seed=16)
    before = logits.clone()
    torch.manual_seed(4)
    want = ds_top2gating(logits.clone(), 1.0, 4)
    after_ds = torch.rand(2)
    torch.manual_seed(4)
    mine = top2gating(logits, 1.0, 4)
    assert torch.equal(torch.rand(2), after_ds) and torch.equal(logits, before)
    assert_same(mine, want, sparse=False)
    assert_same(top2gating(logits, 1.0, 4, generator=torch.Generator().manual_seed(4)), want, sparse=False)


def test_selection_is_on_the_probabilities_like_deepspeeds():
    """Logits 1e-9 apart have equal float32 probabilities: DeepSpeed's argmax / topk of the
    probabilities take the first of them, not the largest logit; top2gating's second expert is
    the argmax of the logits themselves."""
    logits = torch.zeros(32, 6)
    logits[:, 1:] += torch.arange(1, 6) * 1e-9
    logits[::2] = logits[::2].flip(1)
    gates = torch.softmax(logits, dim=1)
    assert (gates == gates[:, :1]).all()  # the premise: every probability equal
    for sparse in (False, True):
        compare(
            lambda x: top1gating(x, 1.0, 4, use_rts=False, sparse_routes=sparse),
            lambda x: ds_top1gating(x, 1.0, 4, use_rts=False, sparse_routes=sparse, topk=stable_topk),
            logits,
            sparse,
        )
        compare(
            lambda x: top2gating(x, 1.0, 4, True, None, False, sparse),
            lambda x: ds_top2gating(x, 1.0, 4, True, False, sparse),
            logits,
            sparse,
        )
        compare(
            lambda x: topkgating(x, 3, 1.0, 4, True, None, "position", sparse),
            lambda x: ds_topkgating(x, 3, 1.0, 4, True, "position", sparse, topk=stable_topk),
            logits,
            sparse,
        )
    indices = top2gating(logits, 1.0, 4, False, None, False, True)[3]
    assert (indices[0] == 0).all() and torch.equal(indices[1], torch.tensor([1, 5] * 16, dtype=torch.int32))


def test_draws_are_deepspeeds_bit_for_bit():
    """The Gumbel and uniform draws equal DeepSpeed's torch.distributions rsample under one seed."""
    x = torch.empty(50, 7)
    torch.manual_seed(9)
    gumbel = ds_gumbel_rsample(x.shape, x.device)
    uniform = torch.distributions.uniform.Uniform(torch.tensor(0.0), torch.tensor(1.0)).rsample(x.shape)
    assert torch.equal(ds_compat._gumbel(x, torch.Generator().manual_seed(9)), gumbel)
    g = torch.Generator().manual_seed(9)
    ds_compat._gumbel(x, g)
    assert torch.equal(ds_compat._uniform(x, g), uniform)


# ---------------------------------------------------------------- topkgating
TOPK_CASES = [
    (k, drop, policy, sparse)
    for k in (1, 3, 5)
    for drop in (True, False)
    for policy in ("probs", "position")
    for sparse in (False, True)
]


@pytest.mark.parametrize("k,drop,policy,sparse", TOPK_CASES)
def test_topkgating_matches_deepspeed(k, drop, policy, sparse):
    """Random logits: no equal probabilities, DeepSpeed's own torch.topk."""
    logits = random_logits(96, 8, seed=17 + k)
    ours = lambda x: topkgating(x, k, 1.0, 4, drop, None, policy, sparse)  # noqa: E731
    theirs = lambda x: ds_topkgating(x, k, 1.0, 4, drop, policy, sparse)  # noqa: E731
    compare(ours, theirs, logits, sparse)


@pytest.mark.parametrize("tied", [True, "rows"])
@pytest.mark.parametrize("k,drop,policy,sparse", TOPK_CASES)
def test_topkgating_ties_go_to_the_lower_index(k, drop, policy, sparse, tied):
    """Tied logits (equal probabilities within rows and columns): DeepSpeed's algorithm with
    torch.topk's unspecified tie order pinned to the lower index: the lower expert within a
    token, the lower token within an expert (whatever rank the tied choices have)."""
    logits = random_logits(96, 8, seed=19, tied=tied)
    ours = lambda x: topkgating(x, k, 1.0, 4, drop, None, policy, sparse)  # noqa: E731
    theirs = lambda x: ds_topkgating(x, k, 1.0, 4, drop, policy, sparse, topk=stable_topk)  # noqa: E731
    compare(ours, theirs, logits, sparse)


def promoting_einsum(equation, *operands):
    dtype = torch.result_type(*operands)
    return torch.functional.einsum(equation, *(x.to(dtype) for x in operands))


@pytest.mark.parametrize("gate", ["top1", "top2", "topk"])
def test_bfloat16_logits(gate, monkeypatch):
    """DeepSpeed's dtypes (its float32 masks promote some outputs) and selections on bf16 gates.
    DeepSpeed's top2gating fails on bf16 logits (einsum "se,se->s" of bf16 gates and float32
    masks does not promote); ours computes its weights in float32, which is DeepSpeed's algorithm
    with that einsum promoting."""
    logits = random_logits(64, 8, seed=20, dtype=torch.bfloat16)
    if gate == "top2":
        with pytest.raises(RuntimeError, match="expected scalar type"):
            ds_top2gating(logits.clone(), 1.0, 4)
        monkeypatch.setattr(torch, "einsum", promoting_einsum)
    if gate == "top1":
        ours = lambda x: top1gating(x, 1.0, 4, None, "RSample", True, True)  # noqa: E731
        theirs = lambda x: ds_top1gating(x, 1.0, 4, None, "RSample", True, True)  # noqa: E731
    elif gate == "top2":
        ours = lambda x: top2gating(x, 1.0, 4)  # noqa: E731
        theirs = lambda x: ds_top2gating(x, 1.0, 4)  # noqa: E731
    else:
        ours = lambda x: topkgating(x, 3, 1.0, 4)  # noqa: E731
        theirs = lambda x: ds_topkgating(x, 3, 1.0, 4, topk=stable_topk)  # noqa: E731
    compare(ours, theirs, logits, sparse=False, grad=False)
    compare(ours, theirs, logits, sparse=False, grad=False)


# ---------------------------------------------------------------- process group (drop_tokens=False)
class FakeGroup:
    pass


def test_no_drop_capacity_is_the_max_over_the_group(monkeypatch):
    """With a group of > 1 rank the no-drop capacity is all-reduced (MAX) over it; top1gating then
    caps it at S. The collective is replaced here by a peer whose largest count is 150."""
    group, calls = FakeGroup(), []

    def all_reduce(tensor, op, group):
        calls.append((op, group, int(tensor)))
        tensor.fill_(max(int(tensor), 150))

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    logits = random_logits(96, 8, seed=22)
    assert int(top2gating(logits, 1.0, 4, False, group, False, True)[1]) == 150
    assert top2gating(logits, 1.0, 4, False, group, False)[1].shape == (96, 8, 150)
    assert int(topkgating(logits, 3, 1.0, 4, False, group, sparse_routes=True)[1]) == 150
    assert int(top1gating(logits, 1.0, 4, None, None, False, True, group, True)[1]) == 96
    assert [c[:2] for c in calls] == [(torch.distributed.ReduceOp.MAX, group)] * 4
    calls.clear()  # dropping tokens never communicates
    top2gating(logits, 1.0, 4, True, group)
    topkgating(logits, 3, 1.0, 4, True, group)
    top1gating(logits, 1.0, 4, None, None, True, True, group)
    assert calls == []


# ---------------------------------------------------------------- bad arguments
def test_bad_arguments():
    x = random_logits(16, 4, seed=23)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        top1gating(x, 1.0, 4, noisy_gate_policy="Gumbel")
    with pytest.raises(ValueError, match="min_capacity"):
        top1gating(x, 1.0, 17)
    with pytest.raises(ValueError, match="used_token"):
        top1gating(x, 1.0, 4, used_token=torch.full((16,), 2))
    with pytest.raises(ValueError, match="used_token"):
        top1gating(x, 1.0, 4, used_token=torch.ones(15))
    with pytest.raises(TypeError, match="use_rts"):
        top1gating(x, 1.0, 4, use_rts=None)
    with pytest.raises(ValueError, match="drop_policy"):
        topkgating(x, 2, 1.0, 4, drop_policy="random")
    with pytest.raises(ValueError, match="k must be"):
        topkgating(x, 5, 1.0, 4)
    with pytest.raises(ValueError, match="E >= 2"):
        top2gating(x[:, :1], 1.0, 4)
    with pytest.raises(ValueError, match="capacity_factor"):
        top2gating(x, float("nan"), 4)
    with pytest.raises(ValueError, match="capacity_factor"):
        topkgating(x, 2, -1.0, 4)
    with pytest.raises(TypeError, match="capacity_factor"):
        top2gating(x, "1.0", 4)
    with pytest.raises(TypeError, match="min_capacity"):
        top2gating(x, 1.0, 4.0)
    with pytest.raises(ValueError, match="logits"):
        top2gating(x[0], 1.0, 4)
    with pytest.raises(ValueError, match="float32 range"):
        topkgating(x, 2, 1e38, 4)
