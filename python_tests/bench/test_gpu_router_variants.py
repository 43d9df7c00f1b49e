"""bench/gpu_router_variants.py (the router's pick recordings, launch tiles and row tiles a program
timed on a GPU): its smoke run on tiny CPU tensors in Triton's interpreter, where it checks that
every variant picks the same experts."""

import re

import pytest
import torch

from moe_kernels import backends

from . import bench_module, smoke_run


@pytest.mark.skipif(not backends.triton_importable(), reason="the Triton router")
def test_smoke_runs_both_recordings_the_tiles_and_the_backward():
    stdout = smoke_run("gpu_router_variants.py")
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    shapes = int(re.search(r"(\d+) shapes", stdout).group(1))  # the script's SHAPES
    assert sum(1 for r in rows if r.count("|") == 4) == 1 + shapes  # the fwd+bwd table: a header, a row a shape
    recordings = [r for r in rows if "tile |" in r or "sorted runs |" in r]
    assert len(recordings) == 2 * shapes  # each shape, both recordings
    # each shape: exactly one recording is the launcher's
    for i in range(0, 2 * shapes, 2):
        assert [r.split("|")[4].strip() for r in recordings[i : i + 2]].count("yes") == 1, recordings[i : i + 2]
    # the launch tiles: each of their shapes at three tiles, the launcher's first, more rows a program after
    tiles = [r.split("|") for r in rows if r.count("|") == 7 and "rows a program" not in r]
    assert len(tiles) == 3 * 5 and all(t[1].strip() in ("qwen3", "deepseek-v3", "e64-k2", "e128-k4") for t in tiles)
    for i in range(0, len(tiles), 3):
        programs = [int(t[3]) for t in tiles[i : i + 3]]  # rows a program, capped by T = 16 here
        assert programs == sorted(programs), tiles[i : i + 3]
    # the row tiles a program, the forward's and then the backward's: the same shapes at 1, 2 and 4,
    # the launcher's (1) first
    multi = [r.split("|") for r in rows if r.count("|") == 6 and "tiles a program" not in r]
    assert [int(m[3]) for m in multi] == [1, 2, 4] * 10, multi
    assert [m[1].strip() for m in multi] == [t[1].strip() for t in tiles] * 2
    assert "| shape | dtype | backward's tiles a program | fwd+bwd ms | of copy_ |" in stdout


def test_a_disagreement_is_reported_not_raised():
    """Where the recordings differ the script lists it under its tables (the device call's timings
    kept) and main() returns 1."""
    variants = bench_module("gpu_router_variants")
    w, e = torch.tensor([[0.6, 0.4], [0.7, 0.3]]), torch.tensor([[3, 1], [0, 2]])
    assert variants._difference((w, e), (w.clone(), e.clone())) == ""
    other = e.clone()
    other[1, 1] = 5
    assert (
        variants._difference((w, e), (w, other))
        == "1 rows pick other experts (row 1: [0, 2] by the tile, [0, 5] by the runs)"
    )
    assert "weights apart by up to 0.01" in variants._difference((w, e), (w + 0.01, e))
    g = torch.randn(2, 8)
    assert variants._difference((w, e, g), (w, e, g.clone())) == ""
    assert "gradients apart by up to" in variants._difference((w, e, g), (w, e, g + 1e-6))
