"""bench/gpu_goals.py: issue 33's goals as gpu_bench's report judges its rows (met, not met, or not
measured), on rows built as gpu_bench writes them."""

import pytest

from python_tests.bench.test_gpu_check import load

gpu_goals = load("gpu_goals")


def row(op, config, *, gbps="", copy="", vs_torch="2.00", vs_compile="2.00", method="graph", backend="triton"):
    return dict(
        op=op, config=config, backend=backend, ms="0.1", gbps=gbps, copy_gbps=copy, vs_torch=vs_torch,
        vs_compile=vs_compile, method=method, kernels="",
    )  # fmt: skip


ROUTER = "qwen3 fwd T=262144 E=128 k=8 bfloat16"
FASTER = "faster than torch eager and compiled"
FWD = ">= 70% of copy, " + FASTER
SOLVER = "faster than the CPU solver, objective equal"
ROWS = "fwd T=16384 d=7168 E=64 k=8 bfloat16"
BA = "n=8192 k=64 float32 randn"
NO_COMPILE = "not measured: no torch.compile ratio"


@pytest.mark.parametrize(
    "case, goal, result",
    [
        (row("topk_router", ROUTER, gbps="3000", copy="4000"), FWD, "met"),
        (row("topk_router", ROUTER, gbps="2700", copy="4000"), FWD, "not met"),
        (row("topk_router", ROUTER, gbps="3000", copy="4000", vs_compile="0.90"), FWD, "not met"),
        (row("topk_router", ROUTER, gbps="3000", copy="4000", vs_torch="0.50", vs_compile=""), FWD, "not met"),
        (row("topk_router", ROUTER, gbps="3000", copy="4000", vs_compile=""), FWD, NO_COMPILE),
        # Below T = 262,144 only the torch ratios hold, whatever the share of copy.
        (row("topk_router", "mixtral fwd T=16384 E=8 k=2 float32", gbps="100", copy="4000"), FASTER, "met"),
        (row("topk_router", "topk_softmax fwd+bwd T=262144 E=64 k=2 bfloat16", gbps="2000", copy="4000"),
         ">= 50% of copy", "met"),
        (row("topk_router", "deepseek-v3 fwd+bwd T=1048576 E=256 k=8 bfloat16", gbps="1900", copy="4000"),
         ">= 50% of copy", "not met"),
        (row("capacity_positions", "T=1048576 E=8 k=8", gbps="2000", copy="4000"), ">= 50% of copy", "met"),
        (row("dispatch", "fwd+bwd " + ROWS[4:], gbps="3100", copy="4000"), ">= 80% of copy", "not met"),
        (row("unpermute", ROWS, gbps="3300", copy="4000"), ">= 80% of copy", "met"),
        (row("batchwise_mask", "T=1048576 E=256 m=2048 bfloat16"), ">= 40% of copy", "not measured: no bytes model"),
        (row("balanced_assignment", BA, vs_torch="1.50", method="loop; objective equal"), SOLVER, "met"),
        (row("balanced_assignment", BA, vs_torch="1.50", method="loop; objective differs by 0.1"), SOLVER, "not met"),
        (row("balanced_assignment", BA, vs_torch="0.33", method="loop; objective equal"), SOLVER, "not met"),
    ],
)  # fmt: skip
def test_verdicts(case, goal, result):
    assert gpu_goals.verdict(case) == (goal, result)


def test_rows_without_a_goal():
    assert gpu_goals.verdict(row("topk_router", "qwen3 fwd+bwd T=65536 E=128 k=8 bfloat16", gbps="1", copy="4")) is None
    assert gpu_goals.verdict(row("smooth_step", "n=4194304 float32", gbps="1", copy="4")) is None
    assert gpu_goals.markdown([row("smooth_step", "n=8 float32")]) == []


def test_report_table_lists_each_judged_row():
    rows = [
        row("combine", ROWS, gbps="3700", copy="4000"),
        row("combine", ROWS, gbps="1300", copy="4000", backend="cuda"),
        row("dselect_k", "B=65536 n=64 k=4 float32", gbps="1", copy="4"),
    ]
    lines = gpu_goals.markdown(rows)
    assert lines[0].strip() == "### Against issue 33's goals"
    assert lines[3:] == [
        "| combine | fwd T=16384 d=7168 E=64 k=8 bfloat16 | triton | 92% | >= 80% of copy | met |",
        "| combine | fwd T=16384 d=7168 E=64 k=8 bfloat16 | cuda | 32% | >= 80% of copy | not met |",
    ]
