"""bench/gpu_router_bounds.py (the Triton router forward's stages timed on their own on a GPU): its
smoke run on tiny CPU tensors in Triton's interpreter, where each stage's values are checked
against torch (the script exits 1 where one computed something else)."""

import pytest

from moe_kernels import backends

from . import bench_module, smoke_run


@pytest.mark.skipif(not backends.triton_importable(), reason="the Triton router's functions")
def test_smoke_runs_every_stage_of_every_shape():
    stdout = smoke_run("gpu_router_bounds.py")
    assert "computed something else" not in stdout
    bounds = bench_module("gpu_router_bounds")
    rows = [[c.strip() for c in r.split("|")[1:-1]] for r in stdout.splitlines() if r.startswith("| ")]
    stages = [(r[0], r[1], r[2]) for r in rows if r[0] != "shape"]
    want = []
    for name, _E, _k, dtype, kw, _bias in bounds.SHAPES:
        names = [s for s in bounds.STAGES if s != "groups" or kw.get("num_groups", 1) > 1]
        want += [(name, str(dtype)[6:], s) for s in [*names, "op", "goal"]]
    assert stages == want
