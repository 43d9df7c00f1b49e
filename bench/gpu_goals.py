"""Issue 33's GPU speed goals as code: which goal a row of bench/gpu_bench.py names and whether the
row meets it, so a GPU run's report says so itself (gpu_bench's markdown, "Against issue 33's
goals"). The goals, each a ratio measured in the same run:

| op | rows | goal |
|---|---|---|
| topk_router forward | every T | faster than the torch sequence eager and compiled |
| topk_router forward | T >= 262,144 | also >= 70% of copy |
| topk_router fwd+bwd | T >= 262,144 | >= 50% of copy |
| capacity_positions | all | >= 50% of copy |
| dispatch, combine, permute, unpermute | fwd and fwd+bwd | >= 80% of copy |
| batchwise_mask | all | >= 40% of copy |
| balanced_assignment | all | faster than the CPU solver (vs_torch > 1), objective equal |

Rows of other ops (the gate math) and fwd+bwd routers below T = 262,144 name no goal.
"""

from __future__ import annotations

import re

ROUTER_T = 262144  # the router goals hold from this many tokens
SHARE = {
    "capacity_positions": 0.50,
    "dispatch": 0.80,
    "combine": 0.80,
    "permute": 0.80,
    "unpermute": 0.80,
    "batchwise_mask": 0.40,
}


def share_of_copy(row: dict) -> float | None:
    """gbps over copy_gbps, None where the row has no bytes model."""
    if not row.get("gbps") or not row.get("copy_gbps"):
        return None
    return float(row["gbps"]) / float(row["copy_gbps"])


def share_text(row: dict) -> str:
    """share_of_copy as the reports print it: "92%", or "-" without a bytes model."""
    share = share_of_copy(row)
    return "-" if share is None else f"{share:.0%}"


def verdict(row: dict) -> tuple[str, str] | None:
    """(the goal, "met" / "not met" / "not measured: ...") of a gpu_bench row (its CSV columns as
    strings), or None where issue 33 sets no goal for the row."""
    op, config = row["op"], row["config"]
    share = share_of_copy(row)
    if op == "balanced_assignment":
        goal = "faster than the CPU solver, objective equal"
        met = float(row["vs_torch"]) > 1 and "objective equal" in row["method"]
        return goal, "met" if met else "not met"
    if op == "topk_router":
        tokens = re.search(r"\bT=(\d+)", config)
        large = tokens is not None and int(tokens.group(1)) >= ROUTER_T
        if " fwd+bwd " in f" {config} ":
            return (">= 50% of copy", _share_verdict(share, 0.50)) if large else None
        goal = "faster than torch eager and compiled"
        results = [_faster(row)]
        if large:
            goal = ">= 70% of copy, " + goal
            results.insert(0, _share_verdict(share, 0.70))
        # Not met where any part is not; else not measured where any part is not.
        if "not met" in results:
            return goal, "not met"
        return goal, next((r for r in results if r != "met"), "met")
    if op in SHARE:
        return f">= {SHARE[op]:.0%} of copy", _share_verdict(share, SHARE[op])
    return None


def _faster(row: dict) -> str:
    """Whether ours beats the torch sequence eager and under torch.compile."""
    if float(row["vs_torch"]) <= 1:
        return "not met"
    if not row.get("vs_compile"):
        return "not measured: no torch.compile ratio"
    return "met" if float(row["vs_compile"]) > 1 else "not met"


def _share_verdict(share: float | None, goal: float) -> str:
    if share is None:
        return "not measured: no bytes model"
    return "met" if share >= goal else "not met"


def markdown(rows: list[dict]) -> list[str]:
    """The report's lines on the goals: one table row per benchmark row that names a goal."""
    judged = [(r, verdict(r)) for r in rows]
    judged = [(r, v) for r, v in judged if v is not None]
    if not judged:
        return []
    lines = [
        "\n### Against issue 33's goals\n",
        "| op | config | backend | of copy | goal | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r, (goal, result) in judged:
        lines.append(f"| {r['op']} | {r['config']} | {r['backend']} | {share_text(r)} | {goal} | {result} |")
    return lines
