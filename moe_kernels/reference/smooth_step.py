"""Reference smooth-step function (Section 3.1.3 of DSelect-k, 003_a1a58754fcb6a991.txt)."""

import torch


def smooth_step_coefficients(gamma: float) -> tuple[float, float]:
    """(c1, c3) of the cubic S(t) = t * (c1 - c3 * t * t) + 1/2 on |t| < gamma / 2.

    The paper writes S(t) = -2/gamma^3 t^3 + 3/(2 gamma) t + 1/2; every backend evaluates it in
    this Horner form with the coefficients computed in double precision and rounded once.
    """
    return 1.5 / gamma, 2.0 / gamma**3


def smooth_step(t: torch.Tensor, gamma: float) -> torch.Tensor:
    """S(t): 0 for t <= -gamma/2, 1 for t >= gamma/2, the cubic in between (C^1 everywhere).

    Args:
      t: any shape, float32 / float16 / bfloat16 / float64 (computed in float32, or float64).
      gamma: width of the fractional region, > 0.

    Returns: S(t), same shape and dtype as t. NaN stays NaN. Differentiable: S'(t) =
    3/(2 gamma) - 6 t^2 / gamma^3 inside the open interval, exactly 0 outside and on its ends.
    """
    compute = torch.float64 if t.dtype == torch.float64 else torch.float32
    x = t.to(compute)
    half = gamma / 2
    c1, c3 = smooth_step_coefficients(gamma)
    # The cubic on the input clamped to the interval, by a where rather than clamp: outside the
    # interval its branch is discarded, and the bound keeps it finite there (so the discarded
    # branch cannot put inf * 0 = NaN in the gradient at t = +-inf); a NaN t fails every
    # comparison and passes through with its gradient, which is NaN (clamp's would be 0), the
    # convention of docs/reliability.md and what the kernels give.
    xc = torch.where(x.abs() > half, torch.full_like(x, half).copysign(x), x)
    cubic = xc * (c1 - c3 * xc * xc) + 0.5
    out = torch.where(x <= -half, 0.0, torch.where(x >= half, 1.0, cubic))
    return out.to(t.dtype)
