"""The topk_router reference against a per-row brute force written from the definition, its
gradients (gradcheck in float64), and the public op's argument checks."""

import math

import pytest
import torch
from shapes import adversarial_logits

from moe_kernels import reference
from moe_kernels.ops import topk_router


def rank_key(value: float, index: int):
    """Sort key for "descending value, NaN above every number, ties to the lower index"."""
    return (0 if math.isnan(value) else 1, 0.0 if math.isnan(value) else -value, index)


def brute_force(logits, k, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor):
    """One row at a time; choices among values in Python. Scores and choice values are rounded to
    float32 as in the definition (a float64 score could break a float32 tie)."""
    x = logits.float()
    T, E = x.shape
    weights, experts = torch.zeros(T, k, dtype=torch.float64), torch.zeros(T, k, dtype=torch.int64)
    for t in range(T):
        row = x[t]
        if scoring == "sigmoid":
            scores = torch.sigmoid(row)
        elif row.max() == float("-inf"):
            scores = torch.zeros(E, dtype=torch.float64)
        else:
            scores = torch.softmax(row, dim=0)
        grouped = topk_groups is not None and topk_groups < num_groups
        if bias is None and not grouped:
            key = row.tolist()
        else:
            key = (scores + (0 if bias is None else bias.float())).tolist()
        candidates = list(range(E))
        if grouped:
            size = E // num_groups
            group_scores = []
            for g in range(num_groups):
                members = sorted((key[e] for e in range(g * size, (g + 1) * size)), key=lambda v: rank_key(v, 0))
                top2 = torch.tensor(members[:2], dtype=torch.float32).sum().item()  # summed in float32
                group_scores.append(members[0] if group_scoring == "max" else top2)
            best = sorted(range(num_groups), key=lambda g: rank_key(group_scores[g], g))[:topk_groups]
            candidates = [e for e in range(E) if e // size in best]
        chosen = sorted(candidates, key=lambda e: rank_key(key[e], e))[:k]
        w = scores[chosen]
        if renormalize:
            w = w / w.sum() if w.sum() != 0 else torch.zeros_like(w)
        weights[t], experts[t] = w.double() * scaling_factor, torch.tensor(chosen)
    return weights, experts


CONFIGS = [
    # (E, k, scoring, biased, num_groups, topk_groups, group_scoring, renormalize, scaling_factor)
    (8, 2, "softmax", False, 1, None, "top2_sum", True, 1.0),  # Mixtral
    (8, 2, "softmax", False, 1, None, "top2_sum", False, 1.0),  # Qwen2-MoE, norm_topk_prob=False
    (16, 4, "sigmoid", True, 4, 2, "top2_sum", True, 2.5),  # DeepSeek-V3 / GLM-4.5 / dots1
    (16, 3, "softmax", False, 4, 2, "max", False, 16.0),  # DeepSeek-V2 group_limited_greedy
    (12, 2, "sigmoid", True, 1, None, "top2_sum", True, 1.0),  # MiniMax-M2
    (12, 2, "softmax", True, 1, None, "top2_sum", True, 1.0),  # Ernie 4.5
    (5, 1, "sigmoid", False, 1, None, "top2_sum", False, 1.0),  # Llama 4
    (6, 6, "softmax", False, 3, 3, "top2_sum", True, 1.0),  # k = E, every group eligible
    (6, 2, "sigmoid", True, 3, 1, "top2_sum", False, 1.0),  # k = the eligible experts
    (1, 1, "softmax", True, 1, None, "top2_sum", True, 1.0),  # one expert
]


def make_bias(E, seed):
    return 0.1 * torch.randn(E, generator=torch.Generator().manual_seed(seed + 99))


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", ["random", "ties", "all_equal", "neg_inf", "all_neg_inf", "large", "nan"])
def test_reference_matches_brute_force(config, kind):
    E, k, scoring, biased, G, topk_groups, group_scoring, renormalize, scale = config
    if kind == "nan":
        logits = adversarial_logits("random", 9, E, seed=E)
        logits[torch.rand(9, E, generator=torch.Generator().manual_seed(3)) < 0.1] = float("nan")
    else:
        logits = adversarial_logits(kind, 9, E, seed=E)
    bias = make_bias(E, E) if biased else None
    if kind == "ties" and bias is not None:
        bias = torch.round(bias * 10) / 10  # ties in choice too: few distinct bias values
    args = dict(
        scoring=scoring,
        bias=bias,
        num_groups=G,
        topk_groups=topk_groups,
        group_scoring=group_scoring,
        renormalize=renormalize,
        scaling_factor=scale,
    )
    w, e = reference.topk_router(logits, k, **args)
    w_bf, e_bf = brute_force(logits, k, scoring, bias, G, topk_groups, group_scoring, renormalize, scale)
    assert w.dtype == torch.float32 and e.dtype == torch.int64 and w.shape == e.shape == (9, k)
    assert torch.equal(e, e_bf), (kind, config, e, e_bf)
    torch.testing.assert_close(w.double(), w_bf, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_group_limit_excludes_better_experts():
    # Expert 0 has the best score but sits in the worse group: it must not be selected.
    logits = torch.tensor([[5.0, -9.0, 1.0, 1.0]])
    w, e = reference.topk_router(logits, 1, scoring="sigmoid", num_groups=2, topk_groups=1)
    assert e.tolist() == [[2]]
    w, e = reference.topk_router(logits, 1, scoring="sigmoid", num_groups=2, topk_groups=1, group_scoring="max")
    assert e.tolist() == [[0]]


def test_bias_selects_but_does_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 1.0])
    w, e = reference.topk_router(logits, 1, scoring="sigmoid", bias=bias)
    assert e.tolist() == [[2]]
    assert w.item() == pytest.approx(torch.sigmoid(torch.tensor(0.0)).item())


