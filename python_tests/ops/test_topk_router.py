"""topk_router: every backend against the reference, forward and backward, on random, tied,
grouped, biased and adversarial input."""

import pytest
import torch
from shapes import ADVERSARIAL_KINDS, adversarial_logits
from tolerances import assert_close

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import topk_router, topk_softmax

# (name, E, k, kwargs): one line per router shape of the families in docs/routers.md.
ROUTERS = [
    ("mixtral", 8, 2, dict(renormalize=True)),
    ("qwen2_moe", 60, 4, dict()),
    ("qwen3_moe_norm_topk", 64, 8, dict(renormalize=True, scaling_factor=1.5)),  # the plain path's k = 8
    ("llama4", 16, 1, dict(scoring="sigmoid")),
    ("sigmoid_renorm_scaled", 24, 3, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.5)),
    ("minimax_m2", 32, 8, dict(scoring="sigmoid", bias=True, renormalize=True)),
    ("ernie", 16, 4, dict(bias=True, renormalize=True)),
    (
        "deepseek_v3",
        64,
        8,
        dict(scoring="sigmoid", bias=True, num_groups=8, topk_groups=4, renormalize=True, scaling_factor=2.5),
    ),
    ("deepseek_v2", 64, 6, dict(num_groups=8, topk_groups=3, group_scoring="max", scaling_factor=16.0)),
    ("groups_no_bias_sigmoid", 12, 2, dict(scoring="sigmoid", num_groups=4, topk_groups=2)),
    ("k_is_eligible", 12, 6, dict(scoring="sigmoid", bias=True, num_groups=4, topk_groups=2)),
    ("k_is_E", 5, 5, dict(renormalize=True)),
    ("one_expert", 1, 1, dict(bias=True)),
    ("wide", 300, 20, dict(scoring="sigmoid", bias=True, num_groups=10, topk_groups=5)),  # k above the insertion limit
]
ROUTER_IDS = [r[0] for r in ROUTERS]


def kwargs_for(E, kwargs, seed=0, dtype=torch.float32):
    out = dict(kwargs)
    if out.get("bias"):
        out["bias"] = (0.05 * torch.randn(E, generator=torch.Generator().manual_seed(seed + 7))).to(dtype)
    return out


def run(backend, logits, k, **kwargs):
    with moe_kernels.use_backend(backend):
        return topk_router(logits, k, **kwargs)


def selection_gap(logits, k, kwargs):
    """Per row: the gap between the k-th and (k+1)-th choice values (inf if there is none).

    With a bias or groups the choice values go through exp, whose last bit can differ between
    backends; rows whose gap is below a few ulps may then rank differently (docs/routers.md,
    Exactness). Exact ties (equal logits and biases) give equal values on every backend.
    """
    if kwargs.get("bias") is None and kwargs.get("num_groups", 1) == 1:
        return torch.full((logits.shape[0],), float("inf"))
    x = logits.float()
    scores = reference.topk_router.__globals__["router_scores"](x, kwargs.get("scoring", "softmax"))
    choice = scores + (kwargs["bias"].float() if kwargs.get("bias") is not None else 0)
    if choice.shape[1] <= k:
        return torch.full((logits.shape[0],), float("inf"))
    top = torch.sort(choice, dim=1, descending=True)[0]
    gaps = (top[:, k - 1] - top[:, k]).abs()
    return torch.where(gaps == 0, float("inf"), gaps)  # an exact tie is decided exactly


def assert_same_selection(e, e_ref, logits, k, kwargs):
    differ = (e != e_ref).any(dim=1)
    if differ.any():
        near = selection_gap(logits, k, kwargs) < 1e-6
        assert bool((~differ | near).all()), f"experts differ on rows without a near tie: {differ.nonzero().tolist()}"


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_matches_reference_random(backend, router, dtype):
    _, E, k, kw = router
    for T in (0, 1, 37):
        logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T + E)).to(dtype)
        kwargs = kwargs_for(E, kw, seed=T)
        w, e = run(backend, logits, k, **kwargs)
        w_ref, e_ref = reference.topk_router(logits, k, **kwargs)
        assert w.shape == e.shape == (T, k)
        assert w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and e.dtype == torch.int64
        assert_same_selection(e, e_ref, logits, k, kwargs)
        same = (e == e_ref).all(dim=1)
        assert_close(w[same], w_ref[same])


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS + ["nan", "pos_inf"])
def test_adversarial(backend, router, kind):
    _, E, k, kw = router
    if kind == "nan":
        logits = adversarial_logits("ties", 11, E, seed=E)
        logits[torch.rand(11, E, generator=torch.Generator().manual_seed(E)) < 0.15] = float("nan")
    elif kind == "pos_inf":
        logits = adversarial_logits("random", 11, E, seed=E)
        logits[torch.rand(11, E, generator=torch.Generator().manual_seed(E)) < 0.1] = float("inf")
    else:
        logits = adversarial_logits(kind, 11, E, seed=E)
    kwargs = kwargs_for(E, kw)
    if kind in ("ties", "all_equal", "signed_zero") and kwargs.get("bias") is not None:
        kwargs["bias"] = torch.round(kwargs["bias"] * 20) / 20  # ties in the choice values too
    w, e = run(backend, logits, k, **kwargs)
    w_ref, e_ref = reference.topk_router(logits, k, **kwargs)
    # Ties, -0, masked rows and NaN are decided exactly on every backend: no near-tie allowance.
    if kind in ("ties", "all_equal", "signed_zero", "all_neg_inf", "nan"):
        assert torch.equal(e, e_ref), (kind, e, e_ref)
    else:
        assert_same_selection(e, e_ref, logits, k, kwargs)
    same = (e == e_ref).all(dim=1)
    assert_close(w[same], w_ref[same])


# torch.sigmoid(x) = 1 / (1 + e^-x) in float32 is exactly 0 below this (e^-x overflows); the
# float32 just above it, -88.72283172607422, still gives a denormal (docs/reliability.md, Tails).
SIGMOID_ZERO_BELOW = -88.72283172607422


