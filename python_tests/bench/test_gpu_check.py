"""`make gpu-check` (bench/gpu_check.py, bench/gpu_bench.py) in its smoke form: here, without a GPU, its
test step runs and skips the GPU cases with their reason, its benchmarks are skipped, and its report
says so; the benchmark cases' inputs and signatures hold together on tiny CPU tensors. The build
step is left out (it rebuilds the extension: minutes on this machine's cores); gpu-check's own run
on a GPU machine is what builds."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--out",
            str(out),
            "--skip-build",
            "--groups",
            "2",
            "--files",
            "python_tests/backends/test_device_axis.py",
            "python_tests/ops/test_smooth_step.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = (out / "report.md").read_text()
    assert "| check |" in report and "| tests |" in report and "| benchmarks |" in report, report
    assert "0 failed" in (out / "check.log").read_text()
    logs = "".join(p.read_text() for p in out.glob("tests-*.log"))
    import torch

    if torch.cuda.is_available():
        assert run.returncode == 0, run.stdout + run.stderr
        return
    # No GPU: every GPU case skipped with its reason, none failed, the benchmarks skipped.
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failed" in report and "skipped" in report
    assert "no CUDA device" in logs
    assert "| benchmarks | skipped | 0 | no GPU |" in report


def test_groups_split_heavy_files_by_function():
    gpu_check = load("gpu_check")
    files = gpu_check.test_files()
    groups = gpu_check.split(files, 4)
    units = [u for g in groups for u in g]
    assert len(units) == len(set(units))
    fuzz = [u for u in units if u.startswith("python_tests/ops/test_fuzz.py::")]
    assert len(fuzz) >= 8, "the fuzz file goes to the groups test by test"
    assert all(any(u.startswith("python_tests/ops/test_fuzz.py") for u in g) for g in groups)
    whole = {u for u in units if "::" not in u}
    assert {str(p.relative_to(ROOT)) for p in files if gpu_check.under_tests(p) not in gpu_check.SPLIT} <= whole
    assert all((gpu_check.TESTS / name).is_file() for name in gpu_check.HEAVY + gpu_check.SPLIT)


def test_junit_counts(tmp_path):
    gpu_check = load("gpu_check")
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="boom&#10;more">tb</failure></testcase>'
        '<testcase classname="a" name="skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    counts, failures = gpu_check.junit_counts(xml)
    assert counts == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1}
    assert failures == [("a::bad", "boom")]
    empty = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    assert gpu_check.junit_counts(tmp_path / "missing.xml") == (empty, [])


def test_bench_smoke():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "--smoke"], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "cases ran once on CPU tensors" in run.stdout


def test_device_slug():
    gpu_check = load("gpu_check")
    assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_check.device_slug("") == "gpu"


@pytest.mark.parametrize("origin", ["default", "given"])
def test_make_gpu_check_uses_the_given_python(origin):
    cmd = ["make", "-n", "--no-print-directory", "gpu-check"] + (["PY=/opt/x/python3"] if origin == "given" else [])
    # Not the make this suite may run under (make test-installed): its variables are not the user's.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PY", "MAX_JOBS")}
    dry = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env).stdout
    python = "/opt/x/python3" if origin == "given" else "python3"
    assert f"{python} bench/gpu_check.py" in dry
    assert ".venv" not in dry and "pip" not in dry, "gpu-check creates no venv and installs nothing"
