"""topk_softmax: every backend against the reference, forward and backward, on adversarial input.

topk_softmax is topk_router with softmax scores and its weights in the logits' dtype
(moe_kernels/ops/topk_softmax.py): these tests run the router's kernels through that wrapper, on
the inputs the former topk_softmax kernels were tested with (float-compare edges, near ties in wide
rows, every row width, subnormals)."""

import pytest
import torch
from shapes import ADVERSARIAL_KINDS, DTYPES, SMALL_TOPK_SHAPES, TOPK_SHAPES, adversarial_logits, subnormal_values
from tolerances import assert_close, assert_lowp_close

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import topk_softmax


def run(backend, logits, k, renormalize=True):
    with moe_kernels.use_backend(backend):
        return topk_softmax(logits, k, renormalize=renormalize)


def shapes_for(backend):
    return SMALL_TOPK_SHAPES if backend == "triton" else TOPK_SHAPES


def eager_lowp(logits, k, renormalize):
    """What plain PyTorch computes in the low-precision dtype itself (flash-attention's yardstick)."""
    _, experts = reference.topk_softmax(logits, k, renormalize)
    if renormalize:
        return torch.softmax(logits.gather(1, experts), dim=-1)
    return torch.softmax(logits, dim=-1).gather(1, experts)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_random(backend, dtype, renormalize):
    for T, E, k in shapes_for(backend):
        logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T * 1000 + E)).to(dtype)
        w, e = run(backend, logits, k, renormalize)
        w_ref, e_ref = reference.topk_softmax(logits, k, renormalize)
        assert w.shape == (T, k) and e.shape == (T, k)
        assert w.dtype == dtype and e.dtype == torch.int64
        assert torch.equal(e, e_ref), f"experts differ for {(T, E, k)}"
        if dtype == torch.float32:
            assert_close(w, w_ref)
        else:
            w32, _ = reference.topk_softmax(logits.float(), k, renormalize)
            if T:
                assert_lowp_close(w, w32, eager_lowp(logits, k, renormalize))


@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS)
@pytest.mark.parametrize("renormalize", [True, False])
def test_adversarial(backend, kind, renormalize):
    # (6, 40, 1): the C++ kernel's argmax path for k = 1; (6, 40, 2) and (5, 2, 2): its two
    # running maxima for k = 2 (the second only a scalar tail)
    for T, E, k in [(6, 7, 3), (4, 16, 16), (5, 1, 1), (5, 40, 3), (6, 40, 1), (6, 40, 2), (5, 2, 2)]:
        logits = adversarial_logits(kind, T, E)
        w, e = run(backend, logits, k, renormalize)
        w_ref, e_ref = reference.topk_softmax(logits, k, renormalize)
        assert torch.equal(e, e_ref), (kind, e, e_ref)
        assert_close(w, w_ref)
        assert not torch.isnan(w).any()


@pytest.mark.parametrize("k", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS + ["nan"])
def test_every_width(backend, kind, k):
    # The C++ kernel scans contiguous float32 rows 8 lanes at a time (k = 1: a vector argmax;
    # k = 2: two running maxima per lane; 3 <= k <= 8: a floor, the candidates above it, a sorting
    # network), then a scalar tail; its slots' values and weights have loops specialised for
    # k = 1, 2, 4, 8.
    # Every width up to two full vectors plus a tail, so ties and NaN fall across lanes, chunks
    # and the tail.
    widths = range(k, 26) if backend == "triton" else range(k, 42)
    for E in widths:
        if kind == "nan":
            logits = adversarial_logits("ties", 12, E, seed=E)
            logits[torch.rand(12, E, generator=torch.Generator().manual_seed(E)) < 0.15] = float("nan")
        else:
            logits = adversarial_logits(kind, 12, E, seed=E)
        for renormalize in (True, False):
            w, e = run(backend, logits, k, renormalize)
            w_ref, e_ref = reference.topk_softmax(logits, k, renormalize)
            assert torch.equal(e, e_ref), (kind, E, e, e_ref)
            assert_close(w, w_ref)