@pytest.mark.parametrize(
    "k, kwargs", [(3, dict(bias=True)), (2, dict(num_groups=2, topk_groups=1))], ids=["bias", "groups"]
)
def test_sigmoid_scores_vanish_where_torch_sigmoid_does(backend, k, kwargs):
    """Issue 34, defect 2: the reference's torch.sigmoid gives 0 below x = -88.7228 in float32;
    the kernels kept denormal scores down to x = -104, so with a bias or groups (which rank the
    scores) such experts ranked by their logits where the reference ties them at 0 (the lower
    index first, the lower group first)."""
    kw = dict(kwargs, bias=torch.zeros(4) if kwargs.get("bias") else None)
    logits = torch.tensor(
        [
            [-95.0, -90.0, 0.0, -1.0],  # bias: two zero scores, expert 0 third
            [-95.0, -90.0, -100.0, -89.0],  # groups: both group scores 0, group 0 first
            [-1.0, -2.0, -95.0, -89.5],
            [SIGMOID_ZERO_BELOW - 1e-5, -100.0, -3.0, -4.0],  # the first float below the boundary: 0
            [SIGMOID_ZERO_BELOW, -100.0, -3.0, -95.0],  # the last float above it: a denormal
        ]
    )
    got_w, got_e = run(backend, logits, k, scoring="sigmoid", **kw)
    want_w, want_e = reference.topk_router(logits, k, scoring="sigmoid", **kw)
    assert torch.equal(got_e, want_e)
    assert torch.equal(got_w == 0, want_w == 0)
    assert_close(got_w, want_w)
    # Every float32 in the tail: 0 exactly where torch.sigmoid is 0 (the denormals above the
    # boundary within a few of their ulps of torch's).
    x = torch.cat([torch.linspace(-106.0, -86.0, 2047), torch.tensor([SIGMOID_ZERO_BELOW])]).view(-1, 8)
    w, e = run(backend, x, 8, scoring="sigmoid", bias=torch.zeros(8))
    scores = torch.zeros_like(x).scatter(1, e, w)
    want = torch.sigmoid(x)
    assert torch.equal(scores == 0, want == 0), x[(scores == 0) != (want == 0)]
    assert (scores - want).abs().max() <= 4 * 2.0**-149 + 1e-6 * want.abs().max()


def test_non_contiguous(backend):
    base = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    views = {64: [base[:, :64], base.t().contiguous().t()[:, 64:], base[::2, ::2]], 8: [base[::3, ::16]]}
    for _, E, k, kw in ROUTERS:
        for x in views.get(E, []):
            assert not x.is_contiguous()
            kwargs = kwargs_for(E, kw)
            w, e = run(backend, x, k, **kwargs)
            w_ref, e_ref = reference.topk_router(x.contiguous(), k, **kwargs)
            assert_same_selection(e, e_ref, x, k, kwargs)
            assert_close(w, w_ref)


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_gradients_match_reference(backend, router, dtype):
    _, E, k, kw = router
    logits = torch.randn(23, E, generator=torch.Generator().manual_seed(E)).to(dtype)
    logits[3] = float("-inf")  # a fully masked token
    if E > 2:
        logits[5, :2] = float("-inf")
    kwargs = kwargs_for(E, kw)
    grad_w = torch.randn(23, k, generator=torch.Generator().manual_seed(2))
    x = logits.clone().requires_grad_()
    w, e = run(backend, x, k, **kwargs)
    (g,) = torch.autograd.grad((w * grad_w.to(w.dtype)).sum(), x)
    x_ref = logits.clone().requires_grad_()
    w_ref, e_ref = reference.topk_router(x_ref, k, **kwargs)
    (g_ref,) = torch.autograd.grad((w_ref * grad_w.to(w_ref.dtype)).sum(), x_ref)
    assert torch.equal(e, e_ref)
    assert g.dtype == dtype
    assert_close(g.double(), g_ref.double(), dtype=torch.float32 if dtype != torch.float64 else torch.float64)


@pytest.mark.parametrize("router", ROUTERS[:8], ids=ROUTER_IDS[:8])
def test_gradcheck_float64(kernel_backend, router):
    _, E, k, kw = router
    logits = torch.randn(6, E, dtype=torch.float64, generator=torch.Generator().manual_seed(E), requires_grad=True)
    kwargs = kwargs_for(E, kw, dtype=torch.float64)
    with moe_kernels.use_backend(kernel_backend):
        torch.autograd.gradcheck(lambda x: topk_router(x, k, **kwargs)[0], (logits,))


def test_no_gradient_to_bias(backend):
    logits = torch.randn(9, 16, requires_grad=True)
    bias = torch.zeros(16, requires_grad=True)
    w, _ = run(backend, logits, 2, scoring="sigmoid", bias=bias, num_groups=4, topk_groups=2)
    w.sum().backward()
    assert bias.grad is None and logits.grad is not None


def test_opcheck():
    if not moe_kernels._extension.has_kernel("topk_router", "CPU"):
        pytest.skip("no C++ kernel in this build")
    op = torch.ops.moe_kernels.topk_router
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 8, 8)]:
        for scoring in ("softmax", "sigmoid"):
            logits = torch.randn(T, E, requires_grad=True)
            torch.library.opcheck(op, (logits, k, scoring, None, 1, 1, "top2_sum", True, 1.0))
            torch.library.opcheck(op, (logits, min(k, 4), scoring, torch.randn(E), 2, 1, "max", False, 2.0))
            _, experts = reference.topk_router(logits.detach(), k, scoring=scoring)
            torch.library.opcheck(
                torch.ops.moe_kernels.topk_router_backward,
                (torch.randn(T, k), logits.detach(), experts, scoring, True, 1.5, True),
            )


