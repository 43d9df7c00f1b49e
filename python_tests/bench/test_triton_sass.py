"""bench/triton_sass.py: the router, routing-map and batchwise_mask kernels' static SASS counts,
compiled ahead of time as a GPU launch specialises them (no GPU needed; the disassembler Triton
ships)."""

import subprocess
import sys
from pathlib import Path

import pytest

from moe_kernels import backends

from . import bench_module

ROOT = Path(__file__).resolve().parents[2]

compiles = pytest.mark.skipif(
    backends.triton_interpreting() or not backends.triton_importable(),
    reason="compiles ahead of time: needs triton without TRITON_INTERPRET",
)


ARGS = ["--cases", "mixtral", "qwen3", "qwen3-fp32", "e64-k8", "--maps", "8", "--batchwise", "bf16"]
# The most block barriers a router forward's hot path may hold (under triton 3.6, 3.7 and 3.9): none
# in its rounds. They are: with k a compile-time constant as the count compiles it, the first
# pick's store through shared memory; float32 logits' flag of near ties, a maximum across the
# program's warps, and the barrier in place of the near-ties pass. Triton 3.6 took each pick's
# store through shared memory, two barriers a pick, until store_pick's addresses ran on along the
# row: 16 at Qwen3-MoE, 20 in float32; triton 3.7 and 3.9 took the [k, rows] choice tile's sums and
# stores through shared memory at E = 64 (13 and 15), until topk_router.choice_rows.
FORWARD_BARRIERS = {"mixtral": 2, "qwen3": 2, "qwen3-fp32": 6, "e64-k8": 2}
# The backward's one barrier (its choices' stores after the row's) at E = 64, k = 8, where the
# [k, rows] choice tile took 24 under triton 3.7 and 25 under 3.9.
BACKWARD_BARRIERS = {"e64-k8": 1}


@compiles
def test_counts_the_router_kernels():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "triton_sass.py"), *ARGS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = [
        line.split("|")[1:-1]
        for line in run.stdout.splitlines()
        if line.startswith("| forward") or line.startswith("| backward")
    ]
    assert len(rows) == 8
    for kernel, case, per_program, warps, block_t, per_row, _shfl, _redux, bars, _mufu in rows:
        assert int(per_program) > 50, (kernel, case, per_program)  # a real kernel body, not an empty listing
        assert abs(float(per_row) - int(per_program) * int(warps) / int(block_t)) < 1
        if kernel.strip() == "forward":
            assert int(bars) <= FORWARD_BARRIERS[case.strip()], (case, bars)
        elif case.strip() in BACKWARD_BARRIERS:
            assert int(bars) <= BACKWARD_BARRIERS[case.strip()], (case, bars)
    maps = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| packed_")]
    assert [m[0].strip() for m in maps] == ["packed_counts_kernel", "packed_positions_kernel"]  # E = 8
    assert all(int(m[2]) > 50 for m in maps)
    # The positions' gather of the counts before each segment in the tile's own layout: one barrier
    # (capacity_positions.gather_transposed; laid out last axis first, triton 3.7 took 9).
    assert int(maps[1][6]) <= 1, maps[1]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| ")]
    batchwise = {row[0].strip(): row for row in rows if len(row) == 6}
    for kernel in ("chosen_words_kernel", "gather_candidates_kernel", "digit_histogram_kernel", "write_mask_kernel"):
        name, dtype, per_program, warps, unit, per_unit = batchwise[kernel]
        assert dtype.strip() == "bf16" and int(per_program) > 50 and float(per_unit) > 0, batchwise[kernel]
    # Each score's bit or-ed into its thread's word, no sum across lanes or warps: 0.06 under triton
    # 3.6, 3.7 and 3.9, where 3.6 summed a [rows, words, columns] tile through shared memory (0.13).
    assert float(batchwise["chosen_words_kernel"][5]) < 0.1, batchwise["chosen_words_kernel"]


def _triton_sass():
    return bench_module("triton_sass")


