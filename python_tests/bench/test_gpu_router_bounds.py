"""bench/gpu_router_bounds.py (the Triton router forward's stages timed on their own on a GPU): its
smoke run on tiny CPU tensors in Triton's interpreter, where each stage's values are checked
against torch (the script exits 1 where one computed something else), and its kernel compiled for
sm_90 as a GPU run launches it (`make test-aot-gpu-triton` also runs that with the GPU machines'
triton)."""

import re

import pytest

from moe_kernels import backends

from ..builds.test_triton_aot import ptxas_report
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


def _entries():
    if backends.triton_interpreting() or not backends.triton_importable():
        return []
    return bench_module("gpu_router_bounds").aot_entries()


@pytest.mark.skipif(
    backends.triton_interpreting() or not backends.triton_importable(),
    reason="AOT compile needs triton without TRITON_INTERPRET",
)
@pytest.mark.parametrize("entry", _entries(), ids=lambda e: f"E{e[2]['BLOCK_E']}-{e[1]['logits_ptr'][1:]}")
def test_stages_compile_for_sm90_without_spills(entry, tmp_path):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel, signature, constexprs, options = entry
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    report = ptxas_report(compiled.asm["ptx"], 90, tmp_path)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, f"register spills:\n{report}"
