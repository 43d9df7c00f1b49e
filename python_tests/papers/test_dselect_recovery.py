"""Smoke test of examples/dselect_recovery.py (Appendix C.2.2); the full run is documented in
docs/dselect_k.md. Checks the pipeline end to end on tiny data, not the paper's numbers."""

import importlib.util
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dselect_recovery.py"


def load():
    spec = importlib.util.spec_from_file_location("dselect_recovery", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_data_generating_moe():
    example = load()
    h, y, true, head_w = example.make_problem(0, 2000)
    assert h.shape == (2000, 16, 4) and y.shape == (2000,) and len(true) == 4
    assert 0.2 < y.mean() < 0.8  # the sign labels are not degenerate
    # the true experts, averaged through the head, reproduce the labels exactly
    assert torch.equal(((h[:, true].mean(1) @ head_w) > 0).float(), y)


def test_smoke_run():
    results = load().main(["--smoke"])
    for kind in ("topk", "dselect"):
        (run,) = results[kind]["runs"]
        assert 0 <= run["recovered"] <= 4 and 0.0 <= run["val_acc"] <= 1.0
        assert len(run["chosen"]) <= 4
