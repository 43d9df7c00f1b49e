"""chosen_linear (csrc/cpu/chosen_linear.cpp), the chosen experts' linear layers at a few tokens:
each span's rows times its expert's weight, in float32, rounded once; rows in no span are zero;
bad spans are a clear error, never an access out of bounds."""

import pytest
import torch

from moe_kernels import _extension
from moe_kernels.integrations import transformers_experts  # noqa: F401  (registers the fake)

pytestmark = pytest.mark.skipif(
    not _extension.has_kernel("chosen_linear", "CPU"), reason=f"extension not built: {_extension.LOAD_ERROR}"
)


def chosen_linear(rows, weight, spans):
    return torch.ops.moe_kernels.chosen_linear(rows, weight, torch.tensor(spans, dtype=torch.int64).reshape(-1, 3))


def expected(rows, weight, spans):
    """float64 products summed, rounded once to the rows' dtype; zero rows outside the spans."""
    out = torch.zeros(rows.shape[0], weight.shape[1], dtype=torch.float64)
    for e, a, b in spans:
        out[a:b] = rows[a:b].double() @ weight[e].double().t()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_in", [1, 7, 64, 131])
def test_matches_float64_products(dtype, d_in):
    g = torch.Generator().manual_seed(d_in)
    E, d_out, R = 5, 37, 9
    weight = torch.randn(E, d_out, d_in, generator=g).to(dtype)
    rows = torch.randn(R, d_in, generator=g).to(dtype)
    spans = [(3, 0, 1), (0, 1, 3), (4, 3, 3), (1, 4, 8)]  # an empty span; row 8 in none
    out = chosen_linear(rows, weight, spans)
    assert out.dtype == dtype and out.shape == (R, d_out)
    ref = expected(rows, weight, spans)
    tol = dict(rtol=1e-5, atol=1e-5 * d_in) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    assert torch.equal(out[8], torch.zeros(d_out, dtype=dtype))


def test_rounds_once_and_takes_weight_views():
    # Integer operands: every product and sum exact in float32, so the bf16 result is exactly the
    # float32 sum rounded once; a weight whose expert and feature strides are not the packed ones.
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-3, 4, (6, 40, 24), generator=g).to(torch.bfloat16)
    weight = base[1::2, ::2, :]  # [3, 20, 24], contiguous along in only
    rows = torch.randint(-3, 4, (4, 24), generator=g).to(torch.bfloat16)
    spans = [(2, 0, 2), (0, 2, 4)]
    out = chosen_linear(rows, weight, spans)
    assert torch.equal(out, expected(rows, weight, spans).float().to(torch.bfloat16))


def test_threads_give_the_same_bits():
    g = torch.Generator().manual_seed(1)
    weight, rows = torch.randn(16, 300, 96, generator=g), torch.randn(20, 96, generator=g)
    spans = [(e, e, e + 1) for e in range(16)] + [(3, 16, 20)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = chosen_linear(rows, weight, spans)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(chosen_linear(rows, weight, spans), one)
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


def test_opcheck():
    g = torch.Generator().manual_seed(2)
    for R, spans in [(3, [(1, 0, 2), (0, 2, 3)]), (0, [])]:
        args = (
            torch.randn(R, 16, generator=g),
            torch.randn(2, 5, 16, generator=g),
            torch.tensor(spans, dtype=torch.int64).reshape(-1, 3),
        )
        torch.library.opcheck(torch.ops.moe_kernels.chosen_linear, args)
