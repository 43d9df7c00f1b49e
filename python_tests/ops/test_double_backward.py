"""Second derivatives (a backward with create_graph=True, e.g. a gradient penalty) through every
differentiable op, on every backend, against the reference's own.

The kernels' fused backwards have no derivative of their own: asked to build a graph, each
backward runs torch ops instead (the op's torch formula, or the reference differentiated:
_autograd.through_reference). Before that, their gradients had no graph (autograd's "not
implemented" warning) and every second derivative through them came out zero or wrong, silently.
One case still has none on the CPU's kernels, and says so: FROM_WEIGHTS. Those torch ops read nothing on the host
(no reference they differentiate uses boolean-mask indexing or torch.prod's backward).
"""

import pytest
import torch
from host_sync import sync_events, syncs

import moe_kernels
from moe_kernels import backends, ops, reference

T, E, K, D, C = 6, 4, 2, 3, 4


def _draw(seed, *shape, low=None):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x if low is None else x.abs() + low


def _cases():
    """(name, f(x) -> differentiable output, x): x the input differentiated twice."""
    logits, bias, raw, noise = _draw(0, T, E), _draw(1, E), _draw(2, T, E), _draw(3, T, E)
    experts = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(4))
    positions = reference.capacity_positions(experts, E, C - 1)[0]  # some choices dropped
    x, buffer, weights = _draw(5, T, D), _draw(6, E, C, D), _draw(7, T, K, low=0.1)
    x_sorted, _, order = reference.permute(x, experts, E)
    alpha, z = _draw(8, 3, K), _draw(9, 3, K, 2)
    yield "topk_router softmax renormalize", lambda t: ops.topk_router(t, K, renormalize=True)[0], logits
    yield "topk_router softmax scaled", lambda t: ops.topk_router(t, K, scaling_factor=2.5)[0], logits
    grouped = dict(scoring="sigmoid", bias=bias, num_groups=2, topk_groups=1, renormalize=True)
    yield "topk_router sigmoid groups", lambda t: ops.topk_router(t, K, **grouped)[0], logits
    yield "topk_softmax", lambda t: ops.topk_softmax(t, K)[0], logits
    yield "smooth_step", lambda t: ops.smooth_step(t, 1.5), _draw(10, T, E) * 0.5
    yield "dispatch", lambda t: ops.dispatch(t, experts, positions, E, C), x
    yield "combine buffer", lambda t: ops.combine(t, experts, positions, weights), buffer
    yield "combine weights", lambda t: ops.combine(buffer, experts, positions, t), weights
    yield "permute", lambda t: ops.permute(t, experts, E)[0], x
    yield "unpermute rows", lambda t: ops.unpermute(t, order, weights, T), x_sorted
    yield "unpermute weights", lambda t: ops.unpermute(x_sorted, order, t, T), weights
    yield "load_probabilities", lambda t: ops.load_probabilities(t, logits + noise, raw.abs() + 0.5, K), logits
    yield "noisy_topk_gate clean weights", lambda t: ops.noisy_topk_gate(t, raw, noise, K)[0], logits
    yield "noisy_topk_gate clean load", lambda t: ops.noisy_topk_gate(t, raw, noise, K)[2], logits
    yield "noisy_topk_gate raw", lambda t: ops.noisy_topk_gate(logits, t, noise, K)[2], raw
    yield "noisy_topk_gate noise", lambda t: ops.noisy_topk_gate(logits, raw, t, K)[0], noise
    yield "dselect_k alpha", lambda t: ops.dselect_k(t, z, E, 1.0), alpha
    yield "dselect_k z", lambda t: ops.dselect_k(alpha, t, E, 1.0), z


CASES = {name: (f, x) for name, f, x in _cases()}
# A renormalised softmax router on the extension's kernels keeps only its [T, k] weights for the
# backward (not the [T, E] logits: ops/topk_router.py, _setup_context_kernel), which determine the
# gradient but not its derivative: a double backward there raises, naming the way around it.
FROM_WEIGHTS = {"topk_router softmax renormalize", "topk_softmax"}