def near_tie_rows(T: int, E: int, seed: int) -> torch.Tensor:
    """Rows whose largest values agree in all but their last bits, or exactly, among random ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g)
    ulp = torch.randint(0, 24, (T, E), generator=g).float() * 1.1920929e-7
    near = 1.0 + ulp  # 24 values a few ulp apart: many equal, the others differ in the last 5 bits
    x[0::3] = near[0::3]
    x[1::3, :12] = -near[1::3, :12]  # negative near-ties among random rows
    x[2::6, E // 2] = 3.0  # an exact tie at the top, far apart in the row
    x[2::6, E - 1] = 3.0
    x[5::6, 7] = -0.0  # signed zeros tied at the top
    x[5::6, 9] = 0.0
    x[5::6, 10:] = -float("inf")
    return x


@pytest.mark.parametrize("k", [3, 5, 8])
def test_near_ties_in_wide_rows(backend, k):
    # The C++ kernel's register path (csrc/cpu/select/top8_avx512.h: AVX-512, 16 <= E <= 256) sorts its
    # candidates by rank keys cut to 28 bits (exact ties ranked by index below the cut) and leaves
    # rows where two different keys share a cut key to the full pairs; its blocks are four rows,
    # and 203 rows end with a partial block. Also rows cut from a wider tensor (row stride > E).
    widths = (16, 40) if backend == "triton" else (16, 17, 33, 40, 63, 64, 100, 128, 200, 256)
    for E in widths:
        rows = near_tie_rows(203, E, seed=E + k)
        wider = torch.full((203, E + 13), 9.0)
        wider[:, 5 : 5 + E] = rows
        for logits in (rows, wider[:, 5 : 5 + E]):
            for renormalize in (True, False):
                w, e = run(backend, logits, k, renormalize)
                w_ref, e_ref = reference.topk_softmax(logits, k, renormalize)
                assert torch.equal(e, e_ref), (E, (e != e_ref).any(1).nonzero())
                assert_close(w, w_ref)


def float_compare_edge_rows(E: int) -> torch.Tensor:
    """Rows that probe the C++ float-compare selection (k = 1, 2) and its rank-key fallback."""
    rows = []
    g = torch.Generator().manual_seed(E)
    inf = float("inf")
    for pos in sorted({0, 1, E // 2, E - 1}):
        one = torch.full((E,), -inf)
        one[pos] = 0.5  # one finite value: the second is the lowest-index -inf
        rows.append(one)
        mixed = torch.randn(E, generator=g)
        mixed[pos] = inf  # +inf with -inf elsewhere: the lane sums are NaN, so the rank-key path
        mixed[(pos + 3) % E] = -inf
        rows.append(mixed)
    tiny = torch.tensor([1e-45, -1e-45, 0.0, -0.0, 1e-40, -1e-40], dtype=torch.float32)
    rows.append(tiny[torch.randint(0, 6, (E,), generator=g)])  # denormals and signed zeros
    rows.append(torch.full((E,), 3e38))  # sums overflow to +inf (not NaN): the float path, all ties
    big = torch.full((E,), 3e38)
    big[-1] = -inf  # +inf + -inf in the sums although no element is NaN or +inf
    rows.append(big)
    return torch.stack(rows)


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_float_compare_edges(backend, k):
    # The C++ CPU kernel ranks a row holding no NaN by float compares (k = 1, 2) or filters it by
    # a float floor before its rounds (3 <= k <= 8), and falls back to rank keys when the row's
    # lane sums are NaN; both must give the reference's experts.
    widths = range(max(k, 8), 26) if backend == "triton" else range(max(k, 8), 42)
    for E in widths:
        logits = float_compare_edge_rows(E)
        for renormalize in (True, False):
            w, e = run(backend, logits, k, renormalize)
            w_ref, e_ref = reference.topk_softmax(logits, k, renormalize)
            assert torch.equal(e, e_ref), (E, e, e_ref)
            assert_close(w, w_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_subnormal_logits(backend, dtype):
    """Issue 34, defect 3: denormal logits rank by their values on every backend (the Triton
    kernel, in the interpreter, read bfloat16 denormals as other numbers)."""
    v = subnormal_values(dtype)
    E = v.numel()
    logits = torch.stack([v.roll(s) for s in range(0, E, 3)])  # every value at many positions
    for k in (1, 3, E):
        for renormalize in (True, False):
            w, e = run(backend, logits, k, renormalize)
            w_ref, e_ref = reference.topk_softmax(logits, k, renormalize)
            assert torch.equal(e, e_ref), (k, e, e_ref)
            assert_close(w, w_ref)


@pytest.mark.parametrize("k", [2, 3])
def test_sorted_rows(backend, k):
    # Ascending rows replace the running maxima at every element, descending rows never do;
    # halved ranks (0, 0, 1, 1, ...) make every maximum a tie the lower index must win.
    widths = range(k, 26) if backend == "triton" else range(k, 42)
    for E in widths:
        ranks = torch.arange(E, dtype=torch.float32)
        logits = torch.stack([ranks, ranks.flip(0), (ranks // 2), (ranks // 2).flip(0)])
        w, e = run(backend, logits, k, True)
        w_ref, e_ref = reference.topk_softmax(logits, k, True)
        assert torch.equal(e, e_ref), (E, e, e_ref)
        assert_close(w, w_ref)


@pytest.mark.parametrize("scale", [1.0, 30.0, 100.0])
def test_full_softmax_accuracy(backend, scale):
    # renormalize=False sums exp over the whole row (a vectorised polynomial exp in the C++ kernel,
    # terms below e^-80 flushed to 0): against float64, no worse than twice torch's own float32
    # softmax, forward and backward. Wide scales put many terms near and past the flush point.
    E_values = (5, 37) if backend == "triton" else (5, 8, 37, 64, 256)
    for E in E_values:
        x = torch.randn(300, E, generator=torch.Generator().manual_seed(E)) * scale
        k = min(4, E)
        xg = x.clone().requires_grad_()
        w, e = run(backend, xg, k, renormalize=False)
        g = torch.randn(300, k, generator=torch.Generator().manual_seed(1))
        w.backward(g)
        x64 = x.double().requires_grad_()
        w64 = torch.softmax(x64, -1).gather(1, e)
        w64.backward(g.double())
        x32 = x.clone().requires_grad_()
        w32 = torch.softmax(x32, -1).gather(1, e)
        w32.backward(g)
        floor = 1e-7
        assert (w.double() - w64).abs().max() <= 2 * (w32.double() - w64).abs().max() + floor * w64.abs().max()
        grad_err = (xg.grad.double() - x64.grad).abs().max()
        assert grad_err <= 2 * (x32.grad.double() - x64.grad).abs().max() + floor * x64.grad.abs().max()


def test_ties_go_to_lower_index(backend):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [-0.0, 0.0, -1.0, 0.0, -0.0]])
    _, e = run(backend, logits, 3)
    assert e.tolist() == [[1, 2, 4], [0, 1, 3]]


def test_neg_inf_rows_get_zero_weights(backend):
    logits = torch.full((3, 6), float("-inf"))
    logits[1, 4] = 2.0
    for renormalize in (True, False):
        w, e = run(backend, logits, 2, renormalize)
        assert e.tolist() == [[0, 1], [4, 0], [0, 1]]
        assert w.tolist() == [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]


def test_nan_ranks_first_and_poisons_its_row(backend):
    logits = torch.tensor([[0.0, float("nan"), 5.0, float("nan")], [1.0, 2.0, 3.0, 4.0]])
    w, e = run(backend, logits, 2)
    assert e.tolist() == [[1, 3], [3, 2]]
    assert torch.isnan(w[0]).all() and not torch.isnan(w[1]).any()


def test_nan_late_in_a_long_row(backend):
    logits = torch.randn(3, 40)
    logits[0, 35] = float("nan")
    logits[2, 17] = float("nan")
    logits[2, 39] = float("nan")
    _, e = run(backend, logits, 2)
    _, e_ref = reference.topk_softmax(logits, 2)
    assert torch.equal(e, e_ref)
    assert e[0, 0] == 35 and e[2].tolist() == [17, 39]
    _, e1 = run(backend, logits, 1)
    assert e1[:, 0].tolist() == [35, e_ref[1, 0].item(), 17]


@pytest.mark.parametrize("renormalize", [True, False])
def test_non_contiguous(backend, renormalize):
    # Strided rows are converted into a float32 row buffer by the C++ kernel, forward and backward.
    base = torch.randn(12, 40)
    logits = base.t()[:, ::2]  # [40, 6], strides (1, 80)
    assert not logits.is_contiguous()
    x = logits.detach().requires_grad_()  # a leaf with the same strides
    w, e = run(backend, x, 3, renormalize)
    g = torch.randn_like(w)
    w.backward(g)
    xr = logits.contiguous().requires_grad_()
    w_ref, e_ref = reference.topk_softmax(xr, 3, renormalize)
    w_ref.backward(g)
    assert torch.equal(e, e_ref)
    assert_close(w, w_ref)
    assert_close(x.grad, xr.grad)


def test_weights_sum_to_one_when_renormalized(backend):
    logits = torch.randn(50, 12)
    w, _ = run(backend, logits, 4)
    assert_close(w.sum(-1), torch.ones(50))
    w_full, _ = run(backend, logits, 4, renormalize=False)
    assert (w_full.sum(-1) <= 1 + 1e-6).all()


@pytest.mark.parametrize("renormalize", [True, False])
def test_gradients_match_reference(backend, renormalize):
    for kind in ["random", "ties", "neg_inf", "all_neg_inf"]:
        logits = adversarial_logits(kind, 9, 11, seed=3)
        upstream = torch.randn(9, 4, generator=torch.Generator().manual_seed(1))
        x = logits.clone().requires_grad_()
        w, _ = run(backend, x, 4, renormalize)
        (w * upstream).sum().backward()
        x_ref = logits.clone().requires_grad_()
        w_ref, _ = reference.topk_softmax(x_ref, 4, renormalize)
        (w_ref * upstream).sum().backward()
        assert_close(x.grad, x_ref.grad, msg=kind)
        assert not torch.isnan(x.grad).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gradients_low_precision(backend, dtype, renormalize):
    logits = torch.randn(20, 16)
    x = logits.to(dtype).requires_grad_()
    w, _ = run(backend, x, 2, renormalize)
    w.float().pow(2).sum().backward()
    assert x.grad.dtype == dtype
    x32 = logits.to(dtype).float().requires_grad_()
    w32, _ = reference.topk_softmax(x32, 2, renormalize)
    w32.pow(2).sum().backward()
    assert_close(x.grad, x32.grad, dtype=dtype)


@pytest.mark.parametrize("renormalize", [True, False])
def test_reference_gradcheck_float64(renormalize):
    for T, E, k in SMALL_TOPK_SHAPES:
        if T == 0:
            continue
        # Distinct logits: gradcheck's finite differences must not cross a selection boundary.
        x = (torch.randperm(T * E, generator=torch.Generator().manual_seed(E)).double().view(T, E) / 7).requires_grad_()
        assert torch.autograd.gradcheck(lambda t: reference.topk_softmax(t, k, renormalize)[0], (x,))


def test_kernel_gradcheck_float64_path(kernel_backend):
    """The kernels run in float32 only; their backward formula is checked against finite
    differences of the float32 forward with loose tolerance."""
    x = (torch.randperm(60, generator=torch.Generator().manual_seed(0)).float().view(6, 10) / 5).requires_grad_()
    with moe_kernels.use_backend(kernel_backend):
        assert torch.autograd.gradcheck(lambda t: topk_softmax(t, 3)[0], (x,), eps=1e-3, atol=1e-3, rtol=1e-2)


def test_empty_batch(backend):
    w, e = run(backend, torch.empty(0, 5), 2)
    assert w.shape == (0, 2) and e.shape == (0, 2)


@pytest.mark.parametrize(
    "logits, k, error",
    [
        (torch.randn(4), 1, ValueError),  # 1-D
        (torch.randn(2, 3, 4), 1, ValueError),  # 3-D
        (torch.randn(4, 0), 1, ValueError),  # no experts
        (torch.randn(4, 3), 0, ValueError),  # k < 1
        (torch.randn(4, 3), 4, ValueError),  # k > E
        (torch.randn(4, 3), 1.0, TypeError),  # k not an int
        (torch.randint(0, 5, (4, 3)), 1, TypeError),  # dtype (float64 is accepted: test_float64.py)
        (torch.randint(0, 3, (4, 3)), 1, TypeError),  # integer logits
        ([[1.0, 2.0]], 1, TypeError),  # not a tensor
    ],
)
def test_bad_arguments(logits, k, error):
    with pytest.raises(error, match="logits|k"):
        topk_softmax(logits, k)


def test_opcheck(kernel_backend):
    """The router's op with topk_softmax's arguments (softmax scores, no bias, one group)."""
    op = torch.ops.moe_kernels.topk_router if kernel_backend == "cpu" else torch.ops.moe_kernels_triton.topk_router
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 5, 5)]:
        for renormalize in (True, False):
            logits = torch.randn(T, E, requires_grad=True)
            torch.library.opcheck(op, (logits, k, "softmax", None, 1, 1, "top2_sum", renormalize, 1.0))


def test_backward_kernel_opcheck():
    if not moe_kernels._extension.has_kernel("topk_router_backward", "CPU"):
        pytest.skip("no C++ backward kernel in this build")
    op = torch.ops.moe_kernels.topk_router_backward
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 5, 5), (4, 40, 20)]:
        logits = torch.randn(T, E)
        _, experts = reference.topk_softmax(logits, k)
        for renormalize in (True, False):
            torch.library.opcheck(op, (torch.randn(T, k), logits, experts, "softmax", renormalize, 1.0, True))


def _from_weights_kernel():
    if not moe_kernels._extension.has_kernel("topk_router_backward_from_weights", "CPU"):
        pytest.skip("no C++ from-weights backward in this build")
    return torch.ops.moe_kernels.topk_router_backward_from_weights


@pytest.mark.parametrize("kind", [*ADVERSARIAL_KINDS, "nan"])
@pytest.mark.parametrize(
    "E, k", [(8, 1), (8, 2), (20, 3), (64, 2), (64, 6), (64, 8), (67, 5), (4, 4), (40, 12), (40, 16)]
)
def test_backward_from_weights_is_the_logits_backward(kind, E, k):
    """The float32 renormalised backward autograd takes (from a copy of the forward's weights) agrees
    with the C++ backward that recomputes the weights from the logits (the one float64 logits and
    scaling_factor = 0 take), masked and NaN rows included: NaN at the same places, the rest within
    float32 tolerance (the two round differently: w (g - dot) against the scores' chain rule)."""
    _from_weights_kernel()
    if kind == "nan":
        logits = torch.randn(33, E, generator=torch.Generator().manual_seed(E))
        logits[3, E // 2] = float("nan")
        logits[7] = float("nan")
    else:
        logits = adversarial_logits(kind, 33, E, seed=E + k)
    g = torch.randn(33, k, generator=torch.Generator().manual_seed(k))
    x = logits.clone().requires_grad_()
    with moe_kernels.use_backend("cpu"):
        w, experts = topk_softmax(x, k)
    w.backward(g)
    recomputed = torch.ops.moe_kernels.topk_router_backward(g, logits, experts, "softmax", True, 1.0, True)
    assert torch.equal(x.grad.isnan(), recomputed.isnan()), kind
    assert_close(x.grad.nan_to_num(), recomputed.nan_to_num(), msg=kind)


def test_backward_from_weights_survives_in_place_edits():
    """The returned weights edited in place after the forward (as routing code does, e.g.
    `weights *= scaling`) neither break nor change the backward: autograd saved a copy."""
    _from_weights_kernel()
    logits = torch.randn(20, 16)
    g = torch.randn(20, 4)
    x = logits.clone().requires_grad_()
    with moe_kernels.use_backend("cpu"):
        w, _ = topk_softmax(x, 4)
    w.mul_(2.5)
    w.backward(g)
    x_ref = logits.clone().requires_grad_()
    w_ref, _ = reference.topk_softmax(x_ref, 4)
    (w_ref * 2.5).backward(g)
    assert_close(x.grad, x_ref.grad)


@pytest.mark.parametrize(
    "renormalize, dtype, held",
    [(True, torch.float32, False), (False, torch.float32, True), (True, torch.bfloat16, False)],
)
def test_graph_holds_logits_only_when_its_backward_reads_them(renormalize, dtype, held):
    """Renormalised routing saves the router's [T, k] float32 weights (half-precision logits
    too), so a graph does not keep the [T, E] logits alive once the caller drops them; the full
    softmax reads the logits."""
    import weakref

    _from_weights_kernel()
    x = torch.randn(64, 32, dtype=dtype, requires_grad=True)
    logits = x * 2.0  # an intermediate (MulBackward keeps the scalar, not its output)
    ref = weakref.ref(logits)
    with moe_kernels.use_backend("cpu"):
        w, _ = topk_softmax(logits, 2, renormalize)
    del logits
    assert (ref() is not None) == held
    w.float().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_backward_from_weights_opcheck():
    op = _from_weights_kernel()
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 5, 5), (4, 40, 20)]:
        w, experts = reference.topk_softmax(torch.randn(T, E), k)
        torch.library.opcheck(op, (torch.randn(T, k), w, experts, E, 1.0, torch.float32))


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(4, 2), torch.rand(4, 2).double(), torch.zeros(4, 2, dtype=torch.long), 8), "float32"),
        ((torch.randn(4, 3), torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.long), 8), "shape"),
        ((torch.randn(4, 2), torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.long), 1), "k <= num_experts"),
        ((torch.randn(4, 2), torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.int32), 8), "int64"),
    ],
)
def test_backward_from_weights_bad_arguments(args, match):
    op = _from_weights_kernel()
    with pytest.raises(RuntimeError, match=match):
        op(*args, 1.0, torch.float32)


