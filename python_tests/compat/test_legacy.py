"""moe_kernels.compat against direct implementations of DeepSpeed's and Megatron's conventions
(written from their published algorithms, with ties between tokens to the lower index)."""

import math

import pytest
import torch
from tolerances import assert_close

import moe_kernels
from moe_kernels.compat import deepspeed_gating, megatron_routing


def first_c_per_expert(mask: torch.Tensor, score: torch.Tensor, C: int) -> torch.Tensor:
    """[S, E] bool: for every expert, the C entries of `mask` with the highest score (ties to the
    lower token index). Stands in for torch.topk(dim=0), whose tie order is unspecified."""
    order = torch.sort(torch.where(mask, score, float("-inf")), dim=0, descending=True, stable=True).indices
    keep = torch.zeros_like(mask)
    keep.scatter_(0, order[:C], True)
    return keep & mask


def deepspeed_direct(logits, k, capacity_factor, min_capacity):
    """DeepSpeed's top1gating / top2gating (sharded_moe.py), deterministic reading."""
    S, E = logits.shape
    gates = torch.softmax(logits, dim=1)
    C = max(min_capacity, math.ceil(S / E * capacity_factor * k))
    idx1 = torch.argmax(gates, dim=1)
    mask1 = torch.nn.functional.one_hot(idx1, E)
    me, ce = gates.mean(0), mask1.float().mean(0)
    if k == 1:
        l_aux = (me * ce).sum() * E
        exp_counts = mask1.sum(0)
        token_order = -torch.arange(S, dtype=torch.float32).unsqueeze(1).expand(S, E)
        mask1 = mask1 * first_c_per_expert(mask1.bool(), token_order, C)
        locations1 = torch.cumsum(mask1, dim=0) - 1
        loc1_s = (locations1 * mask1).sum(1)
        gates = gates * mask1.float()
        combine = torch.einsum("se,sc->sec", gates, torch.nn.functional.one_hot(loc1_s, C).float())
        return l_aux, combine, combine.bool(), exp_counts
    idx2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = torch.nn.functional.one_hot(idx2, E)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(0, keepdim=True)
    l_aux = (me * ce).mean() * E * E
    exp_counts = (mask1 + mask2).sum(0)
    mask1 = mask1 * (locations1 < C)
    mask2 = mask2 * (locations2 < C)
    loc1_s, loc2_s = (locations1 * mask1).sum(1), (locations2 * mask2).sum(1)
    g1 = (gates * mask1.float()).sum(1)
    g2 = (gates * mask2.float()).sum(1)
    denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    combine = torch.einsum(
        "se,sc->sec", g1.unsqueeze(1) * mask1.float(), torch.nn.functional.one_hot(loc1_s, C).float()
    )
    combine = combine + torch.einsum(
        "se,sc->sec", g2.unsqueeze(1) * mask2.float(), torch.nn.functional.one_hot(loc2_s, C).float()
    )
    return l_aux, combine, combine.bool(), exp_counts


def megatron_direct(logits, k, capacity_factor, drop_policy, use_pre_softmax):
    """Megatron-core's topk_softmax_with_capacity (moe_utils.py), deterministic reading."""
    T, E = logits.shape
    if use_pre_softmax:
        probs, top = torch.topk(torch.softmax(logits, dim=-1), k, dim=1)
    else:
        scores, top = torch.topk(logits, k, dim=1)
        probs = torch.softmax(scores, dim=-1)
    gates = torch.zeros_like(logits).scatter(1, top, probs)
    topk_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
    if capacity_factor is None:
        return gates, topk_map
    C = math.ceil(T * k / E * capacity_factor)
    if drop_policy == "probs":
        keep = first_c_per_expert(topk_map, gates, C)
    else:
        keep = first_c_per_expert(topk_map, -torch.arange(T, dtype=torch.float32).unsqueeze(1).expand(T, E), C)
    return gates * keep, keep


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("capacity_factor, min_capacity", [(1.0, 4), (0.5, 1), (2.0, 0), (0.1, 4)])
def test_deepspeed_matches_direct(backend, k, capacity_factor, min_capacity):
    for S, E in [(64, 8), (37, 5), (16, 1)]:
        if k > E:
            continue
        logits = torch.randn(S, E, generator=torch.Generator().manual_seed(S + E)).requires_grad_()
        with moe_kernels.use_backend(backend):
            got = deepspeed_gating(logits, k, capacity_factor, min_capacity)
        want = deepspeed_direct(logits, k, capacity_factor, min_capacity)
        assert_close(got[0], want[0])
        assert got[1].shape == want[1].shape
        assert_close(got[1], want[1])
        assert torch.equal(got[2], want[2]) and got[2].dtype == torch.bool
        assert torch.equal(got[3], want[3])
        g = torch.randn_like(want[1])
        ga = torch.autograd.grad((got[1] * g).sum() + got[0], logits)[0]
        gb = torch.autograd.grad((want[1] * g).sum() + want[0], logits)[0]
        assert_close(ga, gb)


@pytest.mark.parametrize("use_pre_softmax", [False, True])
@pytest.mark.parametrize("drop_policy", ["probs", "position"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5, 3.0])
def test_megatron_matches_direct(backend, capacity_factor, drop_policy, use_pre_softmax):
    for T, E, k in [(64, 8, 2), (33, 6, 3), (10, 4, 1), (12, 3, 3)]:
        logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).requires_grad_()
        with moe_kernels.use_backend(backend):
            probs, routing_map = megatron_routing(logits, k, capacity_factor, drop_policy, use_pre_softmax)
        want_probs, want_map = megatron_direct(logits, k, capacity_factor, drop_policy, use_pre_softmax)
        assert torch.equal(routing_map, want_map)
        assert_close(probs, want_probs)
        g = torch.randn(T, E)
        assert_close(
            torch.autograd.grad((probs * g).sum(), logits)[0], torch.autograd.grad((want_probs * g).sum(), logits)[0]
        )


def test_policies_differ_where_they_should():
    # Token 0's second choice and token 1's first choice compete for expert 1 with capacity 1:
    # DeepSpeed (first choices first) gives it to token 1, Megatron "position" to token 0.
    logits = torch.tensor([[5.0, 4.0, 0.0], [0.0, 5.0, 4.0], [4.0, 0.0, 5.0]])
    _, combine, dispatch_mask, _ = deepspeed_gating(logits, 2, capacity_factor=0.5, min_capacity=1)
    assert dispatch_mask[1, 1].any() and not dispatch_mask[0, 1].any()
    _, routing_map = megatron_routing(logits, 2, capacity_factor=0.5, drop_policy="position")
    assert routing_map[0, 1] and not routing_map[1, 1]


def test_bad_arguments():
    with pytest.raises(ValueError, match="k must be"):
        deepspeed_gating(torch.randn(4, 4), 3)
    with pytest.raises(ValueError, match="drop_policy"):
        megatron_routing(torch.randn(4, 4), 2, 1.0, drop_policy="random")
