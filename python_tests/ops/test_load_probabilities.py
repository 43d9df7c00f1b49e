"""load_probabilities (eqs 8-9 of Shazeer et al. 2017, Appendix A): every backend against the
reference, forward and backward, adversarial input, and a Monte Carlo check of what P means."""

import math

import pytest
import torch
from shapes import ADVERSARIAL_KINDS, DTYPES, SMALL_TOPK_SHAPES, TOPK_SHAPES, adversarial_logits
from tolerances import assert_close

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import load_probabilities, topk_softmax


def inputs(T, E, dtype=torch.float32, seed=0):
    """(clean, noisy, stddev) as a noisy top-k gate makes them: noisy = clean + N(0,1) * stddev."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randn(T, E, generator=g)
    stddev = torch.nn.functional.softplus(torch.randn(T, E, generator=g)) + 0.05
    noisy = clean + torch.randn(T, E, generator=g) * stddev
    return clean.to(dtype), noisy.to(dtype), stddev.to(dtype)


def run(backend, clean, noisy, stddev, k):
    with moe_kernels.use_backend(backend):
        return load_probabilities(clean, noisy, stddev, k, return_topk=True)


def shapes_for(backend):
    return SMALL_TOPK_SHAPES if backend == "triton" else TOPK_SHAPES


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_random(backend, dtype):
    for T, E, k in shapes_for(backend):
        clean, noisy, stddev = inputs(T, E, dtype, seed=T + E)
        P, top = run(backend, clean, noisy, stddev, k)
        P_ref, top_ref = reference.load_probabilities(clean, noisy, stddev, k, return_topk=True)
        assert P.shape == (T, E) and top.shape == (T, k + 1)
        assert P.dtype == dtype and top.dtype == torch.int64
        assert torch.equal(top, top_ref), (T, E, k)
        # Both compute in float32 from the same inputs: they differ by the output rounding only.
        assert_close(P, P_ref)


def test_top_k_are_topk_softmax_experts(backend):
    for T, E, k in shapes_for(backend):
        clean, noisy, stddev = inputs(T, E, seed=1)
        _, top = run(backend, clean, noisy, stddev, k)
        _, experts = reference.topk_softmax(noisy, k)
        assert torch.equal(top[:, :k], experts)


def test_hand_computed_row(backend):
    # noisy ranks 0 > 2 > 1 > 3; k = 2: experts 0 and 2 are compared with the 3rd largest (1.0),
    # experts 1 and 3 with the 2nd largest (2.0).
    noisy = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    clean = torch.tensor([[2.0, 0.5, 1.5, 1.0]])
    stddev = torch.tensor([[1.0, 0.5, 2.0, 4.0]])
    P, top = run(backend, clean, noisy, stddev, 2)
    phi = lambda z: 0.5 * math.erfc(-z / math.sqrt(2))
    expected = [phi((2.0 - 1.0) / 1.0), phi((0.5 - 2.0) / 0.5), phi((1.5 - 1.0) / 2.0), phi((1.0 - 2.0) / 4.0)]
    assert top.tolist() == [[0, 2, 1]]
    assert_close(P, torch.tensor([expected]))


def test_ties_go_to_lower_index(backend):
    # Three equal maxima, k = 2: experts 0 and 1 are the top 2 (threshold = expert 2's 5.0);
    # expert 2 is outside (threshold = expert 1's 5.0).
    noisy = torch.tensor([[5.0, 5.0, 5.0, 1.0]])
    clean = torch.tensor([[4.0, 4.0, 4.0, 4.0]])
    stddev = torch.ones(1, 4)
    P, top = run(backend, clean, noisy, stddev, 2)
    assert top.tolist() == [[0, 1, 2]]
    assert_close(P, torch.special.ndtr(torch.full((1, 4), -1.0)))


def test_k_equals_e_is_always_selected(backend):
    clean, noisy, stddev = inputs(6, 5)
    P, top = run(backend, clean, noisy, stddev, 5)
    assert torch.equal(P, torch.ones(6, 5))
    assert (top[:, -1] == -1).all()


@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS)
def test_adversarial(backend, kind):
    for T, E, k in [(6, 7, 3), (4, 16, 15), (5, 1, 1), (5, 40, 3)]:
        noisy = adversarial_logits(kind, T, E, seed=0)
        clean = adversarial_logits(kind, T, E, seed=1)
        stddev = torch.rand(T, E, generator=torch.Generator().manual_seed(2)) + 0.1
        P, top = run(backend, clean, noisy, stddev, k)
        P_ref, top_ref = reference.load_probabilities(clean, noisy, stddev, k, return_topk=True)
        assert torch.equal(top, top_ref), kind
        assert_close(P, P_ref, msg=kind)
        assert not torch.isnan(P).any(), kind


def test_masked_experts(backend):
    """clean = -inf (a masked expert) gives P = 0 and no NaN gradient."""
    clean, noisy, stddev = inputs(4, 6)
    clean[:, 1] = float("-inf")
    noisy[:, 1] = float("-inf")
    x = clean.clone().requires_grad_()
    s = stddev.clone().requires_grad_()
    n = noisy.clone().requires_grad_()
    P, _ = run(backend, x, n, s, 2)
    assert (P[:, 1] == 0).all()
    P.sum().backward()
    for t in (x, n, s):
        assert not torch.isnan(t.grad).any()


def test_non_contiguous(backend):
    base = [t.t() for t in inputs(12, 30, seed=4)]  # [30, 12] views with strides (1, 30)
    clean, noisy, stddev = [b[:, ::2] for b in base]
    assert not noisy.is_contiguous()
    P, top = run(backend, clean, noisy, stddev, 3)
    P_ref, top_ref = reference.load_probabilities(
        clean.contiguous(), noisy.contiguous(), stddev.contiguous(), 3, return_topk=True
    )
    assert torch.equal(top, top_ref)
    assert_close(P, P_ref)


def test_empty_batch(backend):
    P, top = run(backend, *inputs(0, 5), 2)
    assert P.shape == (0, 5) and top.shape == (0, 3)


def _grads(fn, clean, noisy, stddev, k, upstream):
    tensors = [t.clone().requires_grad_() for t in (clean, noisy, stddev)]
    (fn(*tensors, k) * upstream).sum().backward()
    return [t.grad for t in tensors]


@pytest.mark.parametrize("kind", ["random", "ties", "neg_inf"])
def test_gradients_match_reference(backend, kind):
    for T, E, k in [(9, 11, 4), (5, 6, 6), (7, 3, 1)]:
        clean = adversarial_logits(kind, T, E, seed=5)
        noisy = adversarial_logits(kind, T, E, seed=6)
        stddev = torch.rand(T, E, generator=torch.Generator().manual_seed(7)) + 0.1
        upstream = torch.randn(T, E, generator=torch.Generator().manual_seed(8))

        def kernel(c, n, s, k):
            with moe_kernels.use_backend(backend):
                return load_probabilities(c, n, s, k)

        got = _grads(kernel, clean, noisy, stddev, k, upstream)
        want = _grads(reference.load_probabilities, clean, noisy, stddev, k, upstream)
        for name, a, b in zip(("clean", "noisy", "stddev"), got, want):
            assert_close(a, b, msg=f"{kind} {name} {(T, E, k)}")
            assert not torch.isnan(a).any()


def test_threshold_elements_get_the_noisy_gradient(backend):
    """Only the k-th and (k+1)-th noisy logits of a row influence P: they get all of its gradient."""
    clean, noisy, stddev = inputs(5, 8, seed=9)
    n = noisy.clone().requires_grad_()
    with moe_kernels.use_backend(backend):
        P, top = load_probabilities(clean, n, stddev, 3, return_topk=True)
    P.sum().backward()
    nonzero = n.grad != 0
    expected = torch.zeros_like(nonzero).scatter_(1, top[:, 2:4], True)
    assert torch.equal(nonzero, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_low_precision(backend, dtype):
    clean, noisy, stddev = inputs(20, 16, dtype, seed=10)
    upstream = torch.randn(20, 16)

    def kernel(c, n, s, k):
        with moe_kernels.use_backend(backend):
            return load_probabilities(c, n, s, k).float()

    got = _grads(kernel, clean, noisy, stddev, 2, upstream)
    want = _grads(reference.load_probabilities, clean.float(), noisy.float(), stddev.float(), 2, upstream)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        assert_close(a, b, dtype=dtype)


def test_reference_gradcheck_float64():
    for T, E, k in SMALL_TOPK_SHAPES:
        if T == 0:
            continue
        clean, _, stddev = (t.double() for t in inputs(T, E, seed=E))
        # Distinct noisy logits: finite differences must not cross a ranking boundary.
        noisy = torch.randperm(T * E, generator=torch.Generator().manual_seed(E)).double().view(T, E) / 7
        tensors = [t.clone().requires_grad_() for t in (clean, noisy, stddev)]
        assert torch.autograd.gradcheck(lambda c, n, s: reference.load_probabilities(c, n, s, k), tensors)


def test_kernel_gradcheck(kernel_backend):
    """The kernels run in float32 only: their backward against finite differences, loosely."""
    clean, _, stddev = inputs(4, 7, seed=11)
    noisy = torch.randperm(28, generator=torch.Generator().manual_seed(0)).float().view(4, 7) / 5
    tensors = [t.clone().requires_grad_() for t in (clean, noisy, stddev)]
    with moe_kernels.use_backend(kernel_backend):
        assert torch.autograd.gradcheck(
            lambda c, n, s: load_probabilities(c, n, s, 2), tensors, eps=1e-3, atol=2e-3, rtol=1e-2
        )


def test_monte_carlo_meaning(backend):
    """P(x, i) is the frequency with which i enters the top k when only element i's noise is
    drawn again, the others' noise kept (the definition above eq 8), within 3 sigma."""
    g = torch.Generator().manual_seed(12)
    T, E, k, N = 3, 6, 2, 20000
    clean = torch.randn(T, E, generator=g).double()
    stddev = (torch.rand(T, E, generator=g) + 0.3).double()
    noisy = clean + torch.randn(T, E, generator=g).double() * stddev
    P, _ = run(backend, clean.float(), noisy.float(), stddev.float(), k)
    for t in range(T):
        for i in range(E):
            h = noisy[t].repeat(N, 1)
            h[:, i] = clean[t, i] + torch.randn(N, generator=g).double() * stddev[t, i]
            _, experts = torch.topk(h, k, dim=1)
            freq = (experts == i).any(1).double().mean().item()
            p = P[t, i].item()
            sigma = math.sqrt(max(p * (1 - p), 1 / N) / N)
            assert abs(freq - p) <= 3 * sigma, (t, i, freq, p)


