"""chosen_linear (csrc/cpu/chosen_linear.cpp), the chosen experts' linear layers at a few tokens:
each span's rows times its expert's weight ([E, out, in], or transposed [E, in, out]), in float32
in the order csrc/cpu/linear/chosen_rows.h fixes, rounded once; rows in no span are zero; bad
spans are a clear error, never an access out of bounds."""

import pytest
import torch

from moe_kernels import _extension
from moe_kernels.integrations import transformers_experts  # noqa: F401  (registers the fake)

pytestmark = pytest.mark.skipif(
    not _extension.has_kernel("chosen_linear", "CPU"), reason=f"extension not built: {_extension.LOAD_ERROR}"
)


def chosen_linear(rows, weight, spans, transposed=False):
    spans = torch.tensor(spans, dtype=torch.int64).reshape(-1, 3)
    return torch.ops.moe_kernels.chosen_linear(rows, weight, spans, transposed)


def weight_of(weight, e, transposed=False):
    """Expert e's weight as [out, in]."""
    return weight[e].t() if transposed else weight[e]


def expected(rows, weight, spans, transposed=False):
    """float64 products summed; zero rows outside the spans."""
    out = torch.zeros(rows.shape[0], weight.shape[2 if transposed else 1], dtype=torch.float64)
    for e, a, b in spans:
        out[a:b] = rows[a:b].double() @ weight_of(weight, e, transposed).double().t()
    return out


def in_order(rows, weight, spans, transposed=False):
    """chosen_rows.h's arithmetic in float32 torch ops, each product and sum rounded on its own: the
    dot layout's eight lanes (lane l takes i = 8 j + l, the tail joins lane 0) summed as a tree,
    the axpy layout's one sum in order of i; rounded once to the rows' dtype."""
    out = torch.zeros(rows.shape[0], weight.shape[2 if transposed else 1])
    for e, a, b in spans:
        x, w = rows[a:b].float(), weight_of(weight, e, transposed).float()  # [n, in], [out, in]
        products = x[:, None, :] * w[None, :, :]  # [n, out, in], float32
        d_in = x.shape[1]
        if transposed:
            acc = torch.zeros(products.shape[:2])
            for i in range(d_in):
                acc = acc + products[..., i]
        else:
            lanes = torch.zeros(*products.shape[:2], 8)
            full = d_in // 8 * 8
            for j in range(0, full, 8):
                lanes = lanes + products[..., j : j + 8]
            for i in range(full, d_in):
                lanes[..., 0] = lanes[..., 0] + products[..., i]
            p = lanes.unbind(-1)
            acc = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
        out[a:b] = acc
    return out.to(rows.dtype)


# spans of 1, 2, 0, 4 and 7 rows (blocks of four rows and fewer; one and two weight rows at a
# time); row 15 in none
SPANS = [(3, 0, 1), (0, 1, 3), (4, 3, 3), (1, 4, 8), (2, 8, 15)]


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_in", [1, 7, 64, 131])
def test_matches_float64_products_in_its_order(dtype, d_in, transposed):
    g = torch.Generator().manual_seed(d_in)
    E, d_out, R = 5, 37, 16  # 37 features: blocks of 16, pairs and single weight rows, 8 + 5 lanes
    weight = torch.randn(E, d_out, d_in, generator=g).to(dtype)
    if transposed:
        weight = weight.transpose(1, 2).contiguous()
    rows = torch.randn(R, d_in, generator=g).to(dtype)
    out = chosen_linear(rows, weight, SPANS, transposed)
    assert out.dtype == dtype and out.shape == (R, d_out)
    ref = expected(rows, weight, SPANS, transposed)
    tol = dict(rtol=1e-5, atol=1e-5 * d_in) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    assert torch.equal(out[15], torch.zeros(d_out, dtype=dtype))
    # the bits: the order of chosen_rows.h, whatever the row block or weight rows at a time
    assert torch.equal(out, in_order(rows, weight, SPANS, transposed))