def _no_second_derivative(backend, case) -> bool:
    """Whether the case's router keeps only its weights on this backend: an extension backend
    whose device has the from-weights backward kernel (the CPU's; the CUDA build has none, so a
    CUDA router saves its logits and differentiates twice)."""
    if case not in FROM_WEIGHTS or backend not in ("cpu", "cuda"):
        return False
    probe = torch.empty(0, device=getattr(backend, "device", "cpu"))
    return backends.extension_kernel("topk_router_backward_from_weights", probe) is not None


def _second_derivative(f, x):
    """d/dx of |d/dx sum(f(x)^2)|^2, and whether the first derivative had a graph."""
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(f(x).square().sum(), x, create_graph=True)
    if not grad.requires_grad:
        return None
    (second,) = torch.autograd.grad(grad.square().sum(), x, allow_unused=True)
    return torch.zeros_like(x) if second is None else second


@pytest.mark.parametrize("case", list(CASES))
def test_second_derivative_matches_reference(backend, case):
    f, x = CASES[case]
    with moe_kernels.use_backend("torch"):
        expected = _second_derivative(f, x)
    assert expected is not None and expected.abs().sum() > 0, "the case must have a second derivative"
    with moe_kernels.use_backend(backend):  # GPU cases: the device axis moves the op's tensors
        if _no_second_derivative(backend, case):
            with pytest.raises(RuntimeError, match=r"no second derivative.*use_backend\('torch'\)"):
                _second_derivative(f, x)
            return
        got = _second_derivative(f, x)
    assert got is not None, f"{case}: the {backend.id} backward built no graph"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_second_derivative_reads_nothing_on_the_host(backend, case):
    """The graph the backward builds, and its own backward, run without a host read (each a device
    sync on a GPU): a gradient penalty stays capturable and free of graph breaks."""
    f, x = CASES[case]
    if _no_second_derivative(backend, case):
        pytest.skip("no second derivative on the kernels: raises (test_second_derivative_matches_reference)")
    with moe_kernels.use_backend(backend):
        x = x.clone().requires_grad_()
        out = f(x).square().sum()

        def both():
            (grad,) = torch.autograd.grad(out, x, create_graph=True)
            return torch.autograd.grad(grad.square().sum(), x, allow_unused=True)

        _, events = sync_events(both)
    assert not syncs(events), f"{case}: {syncs(events)}"


def _mixed_cases():
    """(name, f(a, b), a, b): the first derivative in a, the second in b (the two inputs of a
    bilinear op interact only in its mixed second derivative)."""
    experts = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(11))
    positions = reference.capacity_positions(experts, E, C - 1)[0]
    buffer, weights, x = _draw(12, E, C, D), _draw(13, T, K, low=0.1), _draw(14, T, D)
    x_sorted, _, order = reference.permute(x, experts, E)
    yield "combine buffer then weights", lambda b, w: ops.combine(b, experts, positions, w), buffer, weights
    yield "combine weights then buffer", lambda w, b: ops.combine(b, experts, positions, w), weights, buffer
    yield "unpermute rows then weights", lambda y, w: ops.unpermute(y, order, w, T), x_sorted, weights
    yield "unpermute weights then rows", lambda w, y: ops.unpermute(y, order, w, T), weights, x_sorted


MIXED = {name: (f, a, b) for name, f, a, b in _mixed_cases()}


@pytest.mark.parametrize("case", list(MIXED))
def test_mixed_second_derivative_matches_reference(backend, case):
    f, a, b = MIXED[case]

    def mixed():
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        (grad,) = torch.autograd.grad(f(a_, b_).square().sum(), a_, create_graph=True)
        (second,) = torch.autograd.grad(grad.square().sum(), b_)
        return second

    with moe_kernels.use_backend("torch"):
        expected = mixed()
    with moe_kernels.use_backend(backend):
        got = mixed()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