def test_p_ignores_the_element_own_noise(backend):
    """kth_excluding excludes i: redrawing only H_i leaves P(x, i) unchanged."""
    clean, noisy, stddev = inputs(8, 10, seed=13)
    P, _ = run(backend, clean, noisy, stddev, 3)
    for i in range(10):
        moved = noisy.clone()
        moved[:, i] = torch.randn(8, generator=torch.Generator().manual_seed(i)) * 3
        P2, _ = run(backend, clean, moved, stddev, 3)
        assert torch.equal(P2[:, i], P[:, i])


@pytest.mark.parametrize(
    "shapes, k, error",
    [
        (((4, 3), (4, 3), (4, 3)), 0, ValueError),  # k < 1
        (((4, 3), (4, 3), (4, 3)), 4, ValueError),  # k > E
        (((4, 3), (4, 3), (4, 3)), 1.0, TypeError),  # k not an int
        (((4, 3), (4, 4), (4, 3)), 1, ValueError),  # clean vs noisy shape
        (((4, 3), (4, 3), (4, 2)), 1, ValueError),  # stddev shape
        (((4,), (4,), (4,)), 1, ValueError),  # 1-D
        (((4, 0), (4, 0), (4, 0)), 1, ValueError),  # no experts
    ],
)
def test_bad_arguments(shapes, k, error):
    clean, noisy, stddev = (torch.randn(s) for s in shapes)
    with pytest.raises(error, match="logits|stddev|k"):
        load_probabilities(clean, noisy, stddev, k)


