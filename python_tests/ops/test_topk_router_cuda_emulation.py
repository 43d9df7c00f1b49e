"""The CUDA topk_router kernels' logic, executed on the host.

csrc/cuda/topk_router.cu is only compiled here (no GPU). Its row algorithm is written once in
csrc/include/moe_kernels/topk_router_row.h over a warp executor; python_tests/ops/emulate/
topk_router_cuda.cpp (host_emulation.build) runs it with the 32 lanes in sequence and the
device's butterfly reductions. What this checks: the device algorithm's selection (ties, NaN,
-inf, groups, bias), weights and fused backward against the reference, and that every warp
reduction ends uniform across lanes. What it cannot check: the CUDA execution itself (shuffles,
__syncwarp, shared memory) and the device's expf.
"""

import ctypes

import host_emulation
import pytest
import torch
from shapes import ADVERSARIAL_KINDS, adversarial_logits
from tolerances import assert_close

from moe_kernels import reference

from .test_topk_router import ROUTER_IDS, ROUTERS, assert_same_selection, kwargs_for

SCORING = {"softmax": 0, "sigmoid": 1}
GROUP_SCORING = {"top2_sum": 0, "max": 1}
i64, f64, ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    so = ctypes.CDLL(str(host_emulation.build("topk_router_cuda", tmp_path_factory.mktemp("emulate"), shared=True)))
    so.router_forward.argtypes = [ctypes.c_int, ptr, i64, i64, i64, i64, ptr, i64, ctypes.c_int, ctypes.c_int]
    so.router_forward.argtypes += [i64, i64, ctypes.c_int, f64, ptr, ptr]
    so.router_backward.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64, i64, ptr, i64, ctypes.c_int]
    so.router_backward.argtypes += [ctypes.c_int, f64, ptr]
    return so


def compute_type(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def emulate(
    so,
    logits,
    k,
    *,
    scoring="softmax",
    bias=None,
    num_groups=1,
    topk_groups=None,
    group_scoring="top2_sum",
    renormalize=False,
    scaling_factor=1.0,
):
    """The CUDA forward on the host: (weights [T, k] float32 / float64, experts [T, k] int64).
    fp16 / bf16 logits are passed as float32, the kernel's first step on the device."""
    acc = compute_type(logits.dtype)
    x = logits.to(acc)  # keeps strides
    T, E = x.shape
    b = None if bias is None else bias.to(acc).contiguous()
    weights, experts = torch.empty(T, k, dtype=acc), torch.empty(T, k, dtype=torch.int64)
    rc = so.router_forward(
        int(acc == torch.float64), x.data_ptr(), T, E, x.stride(0), x.stride(1), None if b is None else b.data_ptr(),
        k, SCORING[scoring], GROUP_SCORING[group_scoring], num_groups, topk_groups or num_groups, int(renormalize),
        float(scaling_factor), weights.data_ptr(), experts.data_ptr(),
    )  # fmt: skip
    assert rc == 0
    return weights, experts


def emulate_backward(so, grad_weights, logits, experts, scoring, renormalize, scaling_factor):
    """The CUDA backward on the host: d loss / d logits [T, E] in the compute type."""
    acc = compute_type(logits.dtype)
    x = logits.to(acc)
    g, ex = grad_weights.to(acc).contiguous(), experts.contiguous()
    grad = torch.empty(x.shape, dtype=acc)
    rc = so.router_backward(
        int(acc == torch.float64), g.data_ptr(), x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.stride(1),
        ex.data_ptr(), ex.shape[1], SCORING[scoring], int(renormalize), float(scaling_factor), grad.data_ptr(),
    )  # fmt: skip
    assert rc == 0
    return grad


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_forward_matches_reference(emulator, router, dtype):
    _, E, k, kw = router
    for T in (0, 1, 37):
        logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T + E)).to(dtype)
        kwargs = kwargs_for(E, kw, seed=T)
        w, e = emulate(emulator, logits, k, **kwargs)
        w_ref, e_ref = reference.topk_router(logits, k, **kwargs)
        assert w.dtype == w_ref.dtype
        assert_same_selection(e, e_ref, logits, k, kwargs)
        same = (e == e_ref).all(dim=1)
        assert_close(w[same], w_ref[same])


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS + ["nan"])
def test_adversarial(emulator, router, kind):
    _, E, k, kw = router
    logits = adversarial_logits("ties" if kind == "nan" else kind, 11, E, seed=E)
    if kind == "nan":
        logits[torch.rand(11, E, generator=torch.Generator().manual_seed(E)) < 0.15] = float("nan")
    kwargs = kwargs_for(E, kw)
    if kind in ("ties", "all_equal", "signed_zero") and kwargs.get("bias") is not None:
        kwargs["bias"] = torch.round(kwargs["bias"] * 20) / 20
    w, e = emulate(emulator, logits, k, **kwargs)
    w_ref, e_ref = reference.topk_router(logits, k, **kwargs)
    if kind in ("ties", "all_equal", "signed_zero", "all_neg_inf", "nan"):
        assert torch.equal(e, e_ref), (kind, e, e_ref)
    else:
        assert_same_selection(e, e_ref, logits, k, kwargs)
    same = (e == e_ref).all(dim=1)
    assert_close(w[same], w_ref[same])


