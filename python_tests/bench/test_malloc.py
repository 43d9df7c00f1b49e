"""The benchmarks' allocator settings (moe_kernels/bench/timing.py, set by importing bench/common.py),
in a subprocess (they are process-wide): under steady_malloc a call that allocates and fills a
4 MiB or a 64 MiB tensor runs without page faults once warm; peak_memory_mb still sees that tensor
on a warm heap, and restores the steady state."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import resource, sys
sys.path.insert(0, sys.argv[1])
import torch
from common import _LIBC, peak_memory_mb

if _LIBC is None:
    print("SKIP")
    raise SystemExit

def call(numel=1 << 20):
    return torch.empty(numel).fill_(1.0)  # 4 MiB, every page written

def big():
    return call(1 << 24)  # 64 MiB: above glibc's largest mmap threshold

def faults(n, fn=call, warm=10):
    # glibc grows the heap over the first few calls (about eight here) before it recycles it.
    for _ in range(warm):
        fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

steady = faults(20)
steady_big = faults(5, big, warm=3)
peak = peak_memory_mb(call)  # on a warm heap: the tensor's pages are resident unless trimmed
after = faults(20)
print(steady, peak, after, steady_big)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc/self/status are Linux")
def test_steady_malloc_and_peak_memory():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT / "bench")], capture_output=True, text=True, check=True
    ).stdout.split()
    if out == ["SKIP"]:
        pytest.skip("not glibc")
    steady, peak, after, steady_big = int(out[0]), float(out[1]), int(out[2]), int(out[3])
    # 20 calls of a fresh 4 MiB mapping each (a fixed 128 KiB mmap threshold) fault ~20 * 1024
    # pages; the steady state recycles the heap.
    assert steady < 200, f"{steady} minor faults in 20 warm calls"
    assert after < 200, f"{after} minor faults after peak_memory_mb (settings not restored)"
    # A fresh 64 MiB mapping per call would fault 5 * 16384 pages.
    assert steady_big < 500, f"{steady_big} minor faults in 5 warm calls of 64 MiB"
    assert 3.5 <= peak < 16, f"peak_memory_mb saw {peak} MiB for a 4 MiB tensor"