@pytest.mark.parametrize("bad", [-1, 8, 10**6])
def test_backward_rejects_out_of_range_experts(bad):
    # A raw call with malicious indices raises instead of reading or writing out of bounds.
    if not moe_kernels._extension.has_kernel("topk_router_backward", "CPU"):
        pytest.skip("no C++ kernel in this build")
    experts = torch.tensor([[0, 1], [2, bad]])
    with pytest.raises(IndexError, match="experts"):
        torch.ops.moe_kernels.topk_router_backward(
            torch.randn(2, 2), torch.randn(2, 8), experts, "softmax", True, 1.0, False
        )


@pytest.mark.parametrize("kind", [*ADVERSARIAL_KINDS, "nan", "pos_inf"])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_backward_ranked_by_logits_reads_the_shift_at_the_first_expert(kind, renormalize, dtype):
    """ranked_by_logits=True (the forward ranked the logits: no bias, one group) takes each row's
    softmax shift at experts[:, 0] instead of a pass over the row: the same bits as finding it, on
    masked, NaN and +inf rows too."""
    if not moe_kernels._extension.has_kernel("topk_router_backward", "CPU"):
        pytest.skip("no C++ kernel in this build")
    E, k = 37, 5
    if kind in ("nan", "pos_inf"):
        logits = torch.randn(40, E, generator=torch.Generator().manual_seed(5))
        logits[3, 11] = float("nan" if kind == "nan" else "inf")
        logits[9, 2] = float("nan" if kind == "nan" else "inf")
    else:
        logits = adversarial_logits(kind, 40, E, seed=5)
    logits = logits.to(dtype)
    _, experts = reference.topk_router(logits, k)
    g = torch.randn(40, k, generator=torch.Generator().manual_seed(6))
    op = torch.ops.moe_kernels.topk_router_backward
    found = op(g, logits, experts, "softmax", renormalize, 1.5, False)
    read = op(g, logits, experts, "softmax", renormalize, 1.5, True)
    assert torch.equal(found.isnan(), read.isnan()), kind
    assert torch.equal(found.nan_to_num(), read.nan_to_num()), kind


def _from_weights_kernel():
    if not moe_kernels._extension.has_kernel("topk_router_backward_from_weights", "CPU"):
        pytest.skip("no C++ from-weights backward in this build")
    return torch.ops.moe_kernels.topk_router_backward_from_weights


# The routers whose backward autograd takes from their weights: softmax scores, renormalised.
FROM_WEIGHTS = [r for r in ROUTERS if r[3].get("scoring", "softmax") == "softmax" and r[3].get("renormalize")]


@pytest.mark.parametrize("router", FROM_WEIGHTS, ids=[r[0] for r in FROM_WEIGHTS])
@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS + ["nan", "pos_inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_from_weights_is_the_logits_backward(router, kind, dtype):
    """The backward autograd takes for a renormalised softmax router (from a copy of its float32
    weights) against the C++ backward that reads the logits: the same gradient, masked rows (0),
    rows holding NaN or +inf (NaN everywhere) and ties included."""
    _from_weights_kernel()
    _, E, k, kw = router
    if kind in ("nan", "pos_inf"):
        logits = adversarial_logits("random", 11, E, seed=E)
        logits[torch.rand(11, E, generator=torch.Generator().manual_seed(E)) < 0.1] = float(kind[-3:])
    else:
        logits = adversarial_logits(kind, 11, E, seed=E)
    logits = logits.to(dtype)
    kwargs = kwargs_for(E, kw)
    g = torch.randn(11, k, generator=torch.Generator().manual_seed(k))
    x = logits.clone().requires_grad_()
    w, experts = run("cpu", x, k, **kwargs)
    w.backward(g)
    scaling = kwargs.get("scaling_factor", 1.0)
    ranked = "bias" not in kwargs and kwargs.get("topk_groups", 1) >= kwargs.get("num_groups", 1)
    from_logits = torch.ops.moe_kernels.topk_router_backward(g, logits, experts, "softmax", True, scaling, ranked)
    assert x.grad.dtype == dtype
    assert torch.equal(x.grad.isnan(), from_logits.isnan()), kind
    assert torch.equal(x.grad == 0, from_logits == 0), kind
    assert_close(x.grad.nan_to_num().double(), from_logits.nan_to_num().double(), dtype=dtype)


@pytest.mark.parametrize("zero_score", [float("-inf"), -200.0])
def test_backward_from_weights_bias_ranks_a_zero_score_first(zero_score):
    """A bias can rank first an expert whose score is 0 (a masked or an underflowing logit): its
    weight is 0 while the row's others are not, and they keep their gradient."""
    _from_weights_kernel()
    logits = torch.tensor([[0.0, zero_score, 1.0, 0.5]])
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0])
    g = torch.tensor([[1.0, 2.0, -1.0]])
    x = logits.clone().requires_grad_()
    w, e = run("cpu", x, 3, bias=bias, renormalize=True)
    assert e[0, 0] == 1 and w[0, 0] == 0 and w[0, 1] > 0
    w.backward(g)
    x_ref = logits.clone().requires_grad_()
    w_ref, _ = reference.topk_router(x_ref, 3, bias=bias, renormalize=True)
    w_ref.backward(g)
    assert x.grad.abs().sum() > 0
    assert_close(x.grad, x_ref.grad)


def test_backward_from_weights_masked_experts_with_bias():
    """Many masked experts and a bias, at a real router width: every row against the logits
    backward (rows whose first-ranked expert is masked included)."""
    _from_weights_kernel()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 64, generator=gen)
    logits[torch.rand(256, 64, generator=gen) < 0.4] = float("-inf")
    logits[7] = float("-inf")  # a fully masked row
    bias = 0.05 * torch.randn(64, generator=gen)
    g = torch.randn(256, 8, generator=gen)
    x = logits.clone().requires_grad_()
    w, experts = run("cpu", x, 8, bias=bias, renormalize=True, scaling_factor=2.0)
    assert (w[:, 0] == 0).sum() > 1  # rows whose first-ranked expert is masked
    w.backward(g)
    from_logits = torch.ops.moe_kernels.topk_router_backward(g, logits, experts, "softmax", True, 2.0, False)
    assert torch.equal(x.grad[7], torch.zeros(64))
    assert_close(x.grad, from_logits)


