"""Smoke test of examples/batchwise_thresholds.py (the full run and its results: docs/batchwise.md)."""

import importlib.util
import math
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "batchwise_thresholds.py"


def test_example_runs_and_reports_sane_numbers():
    spec = importlib.util.spec_from_file_location("batchwise_thresholds", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--steps", "40", "--batch", "64", "--seeds", "0", "--eval-batches", "2"])
    r = rows[0]
    for key in ("agreement", "jaccard", "none", "over_k"):
        assert 0.0 <= r[key] <= 1.0, (key, r[key])
    assert r["max_load"] >= 1.0
    assert math.isfinite(r["mse_threshold"]) and math.isfinite(r["mse_batchwise"])
    # 40 steps already move the thresholds well past chance (an all-empty threshold mask would
    # agree on 1 - k/E = 75% of the entries)
    assert r["agreement"] > 0.8, r
