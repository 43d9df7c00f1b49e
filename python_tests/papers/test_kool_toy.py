"""Smoke test of examples/kool_toy.py (the full run is a documented command: docs/kool_toy.md):
a few hundred steps must reduce the MSE well below the initial one, with REINFORCE and with
differentiable gating; the results file is resumed and summarised."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "examples" / "kool_toy.py"
spec = importlib.util.spec_from_file_location("kool_toy", PATH)
kool_toy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kool_toy)


@pytest.mark.parametrize(
    "estimator,loss",
    [("sample_skip_iw", "reinforce"), ("gumbel_matching_iw", "reinforce"), ("sample", "gating")],
)
def test_toy_trains(estimator, loss):
    x, y = kool_toy.make_data(0)
    initial = kool_toy.ToyMoE(0).test_mse(x, y, gated=loss == "gating")
    final = kool_toy.train(estimator, 1.0, seed=0, steps=300, loss=loss)
    assert math.isfinite(final) and final < 0.5 * initial, (initial, final)


def test_bad_loss():
    with pytest.raises(ValueError, match="loss must be one of"):
        kool_toy.train("sample", 1.0, seed=0, steps=1, loss="nope")


def test_results_file_resume_and_summary(tmp_path, monkeypatch, capsys):
    out = tmp_path / "runs.jsonl"
    argv = ["kool_toy.py", "--steps", "3", "--taus", "1", "--estimators", "sample", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv + ["--seeds", "2"])
    kool_toy.main()
    first = out.read_text().splitlines()
    monkeypatch.setattr(sys, "argv", argv + ["--seeds", "3"])
    kool_toy.main()
    lines = out.read_text().splitlines()
    assert lines[:2] == first and [json.loads(line)["seed"] for line in lines] == [0, 1, 2]
    monkeypatch.setattr(sys, "argv", ["kool_toy.py", "--summarize", str(out)])
    capsys.readouterr()
    kool_toy.main()
    assert "| reinforce | sample | no | 1 | 0-2 | " in capsys.readouterr().out