@pytest.mark.parametrize("flush", [False, True], ids=["", "flush_denormal"])
@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widens_every_16_bit_weight_exactly(dtype, transposed, flush):
    """Every one of the 65536 bit patterns (subnormals, infinities, NaNs) times 1 through the
    kernel's widening comes back as itself (-0 as +0: the sums start from +0). fp16 subnormals are
    normal float32 numbers: also with subnormals flushed (torch.set_flush_denormal), where bf16's
    are zero, as in torch's own arithmetic, the calling thread's alone."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    weight = values.reshape(1, 1, -1) if transposed else values.reshape(1, -1, 1)
    threads = torch.get_num_threads()
    if flush and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        torch.set_num_threads(1)  # the flag is the calling thread's: every task runs on it
        out = chosen_linear(torch.ones(1, 1, dtype=dtype), weight, [(0, 0, 1)], transposed)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    want = values.float() + 0.0
    if flush and dtype == torch.bfloat16:
        want = torch.where(want.abs() < torch.finfo(torch.float32).tiny, 0.0, want)
    torch.testing.assert_close(out.reshape(-1).float(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_rounds_once_and_takes_weight_views(transposed):
    # Integer operands: every product and sum exact in float32, so the bf16 result is exactly the
    # float32 sum rounded once; a weight whose expert and feature (or input) strides are not the
    # packed ones.
    g = torch.Generator().manual_seed(0)
    if transposed:
        base = torch.randint(-3, 4, (6, 48, 20), generator=g).to(torch.bfloat16)
        weight = base[1::2, ::2, :]  # [3, 24, 20], contiguous along out only
    else:
        base = torch.randint(-3, 4, (6, 40, 24), generator=g).to(torch.bfloat16)
        weight = base[1::2, ::2, :]  # [3, 20, 24], contiguous along in only
    rows = torch.randint(-3, 4, (4, 24), generator=g).to(torch.bfloat16)
    spans = [(2, 0, 2), (0, 2, 4)]
    out = chosen_linear(rows, weight, spans, transposed)
    assert torch.equal(out, expected(rows, weight, spans, transposed).float().to(torch.bfloat16))


@pytest.mark.parametrize("transposed", [False, True], ids=["out_in", "in_out"])
def test_threads_give_the_same_bits(transposed):
    g = torch.Generator().manual_seed(1)
    weight, rows = torch.randn(16, 300, 96, generator=g), torch.randn(20, 96, generator=g)
    if transposed:
        weight = weight.transpose(1, 2).contiguous()
    spans = [(e, e, e + 1) for e in range(16)] + [(3, 16, 20)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = chosen_linear(rows, weight, spans, transposed)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(chosen_linear(rows, weight, spans, transposed), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "spans, match",
    [
        ([(5, 0, 1)], "expert 5"),
        ([(-1, 0, 1)], "expert -1"),
        ([(0, 2, 1)], "outside"),
        ([(0, 0, 5)], "outside"),
        ([(0, -1, 1)], "outside"),
        ([(0, 0, 2), (1, 1, 3)], "two spans"),
    ],
)
def test_bad_spans_raise(spans, match):
    with pytest.raises(RuntimeError, match=match):
        chosen_linear(torch.randn(4, 8), torch.randn(5, 3, 8), spans)


def test_bad_operands_raise():
    rows, weight = torch.randn(4, 8), torch.randn(5, 3, 8)
    with pytest.raises(RuntimeError, match="dtype"):
        chosen_linear(rows, weight.double(), [(0, 0, 1)])
    with pytest.raises(RuntimeError, match="contiguous along in"):
        chosen_linear(rows, weight.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :8], [(0, 0, 1)])
    with pytest.raises(RuntimeError, match=r"\[E, out, in\]"):
        chosen_linear(rows, torch.randn(5, 3, 7), [(0, 0, 1)])
    with pytest.raises(RuntimeError, match=r"\[E, in, out\]"):
        chosen_linear(rows, torch.randn(5, 3, 8), [(0, 0, 1)], True)
    with pytest.raises(RuntimeError, match="contiguous along out"):
        chosen_linear(rows, torch.randn(5, 3, 8).transpose(1, 2), [(0, 0, 1)], True)


def test_opcheck():
    g = torch.Generator().manual_seed(2)
    for R, spans in [(3, [(1, 0, 2), (0, 2, 3)]), (0, [])]:
        for transposed in (False, True):
            args = (
                torch.randn(R, 16, generator=g),
                torch.randn(2, 16, 5, generator=g) if transposed else torch.randn(2, 5, 16, generator=g),
                torch.tensor(spans, dtype=torch.int64).reshape(-1, 3),
                transposed,
            )
            torch.library.opcheck(torch.ops.moe_kernels.chosen_linear, args)
