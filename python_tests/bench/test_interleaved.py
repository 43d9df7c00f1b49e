"""measure_interleaved (moe_kernels/bench/timing.py, as bench/common.py gives it), in a subprocess
(importing common sets process-wide allocator options): every provider gets a row, in order, with
its own bytes and peak memory; the timed calls alternate between providers round by round rather
than running one provider's calls back to back."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from common import measure_interleaved

calls = []
def provider(name):
    def fn():
        calls.append(name)
        return torch.ones(1024)
    return fn

rows = measure_interleaved(
    "op", {"a": provider("a"), "b": provider("b"), "c": provider("c")}, config={"T": 4},
    bytes_moved={"a": 4000, "c": 8000}, memory=["b"], rounds=3, warmup=1, reps=6, min_time=0.0,
)
print(json.dumps({"rows": rows, "calls": calls}))
"""


def test_measure_interleaved():
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "bench")], capture_output=True, text=True, check=True
    )
    out = json.loads(run.stdout.strip().splitlines()[-1])
    rows, calls = out["rows"], out["calls"]
    assert [r["provider"] for r in rows] == ["a", "b", "c"]
    assert all(r["config"] == "T=4" and r["mode"] == "forward" and r["median_ms"] > 0 for r in rows)
    assert rows[0]["gb_per_s"] != "" and rows[1]["gb_per_s"] == "" and rows[2]["gb_per_s"] != ""
    assert rows[0]["peak_mb"] == "" and rows[1]["peak_mb"] != "" and rows[2]["peak_mb"] == ""
    # After the peak-memory call (b) and one warm-up call each: 3 rounds of 2 timed calls each.
    timed = calls[1 + 3 :]
    assert timed == ["a", "a", "b", "b", "c", "c"] * 3
