"""Property-based fuzzing (issue 15, item 7): every op on every backend of this run against the
reference, on generated inputs (python_tests/support/fuzz_inputs.py: T = 0 and E = 1 included, k = E,
every dtype, strided layouts, ties, -inf, NaN, -0, extremes). Exact indices and masks, values and
gradients to the suite's tolerances (tolerances.py), NaN where the reference has NaN.

Each test runs the profile's number of cases (500 per op per backend in CI, derandomised, so a
run is reproducible; MOE_KERNELS_FUZZ=long for 20,000 random ones). A failure prints the case;
the tensors are rebuilt from it (fuzz_inputs.values).
"""

from __future__ import annotations

import pytest
import torch
from fuzz_inputs import FINITE_KINDS, case, routing_choices, values
from hypothesis import given
from hypothesis import strategies as st
from tolerances import TOL

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import (
    balanced_assignment,
    batchwise_mask,
    capacity_positions,
    combine,
    dispatch,
    dselect_k,
    gumbel_matching,
    load_probabilities,
    noisy_topk_gate,
    permute,
    sinkhorn,
    skip_sample,
    smooth_step,
    topk_router,
    topk_softmax,
    unpermute,
)

pytestmark = pytest.mark.fuzz


def same(actual, expected, dtype=None, what=""):
    """Integer / bool tensors equal; floating ones within the dtype's tolerance, NaN where NaN."""
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"
        return
    tol = TOL[dtype or actual.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), equal_nan=True, msg=what or None, **tol)


def outputs_and_grads(backend, fn, inputs, upstream_seed=0):
    """fn's outputs (a tuple) on `backend` and the gradients of a fixed random combination of its
    floating outputs with respect to each input that requires grad."""
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    if backend is None:
        out = fn(*xs)
    else:
        with moe_kernels.use_backend(backend):
            out = fn(*xs)
    out = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(upstream_seed)
    terms = [
        (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).nansum()
        for o in out
        if o.is_floating_point() and o.requires_grad
    ]
    wanted = [x for x in xs if x.requires_grad]
    if not terms or not wanted:
        return out, []
    grads = torch.autograd.grad(sum(terms), wanted, allow_unused=True)
    return out, [torch.zeros_like(x) if gx is None else gx for x, gx in zip(wanted, grads, strict=True)]


def check(backend, fn, inputs, *, grads=True, dtype=None):
    """fn on `backend` against fn on the reference ("torch"), outputs and gradients."""
    out, g = outputs_and_grads(backend, fn, inputs)
    ref, ref_g = outputs_and_grads("torch", fn, inputs)
    for i, (a, b) in enumerate(zip(out, ref, strict=True)):
        same(a, b, dtype, f"output {i}")
    if grads:
        for i, (a, b) in enumerate(zip(g, ref_g, strict=True)):
            # A gradient comes rounded to its input's dtype: where that is float16 / bfloat16,
            # float32 work an ulp apart can round to neighbouring values (seen: topk_router's
            # weights one float32 ulp from the reference's, a float16 gradient one float16 ulp
            # from it), so it is compared at its own dtype's tolerance, not `dtype`'s.
            low = a.dtype in (torch.float16, torch.bfloat16)
            same(a, b, a.dtype if low else dtype, f"gradient {i}")


def compared(backend):
    """Skip the reference itself: compared with itself, a case cannot fail."""
    if backend == "torch":
        pytest.skip("the reference is the specification these tests compare the kernels with")


def k_for(draw_k, E):
    return min(max(draw_k, 1), E)


@given(c=case(), k=st.integers(1, 9), renormalize=st.booleans())
def test_topk_softmax(backend, c, k, renormalize):
    compared(backend)
    x = values((c["T"], c["E"]), c["dtype"], c["kind"], c["seed"], noncontiguous=c["noncontiguous"])
    k = k_for(k, c["E"])
    check(backend, lambda a: topk_softmax(a, k, renormalize), [x])


