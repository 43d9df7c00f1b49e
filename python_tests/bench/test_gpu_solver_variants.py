"""bench/gpu_solver_variants.py (the CUDA solver at several auction epsilons, on a GPU): its smoke
run, the CPU solver's row on a small shape; and its divisors, each of which the host emulation
solves exactly (test_balanced_assignment_cuda_emulation.py's test_optimal_at_every_eps_divisor)."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_kernels import _extension

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not _extension.LOADED, reason="the CPU solver is the extension's")
def test_smoke_times_the_cpu_solver():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_solver_variants.py"), "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [r.split("|")[1:-1] for r in run.stdout.splitlines() if r.startswith("| 256 ")]
    assert [[c.strip() for c in r][:3] for r in rows] == [["256", "8", "CPU solver"]]


def test_divisors_start_with_the_default():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_solver_variants as variants
    finally:
        sys.path.remove(str(ROOT / "bench"))
    header = (ROOT / "csrc" / "include" / "moe_kernels" / "balanced_assignment_steps.h").read_text()
    assert f"#define MK_DEVICE_EPS_DIV {variants.DIVISORS[0]}.0" in header
    assert len(set(variants.DIVISORS)) == len(variants.DIVISORS) and min(variants.DIVISORS) > 0