def test_backward_from_weights_survives_in_place_edits():
    _from_weights_kernel()
    logits = torch.randn(20, 16)
    g = torch.randn(20, 4)
    x = logits.clone().requires_grad_()
    w, _ = run("cpu", x, 4, renormalize=True, scaling_factor=2.0)
    w.mul_(3.0)  # e.g. a caller's own scaling, in place
    w.backward(g)
    x_ref = logits.clone().requires_grad_()
    w_ref, _ = reference.topk_router(x_ref, 4, renormalize=True, scaling_factor=2.0)
    (w_ref * 3.0).backward(g)
    assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize("scaling", [-1.0, 2.5, 1e39])
def test_masked_rows_scaled_alike_for_every_k(scaling):
    # A fully masked row's renormalised softmax weights are +0 whatever the scaling (finish_weights'
    # rule), on the path that computes them from the selected pairs (k = 4, 8 on AVX-512) as on the
    # one that does not (k = 3); a live row's are scaling times the unscaled weights there.
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(3))
    x[0] = float("-inf")
    x[20] = float("-inf")
    for k in (3, 4, 8):
        w, e = run("cpu", x, k, renormalize=True, scaling_factor=scaling)
        for row in (0, 20):
            assert torch.equal(w[row], torch.zeros(k)) and not torch.signbit(w[row]).any(), (k, w[row])
        if k != 3 and scaling != 1e39:
            w_softmax, e_softmax = run("cpu", x, k, renormalize=True)
            live = torch.ones(37, dtype=torch.bool)
            live[[0, 20]] = False
            assert torch.equal(e, e_softmax)
            assert torch.equal(w[live], w_softmax[live] * scaling)


@pytest.mark.parametrize(
    "kwargs, held",
    [
        (dict(renormalize=True), False),
        (dict(renormalize=True, scaling_factor=0.0), True),
        (dict(renormalize=False), True),
        (dict(scoring="sigmoid", renormalize=True), True),
    ],
)
def test_graph_holds_logits_only_when_its_backward_reads_them(kwargs, held):
    import weakref

    _from_weights_kernel()
    x = torch.randn(64, 32, requires_grad=True)
    logits = x * 2.0  # an intermediate (MulBackward keeps the scalar, not its output)
    ref = weakref.ref(logits)
    w, _ = run("cpu", logits, 2, **kwargs)
    del logits
    assert (ref() is not None) == held
    w.sum().backward()
    assert x.grad is not None


def test_backward_from_weights_opcheck():
    op = _from_weights_kernel()
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 5, 5)]:
        for dtype in (torch.float32, torch.bfloat16):
            w, experts = reference.topk_router(torch.randn(T, E), k, renormalize=True, scaling_factor=1.5)
            torch.library.opcheck(op, (torch.randn(T, k), w, experts, E, 1.5, dtype))


@pytest.mark.parametrize(
    "args, error, match",
    [
        (
            (torch.randn(2, 2), torch.rand(2, 2).double(), torch.zeros(2, 2, dtype=torch.long), 8, 1.0),
            RuntimeError,
            "float32",
        ),
        ((torch.randn(2, 2), torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.long), 8, 0.0), RuntimeError, "scaling"),
        (
            (torch.randn(2, 2), torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.long), 1, 1.0),
            RuntimeError,
            "num_experts",
        ),
        ((torch.randn(2, 2), torch.rand(2, 2), torch.tensor([[0, 1], [2, 8]]), 8, 1.0), IndexError, "experts"),
        ((torch.randn(2, 2), torch.rand(2, 2), torch.tensor([[0, -1], [2, 3]]), 8, 1.0), IndexError, "experts"),
    ],
)
def test_backward_from_weights_bad_arguments(args, error, match):
    op = _from_weights_kernel()
    with pytest.raises(error, match=match):
        op(*args, torch.float32)


def test_torch_compile_fullgraph(kernel_backend):
    bias = 0.1 * torch.randn(16)

    def route(x):
        w, e = topk_router(x, 4, scoring="sigmoid", bias=bias, num_groups=4, topk_groups=2, renormalize=True)
        return (w * e.float()).sum(-1)

    x = torch.randn(16, 16)
    with moe_kernels.use_backend(kernel_backend):
        compiled = torch.compile(
            route, fullgraph=True, backend="aot_eager" if kernel_backend == "triton" else "inductor"
        )
        assert_close(compiled(x), route(x))


def test_torch_compile_fullgraph_backward(kernel_backend):
    """Forward and backward in one compiled graph (the backward is a fused kernel on every backend
    with a kernel: C++, Triton, CUDA)."""

    def loss(x):
        w, _ = topk_router(x, 2, renormalize=True, scaling_factor=1.5)
        return (w * torch.arange(2.0)).sum()

    x = torch.randn(16, 8)
    with moe_kernels.use_backend(kernel_backend):
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        compiled(xa).backward()
        loss(xb).backward()
    assert_close(xa.grad, xb.grad)


def test_triton_opcheck(backend):
    """The Triton forward and backward ops' fake kernels, schemas and autograd (torch.library.opcheck)."""
    if backend != "triton":
        pytest.skip("the Triton ops")
    forward = torch.ops.moe_kernels_triton.topk_router
    backward = torch.ops.moe_kernels_triton.topk_router_backward
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 8, 8)]:
        for scoring in ("softmax", "sigmoid"):
            for dtype in (torch.float32, torch.bfloat16):
                logits = torch.randn(T, E, dtype=dtype, device=backend.device, requires_grad=True)
                torch.library.opcheck(forward, (logits, k, scoring, None, 1, 1, "top2_sum", True, 1.0))
                _, experts = reference.topk_router(logits.detach(), k, scoring=scoring)
                grad_w = torch.randn(T, k, device=backend.device)
                torch.library.opcheck(backward, (grad_w, logits.detach(), experts, scoring, True, 1.5))
                torch.library.opcheck(backward, (grad_w, logits.detach(), experts, scoring, True, 1.5, True))
                torch.library.opcheck(
                    backward, (grad_w.t().contiguous().t(), logits.detach(), experts, scoring, False, 2.0)
                )


