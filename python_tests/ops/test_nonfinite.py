"""One convention for non-finite inputs, the same on every backend (issue 15, item 5; the table is
in docs/reliability.md): forward values as the reference; the gradient at a NaN input is NaN
(never a silent 0); at +-inf it is the limit (0 where the op saturates); sinkhorn propagates NaN;
softplus and sigmoid keep their tails (relative 1e-6 against torch in float64)."""

import math

import pytest
import torch

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import (
    dselect_k,
    load_probabilities,
    noisy_topk_gate,
    sinkhorn,
    smooth_step,
    topk_router,
    topk_softmax,
)

NAN, INF = float("nan"), float("inf")


def grads(backend, fn, *inputs):
    """(outputs, input gradients) of sum_i (i + 1) * outputs[i].sum() on `backend`."""
    xs = [x.clone().requires_grad_() for x in inputs]
    with moe_kernels.use_backend(backend):
        out = fn(*xs)
    out = out if isinstance(out, tuple) else (out,)
    floats = [o for o in out if o.is_floating_point() and o.requires_grad]
    sum((o.float() * (i + 1)).sum() for i, o in enumerate(floats)).backward()
    return [o.detach() for o in out], [x.grad for x in xs]


def same_nonfinite(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal NaN and +-inf patterns; finite values to float32 tolerance."""
    assert torch.equal(torch.isnan(a), torch.isnan(b)), (a, b)
    assert torch.equal(torch.isposinf(a), torch.isposinf(b)) and torch.equal(torch.isneginf(a), torch.isneginf(b))
    fa, fb = torch.nan_to_num(a.float(), 0, 0, 0), torch.nan_to_num(b.float(), 0, 0, 0)
    torch.testing.assert_close(fa, fb, rtol=1e-4, atol=1e-6)


def compare(backend, fn, *inputs):
    out, g = grads(backend, fn, *inputs)
    ref_out, ref_g = grads("torch", fn, *inputs)
    for a, b in zip(out, ref_out, strict=True):
        if a.is_floating_point():
            same_nonfinite(a, b)
        else:
            assert torch.equal(a, b)
    for a, b in zip(g, ref_g, strict=True):
        same_nonfinite(a, b)
    return out, g


VALUES = [NAN, INF, -INF]


@pytest.mark.parametrize("v", VALUES, ids=["nan", "inf", "-inf"])
def test_routing_ops(backend, v):
    x = torch.tensor([[0.5, v, -1.0, 2.0], [0.1, 0.2, 0.3, 0.4]])
    for renormalize in (False, True):
        _, (g,) = compare(backend, lambda a, r=renormalize: topk_softmax(a, 2, r)[0], x)
        if v != v:
            assert torch.isnan(g[0, 1]), "the gradient at a NaN logit is NaN, never 0"
    _, (g,) = compare(backend, lambda a: topk_router(a, 2, scoring="sigmoid")[0], x)
    if v != v:
        assert torch.isnan(g[0, 1])


@pytest.mark.parametrize("v", VALUES, ids=["nan", "inf", "-inf"])
def test_smooth_step_and_dselect_k(backend, v):
    t = torch.tensor([0.1, v, -0.2, 0.7])
    _, (g,) = compare(backend, lambda a: smooth_step(a, 1.0), t)
    assert torch.isnan(g[1]) if v != v else g[1] == 0, g
    alpha = torch.tensor([[0.5, 0.1]])
    z = torch.tensor([[[0.1, v], [0.3, -0.1]]])
    _, (ga, gz) = compare(backend, lambda a, b: dselect_k(a, b, 4, 1.0), alpha, z)
    if v != v:
        assert torch.isnan(gz[0, 0, 1])


@pytest.mark.parametrize("where", ["clean", "noisy", "stddev"])
@pytest.mark.parametrize("v", VALUES, ids=["nan", "inf", "-inf"])
def test_load_probabilities(backend, where, v):
    base = torch.tensor([[0.4, 0.1, -1.1, 2.1], [0.0, 1.0, 2.0, 3.0]])
    clean, noisy, std = base.clone(), base.clone() + 0.05, torch.ones(2, 4)
    target = {"clean": clean, "noisy": noisy, "stddev": std}[where]
    target[0, 1] = v if where != "stddev" or v != -INF else INF
    _, g = compare(backend, lambda c, n, s: load_probabilities(c, n, s, 2), clean, noisy, std)
    if v != v:
        assert torch.isnan(g[("clean", "noisy", "stddev").index(where)][0, 1]) or where == "noisy"


@pytest.mark.parametrize("where", ["clean", "raw"])
@pytest.mark.parametrize("v", VALUES, ids=["nan", "inf", "-inf"])
def test_noisy_topk_gate(backend, where, v):
    clean = torch.tensor([[0.4, 0.1, -1.1, 2.1], [0.0, 1.0, 2.0, 3.0]])
    raw = torch.zeros(2, 4)
    ({"clean": clean, "raw": raw}[where])[0, 1] = v
    noise = torch.full((2, 4), 0.5)
    compare(backend, lambda c, r: noisy_topk_gate(c, r, noise, 2), clean, raw)


def test_noisy_topk_gate_nan_raw_off_the_top(backend):
    """Issue 34, defect 4: a NaN raw_noise_stddev at an element neither selected nor a threshold
    (four NaN noisy logits rank first; k = 2 reads three of them) still gets d noise = NaN, as the
    reference's d noise = d H * stddev = 0 * NaN (the fused kernel wrote 0 off its top k+1)."""
    clean = torch.tensor([[0.4, 0.1, -1.1, 2.1, 0.3, -0.2], [0.0, 1.0, 2.0, 3.0, -1.0, 0.5]])
    raw = torch.zeros(2, 6)
    raw[0, :4] = NAN
    noise = torch.full((2, 6), 0.5)
    _, (_, g_raw, g_noise) = compare(backend, lambda c, r, n: noisy_topk_gate(c, r, n, 2), clean, raw, noise)
    assert torch.isnan(g_noise[0, 3]) and torch.isnan(g_raw[0, 3]), "the gradient at a NaN input is NaN"
    assert not torch.isnan(g_noise[1]).any()


# noise_stddev (or noise_epsilon = 0 and raw_noise_stddev) whose z = (clean - threshold) / stddev is
# infinite or so large that the normal density is 0: the gradient is the limit, 0 (issue 34, defect 5).
FLAT_STDDEVS = [0.0, 1e-45, 1e-30, 1e-20, 1e-9]


@pytest.mark.parametrize("s", FLAT_STDDEVS + [1e30, INF])
def test_load_probabilities_flat_z_has_gradient_zero(backend, s):
    """Issue 34, defect 5: Phi is flat where its density phi(z) is 0 (an infinite z, or past ~13
    standard deviations in float32); the gradients there are the limit 0 on every backend, where
    the reference's autograd gave 0 * inf = NaN (dz/ds = -z / s overflows; 0 / 0 at s = 0)."""
    clean = torch.tensor([[0.4, 0.1, -1.1, 2.1, 0.3], [0.0, 1.0, 2.0, 3.0, -0.5]])
    noisy = clean + 0.05
    std = torch.ones(2, 5)
    std[0] = s
    _, g = compare(backend, lambda c, h, st: load_probabilities(c, h, st, 2), clean, noisy, std)
    for grad in g:
        assert torch.isfinite(grad).all(), g


@pytest.mark.parametrize("raw_value", [-INF, -200.0, -100.0, -60.0])
def test_noisy_topk_gate_zero_or_tiny_stddev(backend, raw_value):
    """Issue 34, defect 5: noise_epsilon = 0 and a raw_noise_stddev whose softplus is 0 or tiny:
    the gradient is the limit (0 where the load term is flat), not NaN, on every backend."""
    clean = torch.tensor([[0.4, 0.1, -1.1, 2.1, 0.3], [0.0, 1.0, 2.0, 3.0, -0.5]])
    raw = torch.zeros(2, 5)
    raw[0, 1] = raw[0, 4] = raw_value
    noise = torch.full((2, 5), 0.3)
    noise[0, 1] = -0.5
    _, g = compare(backend, lambda c, r, n: noisy_topk_gate(c, r, n, 2, noise_epsilon=0.0), clean, raw, noise)
    for grad in g:
        assert torch.isfinite(grad).all(), g


def test_noisy_topk_gate_infinite_stddev_negative_noise(backend):
    """Issue 34, defect 5: raw_noise_stddev = +inf with negative noise gives the noisy logit -inf
    (for every large enough stddev: a constant), so d noise and d raw there are the limit 0, not
    d H * inf = NaN; off the top k+1 (row 0) and as the (k+1)-th of a row with only k finite
    noisy logits (row 1)."""
    clean = torch.tensor([[0.4, 0.1, -1.1, 2.1, 0.3], [0.0, 1.0, 2.0, 3.0, -0.5]])
    raw = torch.zeros(2, 5)
    noise = torch.full((2, 5), 0.3)
    raw[0, 2] = INF
    noise[0, 2] = -0.5
    raw[1, :3] = INF
    noise[1, :3] = -1.0
    _, g = compare(backend, lambda c, r, n: noisy_topk_gate(c, r, n, 2), clean, raw, noise)
    for grad in g:
        assert torch.isfinite(grad).all(), g


def test_softplus_tail_decides_the_ranking(backend):
    # H = 0 + 1 * Softplus(raw) with noise_epsilon 0: Softplus(-87) < Softplus(-86) < Softplus(-85)
    # (~e^raw, normal floats). A softplus flushed to 0 below e^-80 would tie them and pick expert 0.
    raw = torch.tensor([[-87.0, -86.0, -85.0, -200.0]])
    zeros, ones = torch.zeros(1, 4), torch.ones(1, 4)
    with moe_kernels.use_backend(backend):
        _, experts, _ = noisy_topk_gate(zeros, raw, ones, 3, noise_epsilon=0.0)
    assert experts.tolist() == [[2, 1, 0]]


@pytest.mark.parametrize("x", [-20.0, -80.0, -85.0, -87.0])
def test_sigmoid_tail_relative_accuracy(backend, x):
    # Sigmoid scores are returned as weights: relative 1e-6 against float64 down to float's
    # smallest normal (e^-87.3), where a flushed exp gave 0.
    logits = torch.tensor([[x, 0.0, 1.0]])
    with moe_kernels.use_backend(backend):
        w, e = topk_router(logits, 3, scoring="sigmoid")
    got = w[0, e[0].tolist().index(0)].double()
    want = torch.sigmoid(torch.tensor(x, dtype=torch.float64))
    assert math.isclose(got, want, rel_tol=1e-6), (got, want)


@pytest.mark.parametrize("case", ["nan_inside_row", "nan_row", "inf"])
def test_sinkhorn_propagates_nan(backend, case):
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    if case == "nan_inside_row":
        x[2, 1] = NAN
    elif case == "nan_row":
        x[4] = NAN
    else:
        x[1, 0] = INF
    if backend == "triton":
        pytest.skip("sinkhorn has no Triton kernel")
    with moe_kernels.use_backend(backend):
        probs, err = sinkhorn(x, 20, 1e-6, return_error=True)
    ref, info = reference.sinkhorn(x, 20, 1e-6)
    assert torch.equal(torch.isnan(probs), torch.isnan(ref))
    assert torch.isnan(probs).any(), "a NaN or inf logit makes the balancing NaN, never 'converged'"
    assert math.isnan(err) == math.isnan(float(info[1]))
