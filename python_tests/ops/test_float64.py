"""float64 on every op and every backend (issue 15, item 4): accepted, computed in float64 (a
kernel's float64 path, or the reference where the kernel has none, as backends() says), equal to
the reference, and torch.autograd.gradcheck passes on each differentiable op's public function."""

import pytest
import torch

import moe_kernels
from moe_kernels import backends, reference
from moe_kernels.ops import (
    balanced_assignment,
    batchwise_mask,
    capacity_positions,
    combine,
    dispatch,
    dselect_k,
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

F64 = torch.float64


def distinct(T, E, seed=0, scale=7.0):
    """[T, E] float64 with distinct entries: finite differences never cross a selection boundary."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(T * E, generator=g).to(F64).view(T, E) / scale).requires_grad_()


def test_backends_report_the_float64_path():
    summary = moe_kernels.backends()
    for op, row in summary.items():
        for device in ("cpu", "cuda"):
            name = row[f"{device} float64"]
            assert name in (*backends.BACKENDS, "unavailable"), (op, row)
            if row[device] == "unavailable":
                assert name == "unavailable"
            else:
                assert name in (row[device], "torch")
    # The ops without a float64 kernel say so; the ones with one keep their kernel.
    for op in ("load_probabilities", "smooth_step", "dselect_k", "batchwise_mask"):
        assert summary[op]["cpu float64"] == "torch"
    for op in ("topk_router", "dispatch", "combine", "permute", "unpermute", "sinkhorn", "balanced_assignment"):
        assert summary[op]["cpu float64"] == summary[op]["cpu"]


def test_choose_for_routes_float64_to_a_float64_path(kernel_backend):
    x = torch.zeros(2, 3, dtype=F64)
    with moe_kernels.use_backend(kernel_backend):
        assert backends.choose_for("load_probabilities", x) == "torch"
        assert backends.choose_for("load_probabilities", x.float()) == kernel_backend
        assert backends.choose_for("dispatch", x) == kernel_backend


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(backend, renormalize):
    x = distinct(5, 6)
    with moe_kernels.use_backend(backend):
        w, e = topk_softmax(x, 3, renormalize)
        assert w.dtype == F64
        rw, re = reference.topk_softmax(x, 3, renormalize)
        assert torch.equal(e, re)
        # topk_router's float64 kernels (C++, CUDA) or the reference: as test_topk_router's
        torch.testing.assert_close(w, rw, rtol=1e-12, atol=1e-14)
        assert torch.autograd.gradcheck(lambda t: topk_softmax(t, 3, renormalize)[0], (x,))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_topk_router(backend, scoring):
    x = distinct(6, 8, seed=1)
    bias = torch.linspace(-0.5, 0.5, 8, dtype=F64)
    kw = dict(scoring=scoring, bias=bias, num_groups=2, topk_groups=1, renormalize=True, scaling_factor=2.5)
    with moe_kernels.use_backend(backend):
        w, e = topk_router(x, 2, **kw)
        rw, re = reference.topk_router(x, 2, **kw)
        assert torch.equal(e, re)
        torch.testing.assert_close(w, rw.to(w.dtype), rtol=1e-12, atol=1e-14)
        assert torch.autograd.gradcheck(lambda t: topk_router(t, 2, **kw)[0], (x,))


def test_load_probabilities_and_noisy_topk_gate(backend):
    T, E, k = 5, 6, 2
    clean = distinct(T, E, seed=2, scale=5.0)
    raw = (torch.linspace(-1, 1, T * E, dtype=F64).view(T, E)).requires_grad_()
    noise = torch.randn(T, E, dtype=F64, generator=torch.Generator().manual_seed(3))
    with moe_kernels.use_backend(backend):
        w, e, load = noisy_topk_gate(clean, raw, noise, k)
        assert w.dtype == F64 and load.dtype == F64
        std = torch.nn.functional.softplus(raw) + 1e-2
        noisy = clean + noise * std
        P = load_probabilities(clean, noisy, std, k)
        assert P.dtype == F64
        torch.testing.assert_close(P, reference.load_probabilities(clean, noisy, std, k), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(load, P.sum(0), rtol=1e-12, atol=1e-14)
        assert torch.autograd.gradcheck(lambda c, r: noisy_topk_gate(c, r, noise, k)[2], (clean, raw))
        assert torch.autograd.gradcheck(lambda c, r: noisy_topk_gate(c, r, noise, k)[0], (clean, raw))


def test_smooth_step(backend):
    t = torch.linspace(-0.7, 0.7, 13, dtype=F64).requires_grad_()
    with moe_kernels.use_backend(backend):
        out = smooth_step(t, 1.0)
        assert out.dtype == F64 and torch.equal(out, reference.smooth_step(t, 1.0))
        assert torch.autograd.gradcheck(lambda x: smooth_step(x, 1.0), (t,))


def test_dselect_k(backend):
    g = torch.Generator().manual_seed(4)
    alpha = torch.randn(3, 2, dtype=F64, generator=g).requires_grad_()
    z = (torch.randn(3, 2, 3, dtype=F64, generator=g) * 0.3).requires_grad_()
    with moe_kernels.use_backend(backend):
        gates = dselect_k(alpha, z, 6, 1.0)
        assert gates.dtype == F64
        torch.testing.assert_close(gates, reference.dselect_k(alpha, z, 6, 1.0), rtol=1e-12, atol=1e-14)
        assert torch.autograd.gradcheck(lambda a, b: dselect_k(a, b, 6, 1.0), (alpha, z))


def test_batchwise_mask(backend):
    x = distinct(7, 3, seed=5).detach()
    with moe_kernels.use_backend(backend):
        mask = batchwise_mask(x, 2)
        assert torch.equal(mask, reference.batchwise_mask(x, 2)[0])


def test_dispatch_combine_permute(backend):
    T, E, k, C, d = 6, 3, 2, 3, 4
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, d, dtype=F64, generator=g).requires_grad_()
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, dtype=F64, generator=g).requires_grad_()
    priority = torch.rand(T, k, dtype=F64, generator=g)
    with moe_kernels.use_backend(backend):
        pos, counts = capacity_positions(experts, E, C, priority=priority)
        rpos, rcounts = reference.capacity_positions(experts, E, C, priority=priority)
        assert torch.equal(pos, rpos) and torch.equal(counts, rcounts)
        ex = experts
        buf = dispatch(x, ex, pos, E, C)
        assert buf.dtype == F64 and torch.equal(buf, reference.dispatch(x, ex, pos, E, C))
        assert torch.autograd.gradcheck(lambda a: dispatch(a, ex, pos, E, C), (x,))
        b = buf.detach().requires_grad_()
        assert torch.autograd.gradcheck(lambda a, w: combine(a, ex, pos, w), (b, weights))
        xs, offsets, order = permute(x, experts, E)
        assert xs.dtype == F64
        assert torch.autograd.gradcheck(lambda a: permute(a, experts, E)[0], (x,))
        ys = xs.detach().requires_grad_()
        assert torch.autograd.gradcheck(lambda y, w: unpermute(y, order, w, T), (ys, weights))


def test_sinkhorn_balanced_assignment_skip_sample(backend):
    x = distinct(6, 3, seed=7).detach()
    if backend == "triton":
        pytest.skip("sinkhorn and balanced_assignment have no Triton kernel")
    with moe_kernels.use_backend(backend):
        probs = sinkhorn(x, 50, 1e-9)
        assert probs.dtype == F64
        torch.testing.assert_close(probs, reference.sinkhorn(x, 50, 1e-9)[0], rtol=1e-10, atol=1e-12)
        experts = balanced_assignment(x, 2)
        assert torch.equal(experts, reference.balanced_assignment(x, 2)[0])

    # skip_sample has only the torch path. Rows of 1e-300 are 0 in float32: sampled in float64
    # after scaling by the row maximum.
    tiny = torch.full((4, 3), 1e-300, dtype=F64)
    e, kept, w = skip_sample(tiny, 2, generator=torch.Generator().manual_seed(0))
    assert w.dtype == F64 and int(kept.sum()) == int(torch.bincount(e, minlength=3).clamp(max=2).sum())
