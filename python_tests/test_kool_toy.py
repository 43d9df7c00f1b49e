"""Smoke test of examples/kool_toy.py (the full run is a documented command: docs/kool_toy.md):
a few hundred steps of two estimators must reduce the test MSE well below the initial one."""

import importlib.util
import math
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "examples" / "kool_toy.py"
spec = importlib.util.spec_from_file_location("kool_toy", PATH)
kool_toy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kool_toy)


@pytest.mark.parametrize("estimator", ["sample_skip_iw", "gumbel_matching_iw"])
def test_toy_trains(estimator):
    x, y = kool_toy.make_data(0)
    initial = kool_toy.ToyMoE(0).test_mse(x, y)
    final = kool_toy.train(estimator, 1.0, seed=0, steps=300)
    assert math.isfinite(final) and final < 0.5 * initial, (initial, final)