def test_bad_dtypes():
    clean, noisy, stddev = inputs(3, 4)
    with pytest.raises(TypeError, match="clean_logits"):
        load_probabilities(clean.half(), noisy, stddev, 1)
    with pytest.raises(TypeError, match="clean_logits"):
        load_probabilities(clean.double(), noisy, stddev.double(), 1)  # one dtype for all three
    with pytest.raises(TypeError, match="noisy_logits"):
        load_probabilities(clean.long(), noisy.long(), stddev.long(), 1)
    load_probabilities(clean.double(), noisy.double(), stddev.double(), 1)  # float64: test_float64.py
    with pytest.raises(TypeError, match="noisy_logits"):
        load_probabilities(clean, [[1.0]], stddev, 1)


def test_opcheck(kernel_backend):
    if kernel_backend == "cpu":
        op = torch.ops.moe_kernels.load_probabilities
    else:
        op = torch.ops.moe_kernels_triton.load_probabilities
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 5, 5)]:
        clean, noisy, stddev = (t.requires_grad_() for t in inputs(T, E))
        torch.library.opcheck(op, (clean, noisy, stddev, k))


def test_torch_compile_fullgraph(kernel_backend):
    def load(c, n, s):
        return load_probabilities(c, n, s, 2).sum(0)

    clean, noisy, stddev = inputs(16, 8)
    with moe_kernels.use_backend(kernel_backend):
        compiled = torch.compile(
            load, fullgraph=True, backend="aot_eager" if kernel_backend == "triton" else "inductor"
        )
        assert_close(compiled(clean, noisy, stddev), load(clean, noisy, stddev))