@pytest.mark.parametrize(
    "shape, view, dtype, aligned",
    [
        ((4, 60), None, torch.bfloat16, True),  # rows of 60: 4 a thread, 60 % 4 == 0
        ((4, 8), None, torch.bfloat16, True),  # Mixtral: one thread's 8, stride 8
        ((4, 6), None, torch.bfloat16, False),  # 6 is no multiple of the 6 -> 8 a thread
        ((4, 12), 8, torch.bfloat16, False),  # 8 of a row of 12: stride 12
        ((4, 16), 8, torch.bfloat16, True),  # 8 of a row of 16: stride 16
        ((4, 128), None, torch.float32, True),
        ((4, 130), 128, torch.float32, False),  # stride 130 is no multiple of 4
    ],
)
def test_triton_launches_say_rows_are_aligned_only_when_they_are(backend, monkeypatch, shape, view, dtype, aligned):
    """ALIGNED_ROWS lets the compiler read each row in whole vectors (a GPU-only effect, which
    the interpreter cannot check): the launchers must set it exactly where the row stride and E
    are multiples of their ROW_VECTOR, or a GPU would read across row ends (the table: the
    forward's)."""
    if backend != "triton":
        pytest.skip("the Triton launchers")
    from moe_kernels.triton import topk_router as forward_module
    from moe_kernels.triton import topk_router_backward as backward_module

    seen = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen[self.name] = kwargs

            return launch

    monkeypatch.setattr(forward_module, "topk_router_kernel", Recorder("forward"))
    monkeypatch.setattr(backward_module, "topk_router_backward_kernel", Recorder("backward"))
    logits = torch.randn(*shape, dtype=dtype, device=backend.device)
    if view is not None:
        logits = logits[:, :view]
    E = logits.shape[1]
    forward_module.topk_router(logits, 2, "softmax", None, 1, 1, "top2_sum", True, 1.0)
    experts = torch.zeros(shape[0], 2, dtype=torch.int64, device=backend.device)
    backward_module.topk_router_backward(
        torch.ones(shape[0], 2, device=backend.device), logits, experts, "softmax", True, 1.0
    )
    assert seen["forward"]["ALIGNED_ROWS"] == aligned
    for name in ("forward", "backward"):  # each with its own load vector
        vector = seen[name]["ROW_VECTOR"]
        assert seen[name]["ALIGNED_ROWS"] == (logits.stride(0) % vector == 0 and E % vector == 0), (name, vector)


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
def test_triton_other_pick_recording(backend, monkeypatch, router):
    """The Triton forward records its picks in a [rows, k] tile or by rounds over sorted runs
    (uses_sorted_runs, by the shape); the tests above run the one the launcher chooses. Here
    the other one, forced on every router shape, against the reference on random and
    adversarial logits (runs of each thread's 1, 2, 4 or 8 entries)."""
    if backend != "triton":
        pytest.skip("the Triton launcher's two pick recordings")
    from moe_kernels.triton import topk_router as forward_module

    chosen = forward_module.uses_sorted_runs
    monkeypatch.setattr(forward_module, "uses_sorted_runs", lambda *shape: not chosen(*shape))
    _, E, k, kw = router
    rows = 11 if E < 256 else 4  # the interpreter's time goes with the programs: a row or two each at E = 300
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("random", "ties", "all_neg_inf", "nan"):
            if kind == "nan":
                logits = adversarial_logits("ties", rows, E, seed=E)
                logits[torch.rand(rows, E, generator=torch.Generator().manual_seed(E)) < 0.15] = float("nan")
            else:
                logits = adversarial_logits(kind, rows, E, seed=E)
            logits = logits.to(dtype)
            kwargs = kwargs_for(E, kw)
            if kwargs.get("bias") is not None:
                kwargs["bias"] = torch.round(kwargs["bias"] * 20) / 20  # ties in the choice values too
            w, e = run(backend, logits, k, **kwargs)
            w_ref, e_ref = reference.topk_router(logits, k, **kwargs)
            if kind == "random":
                assert_same_selection(e, e_ref, logits, k, kwargs)
            else:
                assert torch.equal(e, e_ref), (dtype, kind, e, e_ref)
            same = (e == e_ref).all(dim=1)
            assert_close(w[same], w_ref[same])


