"""smooth_step: every backend against the reference; values and derivatives at the boundaries."""

import pytest
import torch
from shapes import DTYPES
from tolerances import assert_close

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import smooth_step


def run(backend, t, gamma):
    with moe_kernels.use_backend(backend):
        return smooth_step(t, gamma)


@pytest.mark.parametrize("gamma", [1.0, 0.1, 10.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(backend, dtype, gamma):
    t = (torch.randn(7, 33, generator=torch.Generator().manual_seed(0)) * gamma).to(dtype)
    out = run(backend, t, gamma)
    assert out.shape == t.shape and out.dtype == dtype
    assert_close(out, reference.smooth_step(t, gamma))


def test_boundary_values_and_derivatives(backend):
    gamma = 2.0
    t = torch.tensor([-5.0, -1.0, -0.5, 0.0, 0.5, 1.0, 5.0, float("inf"), float("-inf")], requires_grad=True)
    y = run(backend, t, gamma)
    (grad,) = torch.autograd.grad(y.sum(), t)
    # S(t) = -t^3/4 + 3t/4 + 1/2 for gamma = 2: exactly 0 and 1 at and beyond +-1.
    assert y.tolist() == [0.0, 0.0, 0.5 - 0.375 + 0.03125, 0.5, 0.5 + 0.375 - 0.03125, 1.0, 1.0, 1.0, 0.0]
    # S'(t) = 3/4 - 3 t^2 / 4: 0 at the boundaries (C^1) and outside, 3/4 at the centre.
    assert grad.tolist() == [0.0, 0.0, 0.5625, 0.75, 0.5625, 0.0, 0.0, 0.0, 0.0]


def test_derivative_continuous_at_boundary(backend):
    gamma = 1.0
    eps = 1e-3
    t = torch.tensor([-0.5 - eps, -0.5 + eps, 0.5 - eps, 0.5 + eps], requires_grad=True)
    (grad,) = torch.autograd.grad(run(backend, t, gamma).sum(), t)
    assert grad.abs().max() < 0.02  # 6 eps / gamma^2 on the inner side, 0 outside


def test_nan_propagates(backend):
    y = run(backend, torch.tensor([float("nan"), 0.1]), 1.0)
    assert torch.isnan(y[0]) and not torch.isnan(y[1])


def test_gradients_match_reference(backend):
    t = (torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 0.8).requires_grad_()
    up = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    (g,) = torch.autograd.grad((run(backend, t, 1.5) * up).sum(), t)
    (g_ref,) = torch.autograd.grad((reference.smooth_step(t, 1.5) * up).sum(), t)
    assert_close(g, g_ref)


def test_non_contiguous_and_empty(backend):
    base = torch.randn(10, 6)
    t = base.t()[::2]
    assert not t.is_contiguous()
    assert_close(run(backend, t, 1.0), reference.smooth_step(t.contiguous(), 1.0))
    assert run(backend, torch.empty(0, 3), 1.0).shape == (0, 3)


def test_reference_gradcheck_float64():
    t = torch.tensor([-2.0, -0.45, -0.1, 0.0, 0.3, 0.49, 0.7], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: reference.smooth_step(x, 1.0), (t,))


def test_opcheck(kernel_backend):
    ns = torch.ops.moe_kernels if kernel_backend == "cpu" else torch.ops.moe_kernels_triton
    for shape in [(5, 7), (0,), (3, 2, 4)]:
        t = torch.randn(shape, requires_grad=True)
        torch.library.opcheck(ns.smooth_step, (t, 0.7))
        torch.library.opcheck(ns.smooth_step_backward, (torch.randn(shape), t.detach(), 0.7))


def test_torch_compile_fullgraph(kernel_backend):
    def f(x):
        return smooth_step(x * 2, 1.0).sum(-1)

    x = torch.randn(8, 5)
    with moe_kernels.use_backend(kernel_backend):
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager" if kernel_backend == "triton" else "inductor")
        assert_close(compiled(x), f(x))


@pytest.mark.parametrize(
    "t, gamma, error",
    [
        (torch.randn(3), 0.0, ValueError),
        (torch.randn(3), -1.0, ValueError),
        (torch.randn(3), float("inf"), ValueError),
        (torch.randn(3), float("nan"), ValueError),
        (torch.randn(3), True, TypeError),
        (torch.randn(3), "1", TypeError),
        (torch.randint(0, 5, (3,)), 1.0, TypeError),  # float64 is accepted: test_float64.py
        (torch.arange(3), 1.0, TypeError),
        ([0.0, 1.0], 1.0, TypeError),
    ],
)
def test_bad_arguments(t, gamma, error):
    with pytest.raises(error, match="t |gamma"):
        smooth_step(t, gamma)
