"""The benchmarks: their measurement helpers (moe_kernels/bench/timing.py through bench/common.py:
interleaved timing, allocator settings), the plots, the package's command line
(`python -m moe_kernels.bench`, test_cli.py, which also checks that bench/'s scripts call the
package's code), and `make gpu-check` in its smoke form (test_gpu_check.py)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def smoke_run(script: str, interpret: bool = True) -> str:
    """bench/<script> --smoke in a fresh process (TRITON_INTERPRET=1 where `interpret`): its
    stdout, after asserting that it exited 0."""
    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else None
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def bench_module(name: str):
    """bench/<name>.py as a module (bench/ is no package; its scripts import each other by name)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))