# One dtype a shape, both dtypes at E = 64, k = 8: on a GPU every case compiles its own kernels.
@pytest.mark.parametrize(
    "E, k, dtype",
    [
        (16, 8, torch.bfloat16),
        (64, 5, torch.float32),
        (64, 8, torch.float32),
        (64, 8, torch.bfloat16),
        (128, 8, torch.float32),
    ],
)
def test_triton_other_choice_tile(backend, monkeypatch, E, k, dtype):
    """The Triton forward's sorted runs and the backward read their choices back as a [k, rows]
    or a [rows, k] tile, by the triton and the shape (topk_router.choice_rows), and the backward
    stores the chosen entries from that tile or its transpose (topk_router_backward.
    store_transposed); the tests above run what the launchers choose. Here the other of each,
    forced: the same experts, weights and gradients as the launcher's (softmax and sigmoid,
    renormalised or not, a backward on distinct experts and a raw one with repeats and ids out
    of range; bfloat16 logits take the packed keys, float32 the value keys)."""
    if backend != "triton":
        pytest.skip("the Triton kernels' two choice tiles")
    from moe_kernels.triton import topk_router as forward_module
    from moe_kernels.triton import topk_router_backward as backward_module

    backward_op = torch.ops.moe_kernels_triton.topk_router_backward
    T = 37  # three programs of 16 rows at E <= 64, the last one ragged
    g = torch.Generator().manual_seed(E + k)
    logits = torch.randn(T, E, generator=g) * 3
    logits[3] = float("-inf")
    logits[7] = logits[7, 0]  # a row of ties
    grad_w = torch.randn(T, k, generator=g)
    raw = torch.randint(-2, E + 2, (T, k), generator=g)
    raw[0] = 1  # one expert repeated k times
    chosen, transposed = forward_module.choice_rows, backward_module.store_transposed
    x = logits.to(dtype)
    for scoring, renormalize in (("softmax", True), ("softmax", False), ("sigmoid", True)):
        kwargs = dict(scoring=scoring, renormalize=renormalize, scaling_factor=1.5)
        results = []
        for flip in (False, True):
            rule = (lambda *shape, **kw: not chosen(*shape, **kw)) if flip else chosen
            monkeypatch.setattr(forward_module, "choice_rows", rule)
            monkeypatch.setattr(backward_module, "choice_rows", rule)
            store = (lambda *shape: not transposed(*shape)) if flip else transposed
            monkeypatch.setattr(backward_module, "store_transposed", store)
            w, e = run(backend, x, k, **kwargs)
            # The raw op takes tensors on the device (run() brings the forward's back).
            on = backend.device
            grads = [
                backward_op(grad_w.to(on), x.to(on), experts.to(on), scoring, renormalize, 1.5, distinct)
                for experts, distinct in ((e, True), (raw, False))
            ]
            results.append((w, e, grads))
        (w0, e0, grads0), (w1, e1, grads1) = results
        assert torch.equal(e0, e1), (dtype, scoring, renormalize)
        assert_close(w0, w1)
        for a, b in zip(grads0, grads1):
            assert torch.equal(a.isnan(), b.isnan())
            assert_close(a.float().nan_to_num(), b.float().nan_to_num())


