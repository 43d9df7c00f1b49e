"""sinkhorn: marginals (rows 1, columns n / k), kernel against the reference, row-shift
invariance, the n = k doubly stochastic case, -inf entries, bad arguments."""

import pytest
import torch
from tolerances import assert_close

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import sinkhorn

SHAPES = [(12, 3), (13, 4), (64, 8), (5, 5), (9, 1), (3, 7), (0, 4)]


def run(backend, logits, *args, **kw):
    if backend == "triton":
        pytest.skip("sinkhorn has no Triton kernel yet")
    with moe_kernels.use_backend(backend):
        return sinkhorn(logits, *args, **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_marginals(backend, dtype):
    for n, k in SHAPES:
        logits = (torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 2).to(dtype)
        p, err = run(backend, logits, 500, 1e-6, return_error=True)
        assert p.shape == (n, k) and p.dtype == dtype
        if n == 0:
            continue
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        assert err <= 1e-6
        assert torch.allclose(p.sum(1).double(), torch.ones(n, dtype=torch.float64), atol=tol, rtol=0)
        assert torch.allclose(p.sum(0).double(), torch.full((k,), n / k, dtype=torch.float64), rtol=2e-6, atol=tol)
        assert (p >= 0).all()


def test_kernel_matches_reference(kernel_backend):
    for n, k in SHAPES:
        logits = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
        for iters, tol in [(1, 0.0), (7, 0.0), (100, 1e-4)]:
            p = run(kernel_backend, logits, iters, tol)
            p_ref, _ = reference.sinkhorn(logits, iters, tol)
            assert_close(p, p_ref)
            p64 = run(kernel_backend, logits.double(), iters, tol)
            assert torch.allclose(p64, reference.sinkhorn(logits.double(), iters, tol)[0], atol=1e-12, rtol=1e-12)


def test_lowp_dtypes(backend):
    logits = torch.randn(32, 4)
    for dtype in (torch.float16, torch.bfloat16):
        p = run(backend, logits.to(dtype))
        assert p.dtype == dtype
        assert torch.allclose(p.float(), run(backend, logits.to(dtype).float()).to(dtype).float())


def test_row_shift_and_noncontiguous(backend):
    logits = torch.randn(40, 8, dtype=torch.float64)
    shifted = logits + torch.randn(40, 1, dtype=torch.float64) * 10
    assert torch.allclose(run(backend, logits), run(backend, shifted), atol=1e-10)
    nc = logits.t().contiguous().t()
    assert torch.allclose(run(backend, nc), run(backend, logits), atol=1e-12)


def test_square_is_doubly_stochastic_and_uniform_stays_uniform(backend):
    p = run(backend, torch.randn(6, 6, dtype=torch.float64), 1000, 1e-10)
    assert torch.allclose(p.sum(0), torch.ones(6, dtype=torch.float64), atol=1e-9)
    u = run(backend, torch.zeros(10, 5, dtype=torch.float64))
    assert torch.allclose(u, torch.full((10, 5), 0.2, dtype=torch.float64))


def test_neg_inf_is_forbidden(backend):
    logits = torch.randn(8, 4, dtype=torch.float64)
    logits[0, 1] = float("-inf")
    p = run(backend, logits, 2000, 1e-9)
    assert p[0, 1] == 0
    assert torch.allclose(p.sum(0), torch.full((4,), 2.0, dtype=torch.float64), atol=1e-7)


def test_opcheck_and_compile(kernel_backend):
    """The C++ op is opaque to dynamo; the reference's data-dependent early exit is not (it
    graph-breaks), so fullgraph compilation is checked on the kernel backend."""
    if kernel_backend == "triton":
        pytest.skip("no Triton kernel")
    logits = torch.randn(16, 4)
    torch.library.opcheck(torch.ops.moe_kernels.sinkhorn.default, (logits, 10, 1e-4))
    fn = torch.compile(lambda x: sinkhorn(x, 10, 0.0), fullgraph=True)
    with moe_kernels.use_backend(kernel_backend):
        assert torch.allclose(fn(logits), sinkhorn(logits, 10, 0.0), atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_iters"):
        sinkhorn(torch.randn(4, 2), 0)
    with pytest.raises(ValueError, match="tol"):
        sinkhorn(torch.randn(4, 2), 10, -1.0)
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        sinkhorn(torch.randn(4))
    with pytest.raises(TypeError, match="dtype"):
        sinkhorn(torch.zeros(4, 2, dtype=torch.int32))


@pytest.mark.skipif(not moe_kernels._extension.has_kernel("sinkhorn", "CPU"), reason="no C++ kernel in this build")
@pytest.mark.parametrize(
    "logits, tol, error, match",
    [
        (torch.zeros(4, 2, dtype=torch.int32), 1e-4, TypeError, "logits must be float"),
        (torch.zeros(4, 2, dtype=torch.bool), 1e-4, TypeError, "logits must be float"),
        (torch.zeros(4, 2, dtype=torch.complex64), 1e-4, TypeError, "logits must be float"),
        (torch.zeros(4, 2), float("nan"), ValueError, "tol must be"),
        (torch.zeros(4, 2), -1.0, ValueError, "tol must be"),
    ],
)
def test_raw_op_refuses_bad_arguments(logits, tol, error, match):
    # The audit's raw calls (issue 15): the registered op checks what the Python wrapper checks.
    with pytest.raises(error, match=match):
        torch.ops.moe_kernels.sinkhorn(logits, 10, tol)
