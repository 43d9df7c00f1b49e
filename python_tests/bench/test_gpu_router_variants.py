"""bench/gpu_router_variants.py (the router's two pick recordings timed on a GPU): its smoke run on
tiny CPU tensors in Triton's interpreter, where it checks both recordings pick the same experts."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_kernels import backends

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not backends.triton_importable(), reason="the Triton router")
def test_smoke_runs_both_recordings_and_the_backward():
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_router_variants.py"), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    shapes = int(re.search(r"(\d+) shapes", run.stdout).group(1))  # the script's SHAPES
    assert sum(1 for r in rows if r.count("|") == 4) == 1 + shapes  # the fwd+bwd table: a header, a row a shape
    recordings = [r for r in rows if "tile |" in r or "sorted runs |" in r]
    assert len(recordings) == 2 * shapes  # each shape, both recordings
    # each shape: exactly one recording is the launcher's
    for i in range(0, 2 * shapes, 2):
        assert [r.split("|")[4].strip() for r in recordings[i : i + 2]].count("yes") == 1, recordings[i : i + 2]