# One dtype a shape (on a GPU every case compiles its own kernels): bfloat16 and float16 logits
# take the packed keys, float32 the value keys.
@pytest.mark.parametrize(
    "E, k, kwargs, dtype",
    [
        (128, 8, dict(renormalize=True), torch.bfloat16),  # Qwen3-MoE's shape: the sorted runs, 8 rows a tile
        (64, 8, dict(renormalize=True), torch.float32),  # 16 rows a tile: the [rows, k] choice tile (triton >= 3.7)
        (64, 2, dict(renormalize=False), torch.float32),  # the [rows, k] tile
        (8, 2, dict(renormalize=True), torch.float16),  # a row in one thread
        (256, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4, scaling_factor=2.5), torch.bfloat16),
        (160, 6, dict(scoring="sigmoid", num_groups=8, topk_groups=3, group_scoring="max"), torch.float32),
    ],
)
def test_triton_multi_tile(backend, monkeypatch, E, k, kwargs, dtype):
    """The Triton forward and backward with several row tiles a program (topk_router.multi_tile,
    topk_router_backward.backward_multi_tile: each tile's logits loaded during the work of the one
    before) give bit for bit the experts, weights and gradients of a tile a program: two tiles a
    program (which divides the six tiles) and four (the last program two of its four), on rows of
    ties, -inf rows and NaN, with and without a bias (DeepSeek-V3's groups; groups by a loop at
    E = 160); the backward on the forward's experts and on raw ones with repeats and ids out of
    range (its smaller tiles)."""
    if backend != "triton":
        pytest.skip("the Triton kernel's tiles a program")
    from moe_kernels.triton import topk_router as forward_module
    from moe_kernels.triton import topk_router_backward as backward_module

    backward_op = torch.ops.moe_kernels_triton.topk_router_backward
    scoring, renormalize = kwargs.get("scoring", "softmax"), kwargs.get("renormalize", False)
    scaling = kwargs.get("scaling_factor", 1.0)

    g = torch.Generator().manual_seed(E + k)
    T = 6 * forward_module.launch_config(10**6, E)[1] - 3  # six tiles, the last one ragged
    logits = torch.randn(T, E, generator=g) * 3
    logits[1] = float("-inf")
    logits[2] = logits[2, 0]  # a row of ties
    logits[T - 1, E // 2] = float("nan")
    if "num_groups" in kwargs:
        kwargs = dict(kwargs, bias=0.1 * torch.randn(E, generator=g))
    grad_w = torch.randn(T, k, generator=g)
    raw = torch.randint(-2, E + 2, (T, k), generator=g)
    raw[0] = 1  # one expert repeated k times
    chosen = forward_module.multi_tile, backward_module.backward_multi_tile

    def both(x, rule_forward, rule_backward):
        monkeypatch.setattr(forward_module, "multi_tile", rule_forward)
        monkeypatch.setattr(backward_module, "backward_multi_tile", rule_backward)
        w, e = run(backend, x, k, **kwargs)
        # The raw op takes tensors on the device (run() brings the forward's back).
        on = backend.device
        grads = [
            backward_op(grad_w.to(on), x.to(on), experts.to(on), scoring, renormalize, scaling, distinct)
            for experts, distinct in ((e, True), (raw, False))
        ]
        return w, e, grads

    x = logits.to(dtype)
    w1, e1, grads1 = both(x, *chosen)
    for tiles in (2, 4):
        w, e, grads = both(x, *(lambda n, tiles=tiles: tiles,) * 2)
        assert torch.equal(e, e1), (dtype, tiles)
        assert torch.equal(w.isnan(), w1.isnan()), (dtype, tiles)
        assert torch.equal(w.nan_to_num(), w1.nan_to_num()), (dtype, tiles)
        for a, b in zip(grads, grads1, strict=True):
            assert torch.equal(a.isnan(), b.isnan()), (dtype, tiles)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (dtype, tiles)
    if "bias" not in kwargs:  # the logits rank the experts: the reference's, exactly
        assert torch.equal(e1, run("torch", x, k, **kwargs)[1]), dtype


def test_triton_backward_drops_out_of_range_experts(backend):
    """A raw call of the Triton backward with ids outside [0, E) touches no column for them (the
    device cannot raise; docs/reliability.md): the same gradient as with those ids at -1, an id
    that wraps to a real column in 32 bits included."""
    if backend != "triton":
        pytest.skip("the Triton op")
    op = torch.ops.moe_kernels_triton.topk_router_backward
    logits = torch.randn(4, 8, device=backend.device)
    experts = torch.tensor([[0, 1], [2, 8], [2**32 + 3, 5], [-5, 7]], device=backend.device)
    dropped = torch.tensor([[0, 1], [2, -1], [-1, 5], [-1, 7]], device=backend.device)
    grad_w = torch.randn(4, 2, device=backend.device)
    for scoring in ("softmax", "sigmoid"):
        for renormalize in (True, False):
            got = op(grad_w, logits, experts, scoring, renormalize, 1.0)
            assert torch.equal(got, op(grad_w, logits, dropped, scoring, renormalize, 1.0))
            assert torch.isfinite(got).all()
            assert got[2, 3] == 0 or scoring == "softmax"  # 2**32 + 3 reached no column


@pytest.mark.parametrize("E, k", [(8, 3), (24, 20)])  # k = 20: the repeats' tile takes fewer rows a program
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backward_sums_repeated_experts(backend, E, k, dtype):
    """A raw call of the Triton backward with an expert repeated in a row (no forward gives one)
    sums the repeats' gradients, as the reference's scatter_add (the torch formula here); with
    distinct_experts the caller promises there is none, and on distinct experts both agree with
    the formula and with each other within float32 rounding. Not bitwise: on a GPU the two
    variants compile differently (in the promised one the compiler may contract scaling * g - shift
    into one FMA; at large k the repeats' tile takes fewer rows a program, so the row sums run in
    another order), and the H200 gave them last-bit differences; the interpreter computes them
    alike."""
    if backend != "triton":
        pytest.skip("the Triton op")
    from moe_kernels.ops.topk_router import _backward_from_logits

    op = torch.ops.moe_kernels_triton.topk_router_backward
    T = 37
    gen = torch.Generator().manual_seed(k)
    logits = torch.randn(T, E, generator=gen).to(dtype).to(backend.device)
    repeated = torch.randint(0, 3, (T, k), generator=gen).to(backend.device)  # mostly repeats
    distinct = torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :k].to(backend.device)
    grad_w = torch.randn(T, k, generator=gen).to(backend.device)
    for scoring in ("softmax", "sigmoid"):
        for renormalize in (True, False):
            got = op(grad_w, logits, repeated, scoring, renormalize, 1.5)
            expected = _backward_from_logits(logits, repeated, grad_w, scoring, renormalize, 1.5)
            assert_close(got.double(), expected.double(), dtype=torch.float32)
            promised = op(grad_w, logits, distinct, scoring, renormalize, 1.5, True)
            unpromised = op(grad_w, logits, distinct, scoring, renormalize, 1.5, False)
            assert_close(promised.double(), unpromised.double(), dtype=torch.float32)
            expected = _backward_from_logits(logits, distinct, grad_w, scoring, renormalize, 1.5)
            assert_close(promised.double(), expected.double(), dtype=torch.float32)


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
def test_torch_backward_formula(router):
    # The backward in torch (float64 rows on the Triton backend): against the reference's autograd.
    from moe_kernels.ops.topk_router import _backward_from_logits

    _, E, k, kw = router
    logits = torch.randn(19, E, generator=torch.Generator().manual_seed(E))
    logits[4] = float("-inf")
    kwargs = kwargs_for(E, kw)
    x = logits.clone().requires_grad_()
    w, e = reference.topk_router(x, k, **kwargs)
    g = torch.randn(19, k, generator=torch.Generator().manual_seed(3))
    (expected,) = torch.autograd.grad((w * g).sum(), x)
    got = _backward_from_logits(
        logits,
        e,
        g,
        kwargs.get("scoring", "softmax"),
        kwargs.get("renormalize", False),
        kwargs.get("scaling_factor", 1.0),
    )
    assert_close(got, expected)


# Choice values a few float32 steps apart, the larger at the higher index, among a row's k + 1
# best must rank by value, then index, exactly. The Triton kernel's rounds rank keys whose lowest
# bits hold the index, which orders such values by index; it redoes a program with such a row.


def block_width(E):
    """The Triton kernel's row width for E experts: the next power of two."""
    return 1 << (E - 1).bit_length()


@pytest.mark.parametrize("E, k", [(128, 8), (40, 6)], ids=["E128", "padded"])
def test_logits_steps_apart_rank_exactly(backend, E, k):
    """float32 logits ranked by themselves. Rows: two picks one step apart (0.25 and 0.25 +
    2^-25), 100 steps apart, and the k-th and (k + 1)-th one step apart; random rows between.
    Row 17 (a Triton program of its own with 16 and 18) holds bfloat16 values, whose low bits the
    packing drops nothing of, but for a pick 0.25 + (BLOCK_E - 1) steps: its low bits all 1, the
    0.25's all 0 (both pass a check of the low bits for all 0 or all 1)."""
    step = 2.0**-25  # at 0.25
    logits = torch.rand(19, E, generator=torch.Generator().manual_seed(E)) * 0.125
    logits[2, 3], logits[2, E - 5] = 0.25, 0.25 + step
    logits[7, 5], logits[7, E - 2] = 0.25, 0.25 + 100 * step
    logits[11, : k - 1] = 0.3 + 0.01 * torch.arange(k - 1)  # k - 1 clear picks
    logits[11, k], logits[11, E - 1] = 0.25, 0.25 + step
    logits[17] = logits[17].bfloat16().float()
    logits[17, 4], logits[17, E - 3] = 0.25, 0.25 + (block_width(E) - 1) * step
    w, e = run(backend, logits, k, renormalize=True)
    w_ref, e_ref = reference.topk_router(logits, k, renormalize=True)
    assert torch.equal(e, e_ref), (e[[2, 7, 11, 17]], e_ref[[2, 7, 11, 17]])
    assert_close(w, w_ref)


