"""Builds the host emulations of the CUDA kernels (python_tests/ops/emulate/*.cpp): each driver
compiled by g++ against csrc/include, where the kernels' shared headers live, warnings as errors."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EMULATE = ROOT / "python_tests" / "ops" / "emulate"


def build(driver: str, out_dir: Path, *, shared: bool) -> Path:
    """Compiles emulate/<driver>.cpp into out_dir: a shared library for ctypes where `shared`, else an
    executable. Returns its path; a failed compile fails the test with the compiler's message."""
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx is not None, "no C++ compiler found"
    out = out_dir / (f"{driver}.so" if shared else driver)
    cmd = [cxx, "-O2", "-std=c++20", *(["-shared", "-fPIC"] if shared else []), "-Wall", "-Wextra", "-Werror"]
    cmd += [f"-I{ROOT / 'csrc' / 'include'}", str(EMULATE / f"{driver}.cpp"), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return out
