"""bench/gpu_capacity_variants.py (capacity_positions' CUDA paths timed on a GPU): its smoke run on
tiny CPU tensors, the Triton op in Triton's interpreter against the reference, and a row for the
launcher's choice and each forced path at every shape (on a GPU a path the shape does not fit
raises, and its row is left out)."""

from pathlib import Path

import pytest

from moe_kernels import backends

from . import smoke_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not backends.triton_importable(), reason="the Triton op")
def test_smoke_lists_every_path():
    stdout = smoke_run("gpu_capacity_variants.py")
    rows = [r.split("|")[1:-1] for r in stdout.splitlines() if r.startswith("| ") and "---" not in r]
    rows = [[c.strip() for c in r] for r in rows[1:]]  # past the header
    shapes = {(r[0], r[1], r[2]) for r in rows}
    assert len(shapes) == 4
    for shape in shapes:
        paths = [r[3] for r in rows if (r[0], r[1], r[2]) == shape]
        assert paths == ["Triton", "default", "strided, match", "strided, ballots", "tiles, ballots", "tiles, match"], (
            paths
        )
