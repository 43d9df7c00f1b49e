"""Smoke test of examples/aux_loss_free.py (the full run is documented in docs/aux_loss_free.md)."""

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "aux_loss_free.py"


def test_quick_run(tmp_path):
    out = tmp_path / "runs.jsonl"
    text = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--out", str(out)], check=True, capture_output=True, text=True
    ).stdout
    assert "| aux_free |" in text and "| switch |" in text and "| none |" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["config"] for r in rows} == {"none", "switch", "aux_free"}
    assert all(0 <= r["dropped_fraction"] <= 1 and r["max_mean_load"] >= 1 for r in rows)
