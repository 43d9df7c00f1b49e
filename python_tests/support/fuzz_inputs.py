"""Inputs for the fuzz tests (ops/test_fuzz.py): hypothesis draws the case (sizes, dtype, the kind
of values, the layout, a seed) and the tensors are built from it with a torch.Generator, so a
failing case shrinks to small sizes and simple kinds and replays exactly.

Profiles: "ci" (the default: derandomised, MOE_KERNELS_FUZZ_EXAMPLES cases per test, 500 unless
set) and "long" (MOE_KERNELS_FUZZ=long: 20,000 random cases per test, for local runs).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

_CHECKS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=int(os.environ.get("MOE_KERNELS_FUZZ_EXAMPLES", "500")),
    suppress_health_check=_CHECKS,
    print_blob=True,
)
settings.register_profile("long", deadline=None, max_examples=20_000, suppress_health_check=_CHECKS)
settings.load_profile("long" if os.environ.get("MOE_KERNELS_FUZZ") == "long" else "ci")

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# randn: scale 1; wide: scale 60 (softmax tails, exp underflow); ties: a few integers; inf: some
# -inf (masked experts; whole rows too); nan: some NaN; zeros: -0.0 / +0.0 / 1.0 mixed;
# extreme: near the dtype's range edge (finite).
KINDS = ("randn", "wide", "ties", "inf", "nan", "zeros", "extreme")
FINITE_KINDS = ("randn", "wide", "ties", "zeros", "extreme")


def values(shape, dtype, kind: str, seed: int, *, noncontiguous: bool = False) -> torch.Tensor:
    """A tensor of `shape` and `dtype` with values of `kind`; non-contiguous (a transposed or
    strided view of a larger buffer) when asked and the shape allows it."""
    g = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if kind == "ties":
        x = torch.randint(-2, 3, shape, generator=g).double()
    elif kind == "zeros":
        x = torch.tensor([-0.0, 0.0, 1.0], dtype=torch.float64)[torch.randint(0, 3, shape, generator=g)]
    elif kind == "extreme":
        big = {torch.float16: 3e4, torch.bfloat16: 1e37, torch.float32: 1e37, torch.float64: 1e300}[dtype]
        x = torch.randn(shape, generator=g, dtype=torch.float64).clamp(-1, 1) * big
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64) * (60.0 if kind == "wide" else 1.0)
        if kind == "inf":
            x[torch.rand(shape, generator=g) < 0.3] = float("-inf")
            if len(shape) == 2 and shape[0] > 1:
                x[0] = float("-inf")  # a fully masked row
        elif kind == "nan":
            x[torch.rand(shape, generator=g) < 0.15] = float("nan")
    x = x.to(dtype)
    if noncontiguous and len(shape) == 2 and x.numel():
        return x.t().contiguous().t()  # column-major: strides (1, T)
    if noncontiguous and len(shape) == 1 and x.numel():
        wide = torch.empty(2 * shape[0], dtype=dtype)
        wide[::2] = x
        return wide[::2]
    return x


@st.composite
def case(draw, *, max_t: int = 9, max_e: int = 9, kinds=KINDS, dtypes=DTYPES, min_t: int = 0):
    """(T, E, dtype, kind, seed, noncontiguous)."""
    return dict(
        T=draw(st.integers(min_t, max_t)),
        E=draw(st.integers(1, max_e)),
        dtype=draw(st.sampled_from(dtypes)),
        kind=draw(st.sampled_from(kinds)),
        seed=draw(st.integers(0, 2**31 - 1)),
        noncontiguous=draw(st.booleans()),
    )


def routing_choices(T: int, E: int, k: int, seed: int, empty: float = 0.2) -> torch.Tensor:
    """experts [T, k] int64: distinct experts per row (capacity_positions' contract), some -1."""
    g = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.empty(0, k, dtype=torch.int64)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    experts[torch.rand(T, k, generator=g) < empty] = -1
    return experts
