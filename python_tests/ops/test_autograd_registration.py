"""moe_kernels/ops/_autograd.py: the extension ops' autograd, registered without torch's per-call
fill_defaults, behaves as torch.library.register_autograd's (gradients, needs_input_grad, no-grad
calls, opcheck, torch.compile), and refuses schemas it cannot serve."""

import pytest
import torch

import moe_kernels
from moe_kernels import _extension
from moe_kernels.ops import _autograd, topk_router

_LIB = torch.library.Library("moe_kernels_autograd_test", "DEF")
_LIB.define("scale(Tensor x, float s) -> Tensor")
_LIB.define("with_default(Tensor x, int n=2) -> Tensor")
_LIB.impl("scale", lambda x, s: x * s, "CPU")
_LIB.impl("with_default", lambda x, n: x * n, "CPU")
_LIB._register_fake("scale", lambda x, s: torch.empty_like(x))

_SEEN_NEEDS = []


def _setup(ctx, inputs, output):
    ctx.s = inputs[1]


def _backward(ctx, grad):
    _SEEN_NEEDS.append(tuple(ctx.needs_input_grad))
    return grad * ctx.s, None


_autograd.register_autograd("moe_kernels_autograd_test::scale", _backward, setup_context=_setup)
scale = torch.ops.moe_kernels_autograd_test.scale


def test_gradient_and_needs_input_grad():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    _SEEN_NEEDS.clear()
    y = scale(x, 3.0)
    assert "moe_kernels_autograd_test_scale" in y.grad_fn.name()
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    assert _SEEN_NEEDS == [(True, False)]  # the op's own inputs, not the dispatch key set
    assert torch.autograd.gradcheck(lambda t: scale(t, -1.5), (x,))


def test_no_grad_call_has_no_graph():
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        assert scale(x, 2.0).grad_fn is None
    assert scale(torch.randn(4), 2.0).grad_fn is None


def test_opcheck_and_compile():
    x = torch.randn(3, 4, requires_grad=True)
    torch.library.opcheck(scale, (x, 0.5))

    def f(t):
        return scale(t, 2.0).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(x), x)
    assert torch.equal(g, torch.full_like(x, 2.0))


def test_schema_with_a_default_is_refused():
    with pytest.raises(ValueError, match="default"):
        _autograd.register_autograd("moe_kernels_autograd_test::with_default", _backward, setup_context=_setup)


def test_router_backward_does_not_fill_defaults(monkeypatch):
    """The extension ops' autograd never calls torch's fill_defaults (its cost grows with the
    square of the argument count: topk_router has nine)."""
    if not _extension.has_kernel("topk_router", "CPU"):
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")

    def refuse(*args, **kwargs):
        raise AssertionError("fill_defaults called")

    monkeypatch.setattr(torch._library.utils, "fill_defaults", refuse)
    x = torch.randn(6, 8, requires_grad=True)
    with moe_kernels.use_backend("cpu"):
        w, _ = topk_router(x, 2, renormalize=True)
    w.sum().backward()
    assert x.grad is not None


_LIB.define("scale2(Tensor x, Tensor y, float s) -> Tensor")
_LIB.impl("scale2", lambda x, y, s: x * s + y * 0, "CPU")
_LIB._register_fake("scale2", lambda x, y, s: torch.empty_like(x))


def _setup_scale2(ctx, inputs, output):
    ctx.s = inputs[2]


_autograd.register_autograd(
    "moe_kernels_autograd_test::scale2",
    lambda ctx, g: (g * ctx.s, torch.zeros_like(g), None),
    setup_context=_setup_scale2,
)


def test_direct_call_is_the_op_with_or_without_gradients():
    """_autograd.direct: without a gradient to track, the op's result with no graph; with one (any
    input that requires grad, under grad mode), the op through its autograd, as a plain call."""
    direct = _autograd.direct(torch.ops.moe_kernels_autograd_test.scale2)
    assert direct.packet is torch.ops.moe_kernels_autograd_test.scale2
    x, y = torch.randn(4), torch.randn(4)
    out = direct(x, y, 2.0)
    assert torch.equal(out, x * 2.0) and out.grad_fn is None
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        assert direct(xg, y, 2.0).grad_fn is None
    with torch.inference_mode():
        assert not direct(xg, y, 2.0).requires_grad
    out = direct(xg, y, 3.0)
    assert "moe_kernels_autograd_test_scale2" in out.grad_fn.name()
    (g,) = torch.autograd.grad(out.sum(), xg)
    assert torch.equal(g, torch.full_like(x, 3.0))
    # Only the second input requires grad: the graph is there, as for the op itself.
    yg = y.clone().requires_grad_()
    assert direct(x, yg, 3.0).requires_grad == torch.ops.moe_kernels_autograd_test.scale2(x, yg, 3.0).requires_grad
    assert direct(x, yg, 3.0).requires_grad
    compiled = torch.compile(lambda t: direct(t, y, 2.0).sum(), fullgraph=True, backend="aot_eager")
    (g,) = torch.autograd.grad(compiled(xg), xg)
    assert torch.equal(g, torch.full_like(x, 2.0))
