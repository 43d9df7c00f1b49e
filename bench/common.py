"""The harness of bench/'s scripts: the package's benchmark code (moe_kernels.bench: timing.py,
output.py), with this folder's settings: results into bench/results/ (MOE_KERNELS_BENCH_RESULTS
overrides), the device from MOE_KERNELS_BENCH_DEVICE (make CUDA=1 bench: cuda), set when this
module is imported so that every script times alike. `python -m moe_kernels.bench` runs the same
benchmarks from an installed package.

Usage in bench/bench_<op>.py (the op's code is moe_kernels/bench/<op>.py):
    from common import main
    main(moe_kernels.bench.<op>)
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path
from types import ModuleType

from moe_kernels.bench import timing
from moe_kernels.bench.timing import _LIBC, measure_interleaved, peak_memory_mb, time_gpu  # noqa: F401 (imported from here)

RESULTS = Path(os.environ.get("MOE_KERNELS_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
timing.set_device(os.environ.get("MOE_KERNELS_BENCH_DEVICE", "cpu"))
DEVICE = timing.DEVICE


def parse_args(parser):
    """parser.parse_args() with the option every benchmark takes: --backend NAME times our ops on
    that backend (MOE_KERNELS_BACKEND for the process; moe_kernels.backends validates it per op,
    so a backend without a kernel of the op, or not for this device, is an error naming the valid
    ones). The baselines call torch or moe_kernels.reference directly and are not affected."""
    parser.add_argument(
        "--backend",
        choices=("cpu", "triton", "cuda", "torch"),
        help="time our ops on this backend (default: the one moe_kernels.backends picks)",
    )
    args = parser.parse_args()
    if args.backend:
        os.environ["MOE_KERNELS_BACKEND"] = args.backend
    return args


def main(bench: ModuleType) -> None:
    """A bench/bench_<op>.py script: `bench` (moe_kernels.bench.<op>) with its flags (--quick, the
    op's own from its add_arguments, --backend), the torch.compile baselines, results into RESULTS."""
    parser = argparse.ArgumentParser(description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=bench.QUICK)
    if hasattr(bench, "add_arguments"):
        bench.add_arguments(parser)
    args = parse_args(parser)
    args.out, args.compile, args.command = RESULTS, True, None
    bench.run(args)


@contextlib.contextmanager
def environment(name: str, value: str):
    """os.environ[name] = value inside the block, and as it was after it: the variables the C++
    glue reads at each call (MOE_KERNELS_CAPACITY_PATH, MOE_KERNELS_SOLVER_EPS_DIV, ...)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
