"""dselect_k: every backend against the reference, forward and backward; Proposition 2; B.2."""

import pytest
import torch
from shapes import DSELECT_SHAPES, SMALL_DSELECT_SHAPES
from tolerances import assert_close, assert_lowp_close

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import dselect_k
from moe_kernels.reference.dselect_k import num_bits


def run(backend, *args, **kwargs):
    with moe_kernels.use_backend(backend):
        return dselect_k(*args, **kwargs)


def shapes_for(backend):
    return SMALL_DSELECT_SHAPES if backend == "triton" else DSELECT_SHAPES


def inputs(B, k, n, seed=0, scale=0.4, dtype=torch.float32, static=False):
    """alpha [B, k], z [B, k, m] with z mostly inside the fractional region of S (gamma = 1)."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.randn(B, k, generator=g)
    z = torch.randn(B, k, num_bits(n), generator=g) * scale
    if static:
        alpha, z = alpha[0], z[0]
    return alpha.to(dtype), z.to(dtype)


@pytest.mark.parametrize("return_selectors", [False, True])
def test_matches_reference(backend, return_selectors):
    for B, k, n in shapes_for(backend):
        alpha, z = inputs(B, k, n, seed=B * 100 + n)
        out = run(backend, alpha, z, n, 1.0, return_selectors=return_selectors)
        ref = reference.dselect_k(alpha, z, n, 1.0, return_selectors)
        if return_selectors:
            assert out[0].shape == (B, n) and out[1].shape == (B, k, 2 ** num_bits(n))
            assert_close(out[0], ref[0])
            assert_close(out[1], ref[1])
        else:
            assert out.shape == (B, n)
            assert_close(out, ref)


@pytest.mark.parametrize("n", [16, 64, 65])
def test_many_rows(backend, n):
    """More rows than the CPU kernel's block of 64 rows in vector lanes (two blocks and part of a
    third), n up to the largest it takes that way and just past it (the per-row path); a NaN and
    an all -inf alpha row inside a block, low-precision inputs too."""
    if backend == "triton" and getattr(backend, "device", "cpu") == "cpu":
        pytest.skip("the interpreter is slow at this size; SMALL_DSELECT_SHAPES cover its paths")
    alpha, z = inputs(150, 3, n, seed=n)
    alpha[70, 1] = float("nan")
    alpha[100] = float("-inf")
    gates, sel = run(backend, alpha, z, n, 1.0, return_selectors=True)
    ref_gates, ref_sel = reference.dselect_k(alpha, z, n, 1.0, True)
    assert_close(gates, ref_gates)
    assert_close(sel, ref_sel)
    assert torch.isnan(gates[70]).all() and torch.isnan(gates[100]).all()
    for dtype in (torch.float16, torch.bfloat16):
        a, zz = alpha.to(dtype), z.to(dtype)
        ref32 = reference.dselect_k(a.float(), zz.float(), n, 1.0)
        assert_close(run(backend, a, zz, n, 1.0).float(), ref32, dtype=dtype)
    # The backward (by lanes too), through the gates and the selectors.
    z[..., :1] *= 4  # some entries outside the fractional region: zero gradient there
    up = torch.randn(150, n, generator=torch.Generator().manual_seed(1))
    up_s = torch.randn(150, 3, 2 ** num_bits(n), generator=torch.Generator().manual_seed(2))
    grads = []
    for fn, use in ((dselect_k, backend), (reference.dselect_k, "torch")):
        a1, z1 = alpha.clone().requires_grad_(), z.clone().requires_grad_()
        with moe_kernels.use_backend(use):
            g, sel = fn(a1, z1, n, 1.0, return_selectors=True)
        grads.append(torch.autograd.grad((g * up).nansum() + (sel * up_s).nansum(), (a1, z1)))
    assert_close(grads[0][0], grads[1][0], msg="alpha")
    assert_close(grads[0][1], grads[1][1], msg="z")


def test_static_shapes(backend):
    alpha, z = inputs(1, 3, 6, static=True)
    gates, sel = run(backend, alpha, z, 6, 1.0, return_selectors=True)
    assert gates.shape == (6,) and sel.shape == (3, 8)
    assert_close(gates, reference.dselect_k(alpha, z, 6, 1.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(backend, dtype):
    alpha, z = inputs(6, 3, 12, seed=5, dtype=dtype)
    gates = run(backend, alpha, z, 12, 1.0)
    assert gates.dtype == dtype
    ref32 = reference.dselect_k(alpha.float(), z.float(), 12, 1.0)
    # eager in the low-precision dtype: selectors built in that dtype
    s = reference.smooth_step(z, 1.0)
    eager = (torch.softmax(alpha, -1)[..., None] * reference.dselect_k.__globals__["selectors"](s)[..., :12]).sum(-2)
    assert_lowp_close(gates, ref32, eager)


def test_simplex_proposition_2(backend):
    """r(S(z)) is on the simplex for any z (Prop. 2); so are the gates when n = 2^m."""
    alpha, z = inputs(9, 4, 16, seed=3, scale=1.0)
    gates, sel = run(backend, alpha, z, 16, 1.0, return_selectors=True)
    assert (sel >= 0).all() and (gates >= 0).all()
    assert_close(sel.sum(-1), torch.ones(9, 4))
    assert_close(gates.sum(-1), torch.ones(9))


def test_one_hot_when_binary(backend):
    """S(Z) binary: each selector is one-hot at the expert whose bits are S(z_i) (LSB first),
    so the gate has at most k nonzeros, equal to the softmax weights."""
    n = 8
    codes = torch.tensor([[5, 0, 5], [7, 2, 3]])  # per row: the expert each selector picks
    bits = (codes[..., None] >> torch.arange(3)) & 1
    z = torch.where(bits == 1, 0.7, -3.0)  # beyond +-gamma/2 = 0.5: S is exactly 0 or 1
    alpha = torch.tensor([[0.1, 0.5, -1.0], [2.0, 0.0, 1.0]])
    gates, sel = run(backend, alpha, z, n, 1.0, return_selectors=True)
    assert torch.equal(sel, torch.nn.functional.one_hot(codes, 8).float())
    p = torch.softmax(alpha, -1)
    expected = torch.zeros(2, 8).scatter_add_(1, codes, p)
    assert_close(gates, expected)
    assert ((gates > 0).sum(-1) <= 3).all()


def test_not_power_of_two_drops_extra_entries(backend):
    """n = 5 < 2^3: mass of selector entries 5..7 is not assigned to experts nor renormalised."""
    alpha = torch.zeros(1, 2)
    z = torch.tensor([[[0.7, 0.7, 0.7], [0.0, 0.0, 0.0]]])  # selector 0 -> entry 7 (not an expert)
    gates, sel = run(backend, alpha, z, 5, 1.0, return_selectors=True)
    assert_close(gates.sum(), torch.tensor(0.5 * 5 / 8))  # selector 1 is uniform over 8 entries
    assert_close(sel[0, 0, 7], torch.tensor(1.0))


@pytest.mark.parametrize("with_selectors", [False, True])
def test_gradients_match_reference(backend, with_selectors):
    for B, k, n in shapes_for(backend):
        alpha, z = inputs(B, k, n, seed=n + 7, scale=0.3)
        z[..., :1] *= 4  # some entries outside the fractional region: zero gradient there
        up = torch.randn(B, n, generator=torch.Generator().manual_seed(1))
        up_s = torch.randn(B, k, 2 ** num_bits(n), generator=torch.Generator().manual_seed(2))

        def loss(fn, a, zz):
            if with_selectors:
                g, s = fn(a, zz, n, 1.0, return_selectors=True)
                return (g * up).sum() + (s * up_s).sum()
            return (fn(a, zz, n, 1.0) * up).sum()

        a1, z1 = alpha.clone().requires_grad_(), z.clone().requires_grad_()
        with moe_kernels.use_backend(backend):
            ga, gz = torch.autograd.grad(loss(dselect_k, a1, z1), (a1, z1))
        a2, z2 = alpha.clone().requires_grad_(), z.clone().requires_grad_()
        ra, rz = torch.autograd.grad(loss(reference.dselect_k, a2, z2), (a2, z2))
        assert_close(ga, ra, msg=f"alpha {(B, k, n)}")
        assert_close(gz, rz, msg=f"z {(B, k, n)}")


def test_gradient_of_selectors_only(backend):
    """Only the selectors used (the entropy regulariser's path): the gates' gradient is absent."""
    alpha, z = inputs(3, 2, 6, seed=4)
    a1, z1 = alpha.clone().requires_grad_(), z.clone().requires_grad_()
    _, s = run(backend, a1, z1, 6, 1.0, return_selectors=True)
    (gz,) = torch.autograd.grad(s.pow(2).sum(), z1)
    z2 = z.clone().requires_grad_()
    (rz,) = torch.autograd.grad(reference.dselect_k(alpha, z2, 6, 1.0, True)[1].pow(2).sum(), z2)
    assert_close(gz, rz)


def test_reference_gradcheck_float64():
    for B, k, n in [(2, 2, 4), (3, 3, 6), (1, 1, 1)]:
        alpha, z = inputs(B, k, n, seed=n, scale=0.3, dtype=torch.float64)
        alpha.requires_grad_()
        z.requires_grad_()
        assert torch.autograd.gradcheck(lambda a, zz: reference.dselect_k(a, zz, n, 1.0, True), (alpha, z))


def test_kernel_gradcheck_float32(kernel_backend):
    """The kernels compute in float32: their backward against finite differences, loosely."""
    alpha, z = inputs(2, 2, 3, seed=9, scale=0.25)  # small: each output element is one backward call
    alpha.requires_grad_()
    z.requires_grad_()
    with moe_kernels.use_backend(kernel_backend):
        assert torch.autograd.gradcheck(
            lambda a, zz: dselect_k(a, zz, 3, 1.0, return_selectors=True),
            (alpha, z),
            eps=1e-3,
            atol=2e-3,
            rtol=1e-2,
        )


def test_non_contiguous(backend):
    alpha_base = torch.randn(4, 6)
    z_base = torch.randn(3, 4, 2, 6) * 0.4
    alpha = alpha_base.t()[::2]  # [3, 4]
    z = z_base.permute(3, 1, 0, 2)[::2, :, 0, :]  # [3, 4, 2] (m = 2 bits for n = 4), strided
    assert not alpha.is_contiguous() and not z.is_contiguous()
    assert_close(run(backend, alpha, z, 4, 1.0), reference.dselect_k(alpha.contiguous(), z.contiguous(), 4, 1.0))


def test_neg_inf_alpha(backend):
    alpha = torch.tensor([[0.0, float("-inf"), 1.0], [float("-inf")] * 3])
    z = torch.zeros(2, 3, 2)
    gates = run(backend, alpha, z, 4, 1.0)
    ref = reference.dselect_k(alpha, z, 4, 1.0)
    assert_close(gates, ref)
    assert torch.isnan(gates[1]).all()  # as torch.softmax of an all -inf row


def test_opcheck(kernel_backend):
    ns = torch.ops.moe_kernels if kernel_backend == "cpu" else torch.ops.moe_kernels_triton
    shapes = [(3, 2, 6), (0, 2, 4)] + ([(2, 1, 1)] if kernel_backend == "cpu" else [])  # the interpreter is slow
    for B, k, n in shapes:
        alpha, z = inputs(max(B, 1), k, n)
        alpha, z = alpha[:B].clone().requires_grad_(), z[:B].clone().requires_grad_()
        m = num_bits(n)
        for rs in (False, True):
            torch.library.opcheck(ns.dselect_k, (alpha, z, n, 1.0, rs))
        gs = torch.randn(B, k, 2**m)
        for grad_sel in (None, gs):
            torch.library.opcheck(
                ns.dselect_k_backward, (torch.randn(B, n), grad_sel, alpha.detach(), z.detach(), n, 1.0)
            )


def test_torch_compile_fullgraph(kernel_backend):
    def f(a, zz):
        g, s = dselect_k(a, zz, 6, 1.0, return_selectors=True)
        return g.sum(-1) + s.sum((-1, -2))

    alpha, z = inputs(4, 3, 6)
    with moe_kernels.use_backend(kernel_backend):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if kernel_backend == "triton" else "inductor")
        assert_close(compiled(alpha, z), f(alpha, z))


@pytest.mark.parametrize(
    "alpha, z, n, gamma, error",
    [
        (torch.randn(3), torch.randn(3, 3), 6, 0.0, ValueError),  # gamma
        (torch.randn(3), torch.randn(3, 2), 6, 1.0, ValueError),  # m != ceil(log2 6)
        (torch.randn(3), torch.randn(3, 4), 6, 1.0, ValueError),  # m too large
        (torch.randn(3), torch.randn(2, 3), 6, 1.0, ValueError),  # k mismatch
        (torch.randn(2, 3), torch.randn(3, 3), 6, 1.0, ValueError),  # per-example z not 3-D
        (torch.randn(2, 3, 1), torch.randn(2, 3, 1, 3), 6, 1.0, ValueError),  # alpha 3-D
        (torch.randn(0), torch.randn(0, 3), 6, 1.0, ValueError),  # k = 0
        (torch.randn(3), torch.randn(3, 3), 0, 1.0, ValueError),  # n = 0
        (torch.randn(3), torch.randn(3, 3), 6.0, 1.0, TypeError),  # n not an int
        (torch.randint(0, 5, (3,)), torch.randint(0, 5, (3, 3)), 6, 1.0, TypeError),  # dtype (float64: accepted)
        (torch.randn(3), torch.randn(3, 3).half(), 6, 1.0, TypeError),  # dtype mismatch
        ([0.0, 1.0], torch.randn(2, 3), 6, 1.0, TypeError),  # not a tensor
    ],
)
def test_bad_arguments(alpha, z, n, gamma, error):
    with pytest.raises(error, match="alpha|z |num_experts|gamma"):
        dselect_k(alpha, z, n, gamma)


def test_bad_return_selectors():
    with pytest.raises(TypeError, match="return_selectors"):
        dselect_k(torch.randn(2), torch.randn(2, 1), 2, 1.0, return_selectors=1)


def test_past_the_triton_kernel_limit(backend):
    """n = 1100 experts is past the Triton kernel's 1024: valid input, handed on
    (backends.fallback: the reference, dselect_k has no CUDA kernel), never an error."""
    alpha, z = (t.requires_grad_() for t in inputs(3, 2, 1100, seed=4))
    gates = run(backend, alpha, z, 1100, 1.0)
    ref = reference.dselect_k(alpha, z, 1100, 1.0)
    assert gates.shape == (3, 1100)
    assert_close(gates, ref)
    if backend == "triton" and backend.device == "cpu":  # the interpreter: the reference itself
        assert torch.equal(gates, ref)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(gates, (alpha, z), g), torch.autograd.grad(ref, (alpha, z), g), strict=True):
        assert_close(a, b)
