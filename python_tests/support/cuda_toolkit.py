"""nvcc for the tests that compile CUDA sources without a GPU (builds/test_cuda_compile.py,
builds/test_config.py): its path, or the test skips saying nvcc is missing. With
MOE_KERNELS_REQUIRE_NVCC=1 (.ci/run sets it: this project's machines have the CUDA toolkit) a
missing nvcc is a failure instead, so CI cannot lose those checks quietly."""

import os
import shutil
from pathlib import Path

import pytest

REQUIRE_VARIABLE = "MOE_KERNELS_REQUIRE_NVCC"
DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")


def find_nvcc(path: str | None = None, default: Path = DEFAULT_NVCC) -> str | None:
    """The nvcc on PATH (or `path`), else the toolkit's default location, else None."""
    found = shutil.which("nvcc", path=path)
    if found is None and default.exists():
        found = str(default)
    return found


def nvcc(environ=os.environ, path: str | None = None, default: Path = DEFAULT_NVCC) -> str:
    """nvcc's path; pytest.skip (pytest.fail under MOE_KERNELS_REQUIRE_NVCC=1) when there is none."""
    found = find_nvcc(path, default)
    if found is None:
        reason = f"nvcc not found (not on PATH, not at {default}): the CUDA compile checks need the CUDA toolkit"
        if environ.get(REQUIRE_VARIABLE) == "1":
            pytest.fail(f"{reason}; {REQUIRE_VARIABLE}=1 requires it")
        pytest.skip(f"{reason} ({REQUIRE_VARIABLE}=1 makes this a failure)")
    return found
