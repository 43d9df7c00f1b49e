"""bench/gpu_solver_variants.py (the CUDA solver at several auction epsilons, on a GPU): its smoke
run, the CPU solver's row on a small shape; and its divisors, each of which the host emulation
solves exactly (test_balanced_assignment_cuda_emulation.py's test_optimal_at_every_eps_divisor)."""

import os
import re
from pathlib import Path

import pytest
import torch

from moe_kernels import _extension

from . import bench_module, smoke_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not _extension.LOADED, reason="the CPU solver is the extension's")
def test_smoke_times_the_cpu_solver():
    stdout = smoke_run("gpu_solver_variants.py", interpret=False)
    rows = [r.split("|")[1:-1] for r in stdout.splitlines() if r.startswith("| 256 ")]
    assert [[c.strip() for c in r][:3] for r in rows] == [["256", "8", "CPU solver"]]


def test_divisors_start_with_the_default():
    variants = _variants()
    header = (ROOT / "csrc" / "include" / "moe_kernels" / "balanced_assignment_steps.h").read_text()
    assert f"#define MK_DEVICE_EPS_DIV {variants.DIVISORS[0]}.0" in header
    assert len(set(variants.DIVISORS)) == len(variants.DIVISORS) and min(variants.DIVISORS) > 0


def _variants():
    return bench_module("gpu_solver_variants")


def test_profile_line_is_read_from_stderr(monkeypatch):
    """The profile line as csrc/cuda_ops.cpp's fprintf writes it (its format string, read from the
    source and filled in here) is what solver_profile reads back from file descriptor 2."""
    variants = _variants()
    glue = (ROOT / "csrc" / "cuda_ops.cpp").read_text()
    start = glue.index('"moe_kernels balanced_assignment profile:')
    pieces = re.findall(r'"((?:[^"\\]|\\.)*)"', glue[start : glue.index(",", glue.index("\\n", start))])
    fmt = "".join(pieces).replace("\\n", "\n")
    values = iter("8192 64 128 32768 904 850 0 2 0 shared 1980 10.1 4.2 0.5 3.9 0.3 0.1".split())
    line = re.sub(r"%(?:lld|g|s|\.0f|\.4f)", lambda _: next(values), fmt)
    assert "%" not in line and next(values, None) is None
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.delenv("MOE_KERNELS_SOLVER_PROFILE", raising=False)
    profile = variants.solver_profile(lambda: os.write(2, line.encode()))
    assert profile == {
        "iterations": "904",
        "passes": "2",
        "heaps": "shared",
        "auction": "10.1",
        "bids": "4.2",
        "take": "3.9",
        "pass_ms": "0.3",
        "moves": "0.1",
    }
    assert "MOE_KERNELS_SOLVER_PROFILE" not in os.environ