@pytest.mark.skipif(not backends.triton_importable(), reason="bench/triton_sass.py imports triton")
def test_hot_path_stops_at_the_last_exit():
    triton_sass = _triton_sass()
    listing = "\n".join(
        [
            "Function:topk_router_kernel",
            "--:-:0:-:1\tMOV R1, c[0x0][0x28];",
            "--:-:-:Y:4\t@!P0 EXIT;",
            ".L_x_0:",
            "--:-:-:-:1\tSHFL.BFLY PT, R0, R1, 0x1, 0x1f;",
            "--:-:-:Y:5\tEXIT;",
            "--:-:-:Y:0\tFFMA R2, R3, R4, R5;",
        ]
    )
    counts = triton_sass.hot_path(listing)
    assert counts == {"MOV": 1, "EXIT": 2, "SHFL": 1}


@pytest.mark.skipif(not backends.triton_importable(), reason="bench/triton_sass.py imports triton")
def test_hot_path_counts_a_loop_body_once_a_trip():
    """A branch back to a label above it is a loop: its body (the label to the branch) counts
    `trips` times; a forward branch, and the code after the last EXIT, do not count again."""
    triton_sass = _triton_sass()
    listing = "\n".join(
        [
            "--:-:0:-:1\tMOV R1, c[0x0][0x28];",
            "LBB0:",
            "--:-:-:-:1\tREDUX.MAX.S32 UR4, R2;",
            "--:-:-:-:1\tISETP.NE.AND P0, PT, R3, RZ, PT;",
            "--:-:-:-:5\t@P0 BRA LBB1;",
            "--:-:-:-:1\tSEL R2, R2, 0x80000001, P1;",
            "LBB1:",
            "--:-:-:-:5\t@P2 BRA LBB0;",
            "--:-:-:Y:5\tEXIT;",
            "LBB2:",
            "--:-:-:Y:0\tBRA LBB2;",
        ]
    )
    assert triton_sass.hot_path(listing) == {"MOV": 1, "REDUX": 1, "ISETP": 1, "BRA": 2, "SEL": 1, "EXIT": 1}
    assert triton_sass.hot_path(listing, trips=7) == {"MOV": 1, "REDUX": 7, "ISETP": 7, "BRA": 14, "SEL": 7, "EXIT": 1}


def _counted_loop(init, steps, compare, branch="@P5 BRA LBB0;", before_loop=()):
    """A listing: `init` sets R17, then a loop whose body is a REDUX, the `steps` and the `compare`
    (in that order unless the compare comes first in `steps`), closed by `branch`."""
    return "\n".join(
        [
            f"--:-:0:-:1\t{init}",
            *before_loop,
            "LBB0:",
            "--:-:-:-:1\tREDUX.MAX.S32 UR4, R2;",
            *(f"--:-:-:-:1\t{line}" for line in (*steps, compare)),
            f"--:-:-:-:5\t{branch}",
            "--:-:-:Y:5\tEXIT;",
        ]
    )


