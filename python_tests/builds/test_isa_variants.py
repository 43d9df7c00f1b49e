"""The CPU code compiled once per x86-64 instruction set (csrc/cpu/isa.h), built for each one this
machine can run and checked against a scalar specification: the row selections (csrc/cpu/select/:
select.cpp, the candidate filter of candidates.cpp, the top-2 by values of top2_avx512.cpp, the
top eight in registers of top8_avx512.cpp) and the softmax terms and sums (csrc/cpu/score/:
exp_sums.cpp, with exp_terms.cpp's table exp where the variant has AVX-512 F), checked by
python_tests/builds/isa/row_vector_check.cpp; batchwise_mask's sampled-threshold select
(csrc/cpu/select/column_filter.cpp, checked by python_tests/builds/isa/batchwise_filter_check.cpp);
and chosen_linear's blocks (csrc/cpu/linear/chosen_rows.cpp, checked bit for bit by
python_tests/builds/isa/chosen_rows_check.cpp).

The extension compiles them for AVX-512, AVX2 and SSE2 and runs only the variant the CPU supports,
so without this test the others (what an AVX2-only user runs) would never execute here. Each build
takes a few seconds with g++."""

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# g++ on our C++ alone (no torch header): the same on every torch
pytestmark = pytest.mark.torch_free
# (name, driver, the sources it checks under csrc/cpu, the least count of rows or columns a run
# must report checked)
CHECKS = [
    (
        "select",
        "row_vector_check.cpp",
        (
            "select/select.cpp",
            "select/candidates.cpp",
            "select/top2_avx512.cpp",
            "select/top8_avx512.cpp",
            "score/exp_sums.cpp",
            "score/exp_terms.cpp",
        ),
        10000,
    ),
    ("column_filter", "batchwise_filter_check.cpp", ("select/column_filter.cpp",), 2000),
    ("chosen_rows", "chosen_rows_check.cpp", ("linear/chosen_rows.cpp",), 50000),
]

# (name, g++ flags, the /proc/cpuinfo flags the CPU needs to run it)
VARIANTS = [
    ("sse2", ["-march=x86-64"], []),
    ("avx2", ["-march=x86-64", "-mavx2", "-mfma"], ["avx2", "fma"]),
    ("avx512f", ["-march=x86-64", "-mavx512f"], ["avx512f"]),
    # select/top2_avx512.cpp needs AVX-512 BW too (its mask registers joined), and BMI and popcnt
    (
        "avx512bw",
        ["-march=x86-64", "-mavx512f", "-mavx512bw", "-mbmi", "-mpopcnt"],
        ["avx512f", "avx512bw", "bmi1", "popcnt"],
    ),
    # select/top8_avx512.cpp needs VBMI2 too (its byte compress)
    (
        "avx512vbmi2",
        ["-march=x86-64", "-mavx512f", "-mavx512bw", "-mavx512vbmi2", "-mbmi", "-mpopcnt"],
        ["avx512f", "avx512bw", "avx512_vbmi2", "bmi1", "popcnt"],
    ),
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
@pytest.mark.parametrize("check,driver,sources,least", CHECKS, ids=[c[0] for c in CHECKS])
@pytest.mark.parametrize("name,flags,needs", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_per_instruction_set(name, flags, needs, check, driver, sources, least, tmp_path):
    gxx = shutil.which("g++")
    assert gxx, "g++ not found (the extension build needs it too)"
    missing = [f for f in needs if f not in cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    exe = tmp_path / f"{check}_{name}"
    cmd = [
        gxx,
        "-O3",
        "-std=c++20",
        "-DMOE_KERNELS_NO_CLONES",
        *flags,
        f"-I{ROOT / 'csrc' / 'include'}",
        f"-I{ROOT / 'csrc' / 'cpu'}",
        str(ROOT / "python_tests" / "builds" / "isa" / driver),
        *(str(ROOT / "csrc" / "cpu" / source) for source in sources),
        "-o",
        str(exe),
    ]
    build = subprocess.run(cmd, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert int(run.stdout.split()[-1]) > least  # rows or columns checked