def test_torch_compile_fullgraph(kernel_backend):
    def route(x):
        w, e = topk_softmax(x, 2)
        return (w * e.float()).sum(-1)

    x = torch.randn(16, 8)
    with moe_kernels.use_backend(kernel_backend):
        compiled = torch.compile(
            route, fullgraph=True, backend="aot_eager" if kernel_backend == "triton" else "inductor"
        )
        assert_close(compiled(x), route(x))


@pytest.mark.parametrize("renormalize", [False, True])
def test_past_the_triton_kernel_limit(backend, renormalize):
    """E = 4100 is past the Triton router's 2048 experts: valid input, handed on (backends.fallback:
    the CUDA kernel for CUDA tensors, the reference under the interpreter), never an error."""
    logits = torch.randn(5, 4100, generator=torch.Generator().manual_seed(1)).requires_grad_()
    with moe_kernels.use_backend(backend):
        w, e = topk_softmax(logits, 3, renormalize)
    rw, re = reference.topk_softmax(logits, 3, renormalize)
    assert torch.equal(e, re)
    assert_close(w, rw)
    if backend == "triton" and backend.device == "cpu":  # the interpreter: the reference itself
        assert torch.equal(w, rw)
    g = torch.randn_like(rw)
    assert_close(torch.autograd.grad(w, logits, g)[0], torch.autograd.grad(rw, logits, g)[0])