def test_no_bias_ranks_saturated_sigmoid_by_logit():
    # sigmoid(30) == sigmoid(20) == 1.0 in float32; the logits still order them.
    logits = torch.tensor([[20.0, 30.0, 0.0]])
    _, e = reference.topk_router(logits, 1, scoring="sigmoid")
    assert e.tolist() == [[1]]


def test_zero_sum_renormalizes_to_zero():
    logits = torch.full((2, 4), float("-inf"))
    w, e = reference.topk_router(logits, 2, renormalize=True)
    assert torch.equal(w, torch.zeros(2, 2)) and e.tolist() == [[0, 1], [0, 1]]
    w, _ = reference.topk_router(logits, 2, scoring="sigmoid", renormalize=True)
    assert torch.equal(w, torch.zeros(2, 2))


@pytest.mark.parametrize("config", CONFIGS)
def test_gradcheck_float64(config):
    E, k, scoring, biased, G, topk_groups, group_scoring, renormalize, scale = config
    logits = torch.randn(5, E, dtype=torch.float64, generator=torch.Generator().manual_seed(E), requires_grad=True)
    bias = make_bias(E, E).double() if biased else None

    def f(x):
        return reference.topk_router(
            x,
            k,
            scoring=scoring,
            bias=bias,
            num_groups=G,
            topk_groups=topk_groups,
            group_scoring=group_scoring,
            renormalize=renormalize,
            scaling_factor=scale,
        )[0]

    assert f(logits).dtype == torch.float64
    torch.autograd.gradcheck(f, (logits,))


def test_no_gradient_to_bias_and_masked_rows():
    logits = torch.randn(3, 6, requires_grad=True)
    with torch.no_grad():
        logits[1] = float("-inf")
    bias = torch.zeros(6, requires_grad=True)
    w, _ = reference.topk_router(logits, 2, bias=bias, renormalize=True)
    w.sum().backward()
    assert bias.grad is None
    assert torch.equal(logits.grad[1], torch.zeros(6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_computed_in_float32(dtype):
    """The reference computes fp16 / bf16 logits in float32 exactly as float32 logits; the public op
    (a kernel, whose sigmoid may differ from torch's in the last bit) returns float32 too."""
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
    w32, e32 = reference.topk_router(logits.float(), 2, scoring="sigmoid", renormalize=True)
    w, e = reference.topk_router(logits, 2, scoring="sigmoid", renormalize=True)
    assert w.dtype == torch.float32 and torch.equal(e, e32) and torch.equal(w, w32)
    w, e = topk_router(logits, 2, scoring="sigmoid", renormalize=True)
    assert w.dtype == torch.float32 and torch.equal(e, e32)
    torch.testing.assert_close(w, w32, rtol=1e-6, atol=1e-7)


def test_empty_batch():
    w, e = topk_router(torch.empty(0, 8), 2, scoring="sigmoid", bias=torch.zeros(8), num_groups=4, topk_groups=2)
    assert w.shape == e.shape == (0, 2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(logits=torch.randn(4)), ValueError, r"logits must be \[T, E\]"),
        (dict(logits=torch.randint(0, 3, (4, 8))), TypeError, "logits must have dtype"),
        (dict(k=0), ValueError, "k must be in"),
        (dict(k=9), ValueError, "k must be in"),
        (dict(k=2.0), TypeError, "k must be an int"),
        (dict(scoring="relu"), ValueError, "scoring must be one of"),
        (dict(scoring=None), TypeError, "scoring must be a str"),
        (dict(group_scoring="sum"), ValueError, "group_scoring must be one of"),
        (dict(num_groups=3), ValueError, "num_groups must divide"),
        (dict(num_groups=0), ValueError, "num_groups must be in"),
        (dict(num_groups=4, topk_groups=5), ValueError, "topk_groups must be in"),
        (dict(num_groups=4, topk_groups=1, k=3), ValueError, "eligible experts"),
        (dict(num_groups=8, topk_groups=2), ValueError, "top2_sum' needs groups of >= 2"),
        (dict(bias=torch.zeros(7)), ValueError, r"bias must be \[E\] = \[8\]"),
        (dict(bias=torch.zeros(8, dtype=torch.int64)), TypeError, "bias must have dtype"),
        (dict(bias=torch.zeros(8, device="meta")), ValueError, "bias is on meta but logits"),
        (dict(renormalize=1), TypeError, "renormalize must be a bool"),
        (dict(scaling_factor=float("nan")), ValueError, "scaling_factor must be finite"),
        (dict(scaling_factor=float("inf")), ValueError, "scaling_factor must be finite"),
        (dict(scaling_factor=-float("inf")), ValueError, "scaling_factor must be finite"),
        (dict(scaling_factor="2"), TypeError, "scaling_factor must be a float"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    args = dict(logits=torch.randn(4, 8), k=2)
    args.update(kwargs)
    logits, k = args.pop("logits"), args.pop("k")
    with pytest.raises(error, match=match):
        topk_router(logits, k, **args)