@st.composite
def router_args(draw):
    c = draw(case(max_e=12))
    E = c["E"]
    groups = draw(st.sampled_from([d for d in range(1, E + 1) if E % d == 0]))
    topk_groups = draw(st.integers(1, groups))
    group_scoring = draw(st.sampled_from(["top2_sum", "max"]))
    if group_scoring == "top2_sum" and topk_groups < groups and E // groups < 2:
        group_scoring = "max"
    k = draw(st.integers(1, topk_groups * (E // groups)))
    return (
        c,
        dict(
            scoring=draw(st.sampled_from(["softmax", "sigmoid"])),
            num_groups=groups,
            topk_groups=topk_groups,
            group_scoring=group_scoring,
            renormalize=draw(st.booleans()),
            scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        ),
        k,
        draw(st.booleans()),
    )


@given(args=router_args())
def test_topk_router(backend, args):
    compared(backend)
    c, kw, k, with_bias = args
    x = values((c["T"], c["E"]), c["dtype"], c["kind"], c["seed"], noncontiguous=c["noncontiguous"])
    bias = values((c["E"],), torch.float32, "ties", c["seed"] + 1) * 0.25 if with_bias else None
    # Weights are float32 (float64 for float64 logits) whatever the logits' dtype: compare there.
    out_dtype = torch.float64 if c["dtype"] == torch.float64 else torch.float32
    check(backend, lambda a: topk_router(a, k, bias=bias, **kw), [x], dtype=out_dtype)


@given(
    c=case(kinds=("randn", "wide", "ties", "inf", "nan", "zeros")),
    k=st.integers(1, 9),
    noise_seed=st.integers(0, 99),
)
def test_load_probabilities_and_noisy_topk_gate(backend, c, k, noise_seed):
    compared(backend)
    T, E, dtype = c["T"], c["E"], c["dtype"]
    k = k_for(k, E)
    clean = values((T, E), dtype, c["kind"], c["seed"], noncontiguous=c["noncontiguous"])
    raw = values((T, E), dtype, "randn", c["seed"] + 1)
    noise = values((T, E), dtype, "randn", noise_seed)
    stddev = (torch.nn.functional.softplus(raw.float()) + 1e-2).to(dtype)
    noisy = (clean.float() + noise.float() * stddev.float()).to(dtype)
    check(backend, lambda a, b, s: load_probabilities(a, b, s, k), [clean, noisy, stddev])
    mask = None if noise_seed % 2 else (torch.arange(T) % 3 != 1)
    # The load is float32, but from noisy logits and a stddev rounded to the inputs' dtype (as the
    # unfused torch sequence rounds them): compared at the inputs' tolerance.
    check(backend, lambda a, r: noisy_topk_gate(a, r, noise, k, 1e-2, mask), [clean, raw], dtype=dtype)


@given(c=case(), gamma=st.sampled_from([1.0, 0.3, 5.0]))
def test_smooth_step(backend, c, gamma):
    compared(backend)
    t = values((c["T"], c["E"]), c["dtype"], c["kind"], c["seed"], noncontiguous=c["noncontiguous"])
    check(backend, lambda a: smooth_step(a, gamma), [t])


@given(
    c=case(max_t=5, kinds=("randn", "wide", "ties", "zeros", "nan")),
    n=st.integers(1, 9),
    k=st.integers(1, 4),
    static=st.booleans(),
    gamma=st.sampled_from([1.0, 0.5]),
)
def test_dselect_k(backend, c, n, k, static, gamma):
    compared(backend)
    m = (n - 1).bit_length()  # ceil(log2(n)): 0 for one expert
    B = c["T"]
    alpha = values((k,) if static else (B, k), c["dtype"], c["kind"], c["seed"])
    z = values((k, m) if static else (B, k, m), c["dtype"], c["kind"], c["seed"] + 1) * 0.4
    check(backend, lambda a, b: dselect_k(a, b, n, gamma), [alpha, z])


@given(c=case(max_t=12), m=st.integers(0, 12))
def test_batchwise_mask(backend, c, m):
    compared(backend)
    scores = values((c["T"], c["E"]), c["dtype"], c["kind"], c["seed"], noncontiguous=c["noncontiguous"])
    m = min(m, c["T"])
    check(backend, lambda a: batchwise_mask(a, m, return_indices=True), [scores], grads=False)


@given(
    c=case(max_t=10, max_e=6, kinds=FINITE_KINDS),
    k=st.integers(1, 6),
    capacity=st.integers(0, 6),
    with_priority=st.booleans(),
    d=st.integers(1, 4),
)
def test_capacity_dispatch_combine_permute(backend, c, k, capacity, with_priority, d):
    compared(backend)
    T, E, dtype = c["T"], c["E"], c["dtype"]
    k = k_for(k, E)
    experts = routing_choices(T, E, k, c["seed"])
    priority = values((T, k), torch.float32, "ties", c["seed"] + 1) if with_priority else None
    check(backend, lambda: capacity_positions(experts, E, capacity, priority=priority), [])
    positions, _ = reference.capacity_positions(experts, E, capacity, priority=priority)
    x = values((T, d), dtype, c["kind"], c["seed"] + 2, noncontiguous=c["noncontiguous"])
    check(backend, lambda a: dispatch(a, experts, positions, E, capacity), [x])
    buffer = values((E, capacity, d), dtype, c["kind"], c["seed"] + 3)
    weights = values((T, k), dtype, "randn", c["seed"] + 4)
    check(backend, lambda b, w: combine(b, experts, positions, w), [buffer, weights])
    check(backend, lambda a: permute(a, experts, E), [x])
    y_sorted, _, order = reference.permute(x, experts, E)
    check(backend, lambda y, w: unpermute(y, order, w, T), [y_sorted, weights])


def _kernel_less(backend, op):
    if backend == "triton":
        pytest.skip(f"{op} has no Triton kernel")


@given(c=case(max_t=8, max_e=5, kinds=("randn", "wide", "ties", "inf", "nan", "zeros")), iters=st.integers(1, 30))
def test_sinkhorn(backend, c, iters):
    compared(backend)
    _kernel_less(backend, "sinkhorn")
    x = values((c["T"], c["E"]), c["dtype"], c["kind"], c["seed"], noncontiguous=c["noncontiguous"])
    with moe_kernels.use_backend(backend):
        probs, err = sinkhorn(x, iters, 1e-6, return_error=True)
    ref, info = reference.sinkhorn(x, iters, 1e-6)
    # float32 iterations in a different summation order: close, not equal; NaN where NaN.
    torch.testing.assert_close(probs.double(), ref.double(), equal_nan=True, atol=1e-4, rtol=1e-3)
    assert (err != err) == bool(torch.isnan(info[1]))


@given(c=case(min_t=1, max_t=9, max_e=4, kinds=("randn", "ties", "zeros", "wide")), slack=st.integers(0, 3))
def test_balanced_assignment_and_gumbel_matching(backend, c, slack):
    _kernel_less(backend, "balanced_assignment")
    T, E = c["T"], c["E"]
    scores = values((T, E), c["dtype"], c["kind"], c["seed"], noncontiguous=c["noncontiguous"])
    capacity = -(-T // E) + slack
    with moe_kernels.use_backend(backend):
        z = balanced_assignment(scores, capacity)
        zg = gumbel_matching(scores.float(), capacity=capacity, gumbels=torch.zeros(T, E))[0]
    ref = reference.balanced_assignment(scores, capacity)[0]
    s = scores.double()
    for got in (z, zg):
        assert int(torch.bincount(got, minlength=E).max()) <= capacity
    # Optimal: the same total score as the reference (the assignment itself may differ on ties).
    value, ref_value = s.gather(1, z[:, None]).sum(), s.gather(1, ref[:, None]).sum()
    assert abs(float(value - ref_value)) <= 1e-9 * max(1.0, float(s.abs().max())) * T, (z, ref)


@given(c=case(min_t=1, kinds=("randn", "ties", "wide")), capacity=st.integers(1, 5), seed=st.integers(0, 99))
def test_skip_sample(c, capacity, seed):
    # One implementation (vectorised torch): its invariants, not a comparison.
    probs = values((c["T"], c["E"]), c["dtype"], c["kind"], c["seed"]).double().abs().to(c["dtype"]) + 0.01
    experts, kept, weights = skip_sample(probs, capacity, generator=torch.Generator().manual_seed(seed))
    counts = torch.bincount(experts, minlength=c["E"])
    assert int(kept.sum()) == int(counts.clamp(max=capacity).sum())
    kept_per_expert = torch.bincount(experts[kept], minlength=c["E"])
    assert torch.equal(kept_per_expert, counts.clamp(max=capacity))
    sums = torch.zeros(c["E"], dtype=torch.float64).index_add_(0, experts, weights.double())
    torch.testing.assert_close(sums, counts.double(), **TOL[c["dtype"]])