@pytest.mark.parametrize(
    "E, k, kwargs",
    [(256, 8, dict(num_groups=8, topk_groups=4, renormalize=True)), (64, 6, dict())],
    ids=["deepseek_v3", "biased"],
)
def test_biased_choices_steps_apart_rank_exactly(backend, E, k, kwargs):
    """Sigmoid scores plus a bias. Every score of the first rows is 0.5 (logits 0), so the biases
    alone order them, in exact sums: a pair at 0.75 and 0.75 + 2^-24 (one step), five clear picks
    at 0.70 to 0.74, then a pair at 0.625 and 0.625 + 2^-24 (the k-th and (k + 1)-th at k = 8),
    the others below 0.5625; in experts of groups 0, 2, 5 and 7, which the group limit keeps. The
    last rows' logits are random."""
    step = 2.0**-24  # at 0.625 and 0.75
    gen = torch.Generator().manual_seed(E)
    bias = torch.rand(E, generator=gen) * 0.0625
    at = lambda i: i * E // 256  # noqa: E731  (the same groups at E = 64: 8 experts a group)
    bias[at(3)], bias[at(250)] = 0.25, 0.25 + step
    for n, i in enumerate([10, 70, 80, 170, 230]):
        bias[at(i)] = 0.20 + 0.01 * n
    bias[at(75) + 1], bias[at(180)] = 0.125, 0.125 + step
    logits = torch.zeros(12, E)
    logits[8:] = torch.randn(4, E, generator=gen)
    kw = dict(kwargs, scoring="sigmoid", bias=bias)
    w, e = run(backend, logits, k, **kw)
    w_ref, e_ref = reference.topk_router(logits, k, **kw)
    assert e_ref[0, 0] == at(250) and e_ref[0, 1] == at(3)  # the construction: the pair first
    assert torch.equal(e, e_ref), (e[0], e_ref[0])
    assert_close(w, w_ref)


@pytest.mark.parametrize("E,k", [(64, 8), (40, 3)])
def test_renormalized_runs_past_1024_rows(E, k):
    # The C++ renormalised softmax (topk_router, topk_softmax through it) selects and weights float32 rows
    # in calls of 1024 rows, then redoes the rows a call leaves one by one: their row numbers must
    # be the run's, and the scaling applied once per row. Left here, in every call: NaN rows, and
    # rows whose two largest values are an ulp apart with the smaller at the lower index (the
    # register selection's 28-bit keys rank those two the wrong way round before it leaves them).
    T = 2600
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E + k))
    for i in range(5, T, 97):
        logits[i, (7 * i) % E] = float("nan")
    for i in range(50, T, 89):
        logits[i, 3] = 5.0
        logits[i, E - 1] = torch.nextafter(torch.tensor(5.0), torch.tensor(6.0))
    logits[1030] = float("-inf")  # a fully masked row: weights +0 whatever the scaling
    with moe_kernels.use_backend("cpu"):
        w, e = topk_router(logits, k, renormalize=True, scaling_factor=2.5)
        w_softmax, e_softmax = topk_softmax(logits, k)
    w_ref, e_ref = reference.topk_router(logits, k, renormalize=True, scaling_factor=2.5)
    ws_ref, es_ref = reference.topk_softmax(logits, k)
    assert torch.equal(e, e_ref) and torch.equal(e_softmax, es_ref)
    assert_close(w, w_ref)
    assert_close(w_softmax, ws_ref)
    assert torch.equal(w[1030], torch.zeros(k)) and not torch.signbit(w[1030]).any()


@pytest.mark.parametrize(
    "E, k, kwargs",
    [
        (2056, 4, dict(renormalize=True)),  # E past the Triton kernel's 2048
        (130, 4, dict(scoring="sigmoid", bias=True, num_groups=65, topk_groups=3, group_scoring="max")),  # 65 groups
        (130, 4, dict(num_groups=65)),  # 65 groups, no group limit
    ],
    ids=["E2056", "groups65_limited", "groups65"],
)
def test_past_the_triton_kernel_limits(backend, E, k, kwargs):
    """Sizes the Triton kernel's tiles do not hold are valid input: the op hands them on
    (backends.fallback: the CUDA kernel for CUDA tensors, the reference under the interpreter),
    never an error; forward and backward as the reference's."""
    kw = kwargs_for(E, kwargs, seed=E)
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(E)).requires_grad_()
    w, e = run(backend, logits, k, **kw)
    rw, re = reference.topk_router(logits, k, **kw)
    assert_same_selection(e, re, logits.detach(), k, kw)
    assert_close(w, rw)
    if backend == "triton" and backend.device == "cpu":  # the interpreter: the reference itself
        assert torch.equal(e, re) and torch.equal(w, rw)
    g = torch.randn_like(rw)
    assert_close(torch.autograd.grad(w, logits, g)[0], torch.autograd.grad(rw, logits, g)[0])


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_one_renormalised_choice_weighs_exactly_the_scaling(backend, scoring, scaling):
    """k = 1, renormalised: p / p = 1 exactly, times the scaling, as the reference computes it.
    Rows tie on these weights, so Megatron's "probs" drop decides them by token index; on a GPU
    the Triton kernel's approximate division and w * (1 / w) both missed 1.0 on some rows."""
    logits = 4 * torch.randn(4099, 64, generator=torch.Generator().manual_seed(3))
    w, _ = run(backend, logits, 1, scoring=scoring, renormalize=True, scaling_factor=scaling)
    assert torch.equal(w, torch.full_like(w, scaling)), w[w != scaling][:8]