@pytest.mark.skipif(not backends.triton_importable(), reason="bench/triton_sass.py imports triton")
def test_hot_path_reads_how_often_an_unrolled_loop_runs():
    """At k = 16 the compiler peels picks and runs several a trip: the loop's counter (its value
    before the loop, its step and its bound in the body) says how often it runs, not `trips`."""
    triton_sass = _triton_sass()

    def redux(init, steps, compare, trips=15, **kw):
        return triton_sass.hot_path(_counted_loop(init, steps, compare, **kw), trips=trips)["REDUX"]

    ne = "ISETP.NE.U32.AND P5, PT, R17, {}, PT;"
    step = ["VIADD R17, R17, 0x1;"]
    # 3 - 2^31 up to 17 - 2^31 by 7: two trips (the k = 16 forward's 14 picks after 2 peeled, when
    # its counter was the retired key RETIRED + s of the ranks in the keys).
    counts = triton_sass.hot_path(
        _counted_loop("IMAD.MOV.U32 R17, RZ, RZ, -0x7ffffffd;", ["VIADD R17, R17, 0x7;"], ne.format("-0x7fffffef")),
        trips=15,
    )
    assert counts == {"IMAD": 1, "REDUX": 2, "VIADD": 2, "ISETP": 2, "BRA": 2, "EXIT": 1}
    # Other inits and steps: MOV, CS2R, IADD3, a step in two parts, a step printed unsigned (-7),
    # counting down to RZ.
    assert redux("MOV R17, 0x0;", ["IADD3 R17, R17, 0x2, RZ;"], ne.format("0x8")) == 4
    assert redux("CS2R R16, SRZ;", ["VIADD R17, R17, 0x1;", "VIADD R17, R17, 0x1;"], ne.format("0x8")) == 4
    assert redux("MOV R17, 0xe;", ["VIADD R17, R17, 0xfffffff9;"], ne.format("RZ")) == 2
    # The last write before the loop decides: here CS2R's zero pair over an earlier MOV.
    assert redux("MOV R17, 0x3;", step, ne.format("0x4"), before_loop=["--:-:-:-:1\tCS2R R16, SRZ;"]) == 4
    # The compare before the step sees the bound one trip later; `@!P` after an ISETP.EQ.
    assert redux("MOV R17, 0x0;", [ne.format("0x4"), "VIADD R17, R17, 0x1;"], "NOP;", branch="@P5 BRA LBB0;") == 5
    eq = "ISETP.EQ.U32.AND P5, PT, R17, 0x4, PT;"
    assert redux("MOV R17, 0x0;", ["VIADD R17, R17, 0x1;"], eq, branch="@!P5 BRA LBB0;") == 4


@pytest.mark.skipif(not backends.triton_importable(), reason="bench/triton_sass.py imports triton")
def test_hot_path_keeps_trips_where_the_counter_cannot_be_read():
    """Counted `trips` times (with a note): a bound in a register, a step that does not reach the
    bound, a count past `trips` (the counter wrapping), a second predicate in the exit, a counter
    also written another way, an init behind a label or overwritten by a 64-bit result; a loop
    counts once with trips = 1."""
    triton_sass = _triton_sass()

    def redux(init, steps, compare, trips=9, **kw):
        return triton_sass.hot_path(_counted_loop(init, steps, compare, **kw), trips=trips)["REDUX"]

    step = ["VIADD R17, R17, 0x1;"]
    ne = "ISETP.NE.U32.AND P5, PT, R17, {}, PT;"
    assert redux("MOV R17, 0x0;", step, ne.format("R3")) == 9
    assert redux("MOV R17, 0x0;", ["VIADD R17, R17, 0x3;"], ne.format("0x4")) == 9
    assert redux("MOV R17, 0x10;", step, ne.format("0x4")) == 9  # 2^32 - 12 trips: not a count of picks
    assert redux("MOV R17, 0x0;", step, "ISETP.NE.U32.AND P5, PT, R17, 0x4, P0;") == 9
    assert redux("MOV R17, 0x0;", [*step, "IMAD R17, R17, R3, RZ;"], ne.format("0x4")) == 9
    assert redux("MOV R17, 0x0;", step, ne.format("0x4"), before_loop=["LBB9:", "--:-:-:-:1\tNOP;"]) == 9
    assert redux("MOV R17, 0x0;", step, ne.format("0x4"), before_loop=["--:-:-:-:1\tIMAD.WIDE R16, R2, 0x4, RZ;"]) == 9
    assert triton_sass.hot_path(_counted_loop("MOV R17, 0x0;", step, ne.format("0x4")))["REDUX"] == 1


@pytest.mark.skipif(not backends.triton_importable(), reason="bench/triton_sass.py imports triton")
def test_hot_path_stops_at_an_exit_with_a_modifier():
    triton_sass = _triton_sass()
    listing = "\n".join(["--:-:0:-:1\tMOV R1, c[0x0][0x28];", "--:-:-:Y:5\tEXIT.KEEPREFCOUNT;", "--:-:-:-:1\tNOP;"])
    assert triton_sass.hot_path(listing) == {"MOV": 1, "EXIT": 1}