def test_load_is_differentiable_through_topk_softmax_gate(backend):
    """The gate's use: weights from topk_softmax and Load(X) = sum_x P from the same noisy logits."""
    clean, noisy, stddev = inputs(10, 6, seed=14)
    n = noisy.clone().requires_grad_()
    with moe_kernels.use_backend(backend):
        w, _ = topk_softmax(n, 2)
        load = load_probabilities(clean, n, stddev, 2).sum(0)
    (w.sum() + load.pow(2).sum()).backward()
    assert n.grad is not None and torch.isfinite(n.grad).all()


def test_backward_kernel_opcheck():
    if not moe_kernels._extension.has_kernel("load_probabilities_backward", "CPU"):
        pytest.skip("no C++ backward kernel in this build")
    op = torch.ops.moe_kernels.load_probabilities_backward
    for T, E, k in [(7, 8, 2), (0, 4, 1), (5, 5, 5), (4, 40, 20)]:
        clean, noisy, stddev = inputs(T, E)
        _, top = reference.load_probabilities(clean, noisy, stddev, k, return_topk=True)
        torch.library.opcheck(op, (torch.randn(T, E), clean, noisy, stddev, top, k))


def test_backward_kernel_matches_the_torch_formula():
    """The C++ backward against the backward written in torch ops (used by Triton), adversarial."""
    if not moe_kernels._extension.has_kernel("load_probabilities_backward", "CPU"):
        pytest.skip("no C++ backward kernel in this build")
    from moe_kernels.ops.load_probabilities import _backward_from_inputs

    for kind in ADVERSARIAL_KINDS:
        for T, E, k in [(6, 7, 3), (4, 16, 16), (5, 40, 3)]:
            noisy = adversarial_logits(kind, T, E, seed=0)
            clean = adversarial_logits(kind, T, E, seed=1)
            stddev = torch.rand(T, E, generator=torch.Generator().manual_seed(2)) + 0.1
            _, top = reference.load_probabilities(clean, noisy, stddev, k, return_topk=True)
            g = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
            got = torch.ops.moe_kernels.load_probabilities_backward(g, clean, noisy, stddev, top, k)
            want = _backward_from_inputs(clean, noisy, stddev, top, k, g)
            for a, b in zip(got, want):
                assert_close(a, b, msg=kind)


def test_past_the_triton_kernel_limit(backend):
    """E = 4100 is past the Triton kernel's 4096: valid input, handed on (backends.fallback: the
    CUDA kernel for CUDA tensors, the reference under the interpreter), never an error."""
    clean, noisy, stddev = (t.requires_grad_() for t in inputs(4, 4100, seed=3))
    P, top = run(backend, clean, noisy, stddev, 2)
    P_ref, top_ref = reference.load_probabilities(clean, noisy, stddev, 2, return_topk=True)
    assert torch.equal(top, top_ref)
    assert_close(P, P_ref)
    if backend == "triton" and backend.device == "cpu":  # the interpreter: the reference itself
        assert torch.equal(P, P_ref)
    g = torch.randn_like(P_ref)
    grads = torch.autograd.grad(P, (clean, noisy, stddev), g)
    for a, b in zip(grads, torch.autograd.grad(P_ref, (clean, noisy, stddev), g), strict=True):
        assert_close(a, b)
