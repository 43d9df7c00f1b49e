"""One tolerance table for every test, and flash-attention's rule for fp16 / bf16."""

import torch

TOL = {
    torch.float64: {"atol": 1e-12, "rtol": 1e-10},
    torch.float32: {"atol": 2e-6, "rtol": 1e-5},
    # Only where no fp32 reference of the same computation exists; prefer assert_lowp_close.
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype=None, msg: str = ""):
    """Compare within the table's tolerance for `dtype` (default: actual's dtype); NaNs must match."""
    tol = TOL[dtype or actual.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), equal_nan=True, msg=msg or None, **tol)


def assert_lowp_close(actual: torch.Tensor, ref_fp32: torch.Tensor, eager_lowp: torch.Tensor):
    """flash-attention's rule: against a float32 reference, the kernel's error is at most twice
    that of eager PyTorch computing the same thing in the low-precision dtype (plus one ulp-ish
    floor so that an exactly-right eager result does not demand an exactly-right kernel)."""
    floor = {torch.float16: 1e-3, torch.bfloat16: 8e-3}[actual.dtype]
    a, r, e = actual.double(), ref_fp32.double(), eager_lowp.double()
    nan = torch.isnan(r)
    assert torch.equal(torch.isnan(a), nan), "NaN pattern differs from the reference"
    kernel_err = (a - r)[~nan].abs().max().item() if (~nan).any() else 0.0
    eager_err = (e - r)[~nan].abs().max().item() if (~nan).any() else 0.0
    assert kernel_err <= 2 * eager_err + floor, f"kernel error {kernel_err} > 2 x eager {eager_err} + {floor}"
