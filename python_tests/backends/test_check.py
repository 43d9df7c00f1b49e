"""`python -m moe_kernels.check`: every op of every backend this process has against the reference,
in seconds (what a GPU user runs first; `make gpu-check` runs it on the GPU)."""

import subprocess
import sys

import torch

import moe_kernels
from moe_kernels import backends, check


def test_every_registered_op_is_checked():
    checked = {c.op for c in check.cases()}
    # skip_sample has only the reference: nothing to compare.
    assert set(moe_kernels.backends()) - {"skip_sample"} <= checked


def test_passes_here():
    rows = check.run("cpu")
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    kernels = {"cpu"} if not backends.triton_interpreting() else {"cpu", "triton"}
    assert {r["backend"] for r in rows} <= kernels


def test_a_wrong_kernel_fails(monkeypatch):
    entry = backends._REGISTRY["smooth_step"]
    wrong = entry.__class__(**{**entry.__dict__, "cpu": lambda t, gamma: entry.cpu(t, gamma) * 1.001})
    monkeypatch.setitem(backends._REGISTRY, "smooth_step", wrong)
    rows = check.run("cpu", ["smooth_step"])
    assert rows and not any(r["ok"] for r in rows if r["backend"] == "cpu")
    assert "output 0" in rows[0]["detail"]


def test_command_line():
    run = subprocess.run(
        [sys.executable, "-m", "moe_kernels.check", "--device", "cpu", "--ops", "topk_router", "dispatch"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "topk_router" in run.stdout and "dispatch" in run.stdout and " 0 failed" in run.stdout
    assert torch.__version__ in run.stdout