def test_strided_rows(emulator):
    base = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    for x in (base[:, :64], base.t().contiguous().t()[:, 64:], base[::2, ::2]):
        kwargs = dict(scoring="sigmoid", bias=0.05 * torch.randn(64), num_groups=8, topk_groups=4, renormalize=True)
        w, e = emulate(emulator, x, 8, **kwargs)
        w_ref, e_ref = reference.topk_router(x.contiguous(), 8, **kwargs)
        assert_same_selection(e, e_ref, x, 8, kwargs)
        assert_close(w, w_ref)


def test_wide_rows_and_many_groups(emulator):
    # E far above the warp's 32 lanes, and the 64 groups the kernel's mask holds.
    logits = torch.randn(9, 2048, generator=torch.Generator().manual_seed(5))
    kwargs = dict(scoring="sigmoid", bias=0.01 * torch.randn(2048), num_groups=64, topk_groups=7, renormalize=True)
    w, e = emulate(emulator, logits, 16, **kwargs)
    w_ref, e_ref = reference.topk_router(logits, 16, **kwargs)
    assert_same_selection(e, e_ref, logits, 16, kwargs)
    assert_close(w, w_ref)


def test_more_groups_than_the_mask_is_refused(emulator):
    acc = torch.randn(2, 130)
    weights, experts = torch.empty(2, 2), torch.empty(2, 2, dtype=torch.int64)
    rc = emulator.router_forward(
        0, acc.data_ptr(), 2, 130, 130, 1, None, 2, 1, 1, 65, 3, 0, 1.0, weights.data_ptr(), experts.data_ptr()
    )
    assert rc != 0  # the Python op sends such calls to the reference (moe_kernels/ops/topk_router.py)


@pytest.mark.parametrize("router", ROUTERS, ids=ROUTER_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backward_matches_reference(emulator, router, dtype):
    _, E, k, kw = router
    logits = torch.randn(23, E, generator=torch.Generator().manual_seed(E)).to(dtype)
    logits[3] = float("-inf")  # a fully masked token
    if E > 2:
        logits[5, :2] = float("-inf")
    kwargs = kwargs_for(E, kw, dtype=dtype)
    grad_w = torch.randn(23, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = logits.clone().requires_grad_()
    w, e = reference.topk_router(x, k, **kwargs)
    (expected,) = torch.autograd.grad((w * grad_w.to(w.dtype)).sum(), x)
    got = emulate_backward(
        emulator, grad_w, logits, e, kwargs.get("scoring", "softmax"), kwargs.get("renormalize", False),
        kwargs.get("scaling_factor", 1.0),
    )  # fmt: skip
    assert_close(got, expected.to(got.dtype))


def test_backward_skips_out_of_range_experts(emulator):
    # The device cannot raise: selected ids outside [0, E) are skipped, the rest of the row is the
    # gradient of the valid selections (here: as if the bad slot had weight gradient 0).
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    g = torch.randn(2, 2, generator=torch.Generator().manual_seed(1))
    for bad in (-1, 8, 10**6):
        experts = torch.tensor([[0, 1], [2, bad]])
        got = emulate_backward(emulator, g, logits, experts, "sigmoid", False, 1.0)
        valid = emulate_backward(emulator, g * torch.tensor([[1.0, 1.0], [1.0, 0.0]]), logits,
                                 torch.tensor([[0, 1], [2, 3]]), "sigmoid", False, 1.0)  # fmt: skip
        assert torch.equal(got, valid)
