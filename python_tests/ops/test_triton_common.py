"""The Triton helpers every kernel shares (moe_kernels/triton/common.py), on their own: a kernel
that only applies one helper to a tensor, compared bit for bit with torch. Triton cases (the
interpreter on CPU tensors, and the GPU)."""

import pytest
import torch

from moe_kernels import backends

if backends.triton_importable():
    import triton
    import triton.language as tl

    from moe_kernels.triton.common import from_float32

    @triton.jit
    def convert_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < N, other=0.0)
        tl.store(y_ptr + i, from_float32(x, y_ptr.dtype.element_ty), mask=i < N)


def _bf16_edge_values() -> torch.Tensor:
    """float32 values over bfloat16's whole range, its rounding ties and its limits."""
    # From float32's subnormals (2^-149) to past bfloat16's largest finite (2^127 and above).
    wide = torch.randn(8192, generator=torch.Generator().manual_seed(0)) * torch.logspace(-150, 127, 8192, base=2)
    bits = [
        0x7F7FFFFF,  # float32 max: rounds past bfloat16's max to inf
        0x7F7F7FFF,  # just below the tie that overflows
        0x3F808000,  # 1 + 2^-8: a tie, rounds to even (down)
        0x3F818000,  # a tie that rounds up
        0x00000001,  # the smallest subnormal
        0x007FFFFF,  # the largest subnormal: rounds up to the smallest normal
        0x7FFFFFFF,  # a NaN whose rounding would carry into the sign
        0x7FC00001,
        -1,  # 0xFFFFFFFF: a negative NaN whose rounding would wrap to zero
        -2139095041,  # 0x807FFFFF: the largest negative subnormal
    ]
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    return torch.cat([wide, torch.tensor(bits, dtype=torch.int32).view(torch.float32), special])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_float32_rounds_as_torch(backend, dtype):
    """from_float32 is torch's float32 -> dtype conversion (nearest even), NaN as NaN: the
    interpreter's own bfloat16 conversion put about half of random values one ulp off."""
    if "triton" not in backend:
        pytest.skip("a Triton helper")
    x = _bf16_edge_values().to(backend.device)
    y = torch.empty(x.shape, dtype=dtype, device=backend.device)
    convert_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(dtype)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    same = (y.view(ints) == want.view(ints)) | (y.isnan() & want.isnan())
    assert same.all(), (x[~same][:8], y[~same][:8], want[~same][:8])
