"""The CPU row selections (csrc/cpu/row_vector.cpp) built for each x86-64 instruction set this
machine can run and checked against a scalar specification (python_tests/isa/row_vector_check.cpp).

The extension compiles them as target clones (AVX-512, AVX2, SSE2) and runs only the one the CPU
supports, so without this test the other variants (what an AVX2-only user runs) would never
execute here. Each build takes a few seconds with g++."""

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "python_tests" / "isa" / "row_vector_check.cpp"

# (name, g++ flags, the /proc/cpuinfo flags the CPU needs to run it)
VARIANTS = [
    ("sse2", ["-march=x86-64"], []),
    ("avx2", ["-march=x86-64", "-mavx2", "-mfma"], ["avx2", "fma"]),
    ("avx512f", ["-march=x86-64", "-mavx512f"], ["avx512f"]),
]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the clones are x86-64 only")
@pytest.mark.parametrize("name,flags,needs", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_row_selections_per_instruction_set(name, flags, needs, tmp_path):
    gxx = shutil.which("g++")
    assert gxx, "g++ not found (the extension build needs it too)"
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    exe = tmp_path / f"row_vector_{name}"
    cmd = [
        gxx,
        "-O3",
        "-std=c++20",
        "-DMOE_KERNELS_NO_CLONES",
        *flags,
        f"-I{ROOT / 'csrc' / 'include'}",
        f"-I{ROOT / 'csrc' / 'cpu'}",
        str(DRIVER),
        str(ROOT / "csrc" / "cpu" / "row_vector.cpp"),
        "-o",
        str(exe),
    ]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) > 10000  # rows checked
