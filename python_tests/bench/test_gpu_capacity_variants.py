"""bench/gpu_capacity_variants.py (capacity_positions' CUDA paths timed on a GPU): its smoke run on
tiny CPU tensors, the Triton op in Triton's interpreter against the reference, a row for every path
that fits each shape and the launcher's path marked once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_kernels import backends

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not backends.triton_importable(), reason="the Triton op")
def test_smoke_lists_every_fitting_path():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_capacity_variants.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [r.split("|")[1:-1] for r in run.stdout.splitlines() if r.startswith("| ") and "---" not in r]
    rows = [[c.strip() for c in r] for r in rows[1:]]  # past the header
    shapes = {(r[0], r[1], r[2]) for r in rows}
    assert len(shapes) == 4
    for shape in shapes:
        paths = [r[3] for r in rows if (r[0], r[1], r[2]) == shape]
        assert paths == ["Triton", "strided, match", "strided, ballots", "tiles, ballots", "tiles, match"], paths
        assert [r[3] for r in rows if (r[0], r[1], r[2]) == shape and r[4] == "yes"] == ["tiles, ballots"]
