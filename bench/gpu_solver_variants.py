"""The CUDA balanced_assignment solver at several auction epsilons, on a GPU (issue 33).

The solver (csrc/cuda/balanced_assignment.cu, docs/balanced_assignment.md) warm-starts with a
Jacobi auction at eps = spread / divisor, then cancels cycles until the assignment is optimal: a
larger divisor takes more bidding iterations (each the latency of a few block-wide steps) and
fewer passes (each a move-cost reduction over k blocks and a Floyd-Warshall over k + 1 nodes). The
solve is exact at every divisor; the host emulation counts, at bench/gpu_bench.py's seeds:

    (n, k)        divisor:  512   4096   32768 (default)  262144
    (8192, 64)    iters     221    384     904             1666    passes  9  2  2  1
    (16384, 128)  iters     996   1612    2563             6027    passes 28  8  2  1

What an iteration and a pass cost on a GPU decides the divisor: this times the solve at each of
DIVISORS (forced by MOE_KERNELS_SOLVER_EPS_DIV), and the CPU solver on the same machine, at
gpu_bench's shapes. Each row: the solve's time (eager calls between two events: it reads its done
flag on the host, so no CUDA graph), the CPU solver's time over it, whether the objective equals
the CPU solver's (each is exactly optimal), and from one more solve with MOE_KERNELS_SOLVER_PROFILE=1
(csrc/cuda_ops.cpp's line on stderr, read here) its bidding iterations and passes and where its
device time went: the auction kernel (of it the iterations' bids and their taking), the passes'
cancel_cycles kernels and their move_costs kernels (the leader thread's clock, at the device's
clock rate). A divisor whose objective differs is listed under the table (and the exit status is
1). Each line is printed as it comes.

    python3 bench/gpu_solver_variants.py [--out FILE.md]
    python3 bench/gpu_solver_variants.py --smoke   # the CPU solver on a small shape, no device rows
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants  # noqa: E402
from common import environment, time_gpu  # noqa: E402
from variants import Lines  # noqa: E402

import moe_kernels  # noqa: E402
from moe_kernels import ops as K  # noqa: E402
from moe_kernels.bench import timing  # noqa: E402

DIVISORS = (32768, 131072, 8192, 4096, 1024, 512)  # the default first
SHAPES = ((8192, 64), (16384, 128))
_FORCE = "MOE_KERNELS_SOLVER_EPS_DIV"


def run(shapes, timed: bool) -> tuple[list[str], bool]:
    """The report's lines, and whether every divisor's objective equalled the CPU solver's."""
    device_name = torch.cuda.get_device_name() if timed else "smoke"
    lines = Lines()
    lines += [
        f"CUDA balanced_assignment by the auction's eps divisor ({device_name}), randn scores (seeds n + k), "
        f"against the CPU solver on {os.cpu_count()} cores",
        "",
        "| n | k | divisor | ms | x the CPU solver | objective | iterations | passes | auction ms (bids, take) |"
        " passes ms | moves ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    disagreements: list[str] = []
    for n, k in shapes:
        scores = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
        with moe_kernels.use_backend("cpu"):
            _, cpu_value, _ = K.balanced_assignment(scores, return_distances=True)
            cpu_s = statistics.median(timing.timeit(lambda scores=scores: K.balanced_assignment(scores), reps=5))
        lines.append(f"| {n} | {k} | CPU solver | {cpu_s * 1e3:.3f} | 1.00 | - | - | - | - | - | - |")
        if not timed:
            continue
        on_device = scores.cuda()
        for divisor in DIVISORS:
            with environment(_FORCE, str(divisor)), moe_kernels.use_backend("cuda"):
                _, value, _ = K.balanced_assignment(on_device, return_distances=True)
                seconds = time_gpu(lambda: K.balanced_assignment(on_device), graph=False)[0]
                profile = solver_profile(lambda: K.balanced_assignment(on_device))
            gap = abs(float(value) - float(cpu_value))
            agree = gap <= 1e-9 * max(1.0, abs(float(cpu_value)))
            if not agree:
                disagreements.append(f"- n = {n}, k = {k}, divisor {divisor}: objective off by {gap:.3g}")
            mark = " (default)" if divisor == DIVISORS[0] else ""
            counts = "- | - | - | - | -"
            if profile:
                counts = (
                    f"{profile['iterations']} | {profile['passes']} | {profile['auction']} ({profile['bids']}, "
                    f"{profile['take']}; heaps in {profile['heaps']} memory) | {profile['pass_ms']} | "
                    f"{profile['moves']}"
                )
            lines.append(
                f"| {n} | {k} | {divisor}{mark} | {seconds * 1e3:.3f} | {cpu_s / seconds:.2f} | "
                f"{'equal' if agree else f'differs by {gap:.3g}'} | {counts} |"
            )
    if disagreements:
        lines += ["", "## Divisors whose objective differs from the CPU solver's", "", *disagreements]
    return lines, not disagreements


_PROFILE = re.compile(
    r"iterations=(?P<iterations>\d+) .*passes=(?P<passes>\d+) .*heaps=(?P<heaps>\w+) .*auction (?P<auction>[\d.]+) "
    r"\(bids (?P<bids>[\d.]+), grouping [\d.]+, take (?P<take>[\d.]+)\), passes (?P<pass_ms>[\d.]+), "
    r"moves (?P<moves>[\d.]+)"
)


def solver_profile(solve) -> dict[str, str]:
    """The fields of the profile line (MOE_KERNELS_SOLVER_PROFILE) that one call of `solve` writes
    to the process's stderr (by the C++ glue, so read from file descriptor 2); {} if none."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            with environment("MOE_KERNELS_SOLVER_PROFILE", "1"):
                solve()
                torch.cuda.synchronize()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    match = _PROFILE.search(text)
    return match.groupdict() if match else {}


def main(argv=None) -> int:
    return variants.main(
        argv,
        __doc__,
        "gpu_solver_variants",
        "the CPU solver at (256, 8); no device rows",
        smoke=lambda args: run(((256, 8),), timed=False),
        timed=lambda args: run(SHAPES, timed=True),
    )


if __name__ == "__main__":
    sys.exit(main())
