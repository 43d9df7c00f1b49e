"""capacity_positions' CUDA paths timed against each other and the Triton kernels on a GPU (issue 33).

csrc/cuda/capacity_positions.cu ranks the choices on one of two paths (capacity_segments.h): the
strided path, a warp a segment of 2048 choices of one slot, each load one id from each of 32 rows
k ids apart; or the tile path, a block a token block's every slot, its [128, k] tiles of ids loaded
whole into shared memory, ranked from there, and the positions stored whole. Either takes a chunk's
peers (the lanes with the same expert) from __match_any_sync or from one ballot a bit of the
expert's label. The launcher takes the strided path with __match_any_sync, the path timed on the
H200 at 290ae21; the tile path fits the default order with 2 <= k <= 16 and k E <= 8192, and runs
where forced. This times the launcher's choice (the row "default", unforced), each path forced by
MOE_KERNELS_CAPACITY_PATH (a path the shape does not fit raises there, and has no row), and the Triton op, at the
goals grid's shapes (T k = 8M): each row the time of one call (CUDA-graph replay, the median of
rounds), the bytes-moved model over it (gpu_bench's: the ids read and the positions written, 16
bytes a choice, and 8 bytes an expert's count) and that as a share of copy_ of the same bytes
measured in the same run. Every path must give the Triton op's result (the smoke run checks that
one against the reference): a shape where one does not is listed under the table (and the exit
status is 1), its timings kept. Each line is printed as it comes, so a call stopped at its limit
keeps its rows.

    python3 bench/gpu_capacity_variants.py [--out FILE.md]
    python3 bench/gpu_capacity_variants.py --smoke   # tiny CPU tensors, the Triton op under TRITON_INTERPRET=1
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants  # noqa: E402
from common import environment, time_gpu  # noqa: E402
from variants import Lines, copy_seconds  # noqa: E402

import moe_kernels  # noqa: E402
from moe_kernels import ops as K  # noqa: E402
from moe_kernels import reference  # noqa: E402
from moe_kernels.ops import capacity_for  # noqa: E402

# capacity_segments::Path, by name (-1: the launcher's choice, unforced).
PATHS = (
    ("default", -1),
    ("strided, match", 0),
    ("strided, ballots", 1),
    ("tiles, ballots", 2),
    ("tiles, match", 3),
)
# (T, E, k): the goals grid's E = 8 and 256 at T k = 8M, the backend threshold's E = 64, and k = 2.
SHAPES = ((1 << 20, 8, 8), (1 << 20, 64, 8), (1 << 20, 256, 8), (1 << 22, 64, 2))
_FORCE = "MOE_KERNELS_CAPACITY_PATH"


def run(scale: int, device: str, timed: bool) -> tuple[list[str], bool]:
    """The report's lines, and whether every path gave the Triton op's result."""
    device_name = torch.cuda.get_device_name() if timed else "smoke"
    lines = Lines()
    lines += [
        f"capacity_positions by path ({device_name}), the default fill order, capacity 1.0, T k = {8 * scale}",
        "",
        "| T | E | k | path | ms | GB/s | of copy_ |",
        "|---|---|---|---|---|---|---|",
    ]
    gen = torch.Generator(device=device).manual_seed(0)
    disagreements: list[str] = []
    for T, E, k in SHAPES:
        T = T * scale >> 20
        experts = torch.randint(0, E, (T, k), device=device, generator=gen)
        C = capacity_for(T, E, k, 1.0)
        moved = T * k * 16 + E * 8
        copy = copy_seconds(moved, device) if timed else 0.0

        def call():
            return K.capacity_positions(experts, E, C)

        with moe_kernels.use_backend("triton"):
            expected = call()
            seconds = time_gpu(call)[0] if timed else 0.0
        if not timed and not all(
            torch.equal(a, b) for a, b in zip(expected, reference.capacity_positions(experts, E, C))
        ):
            disagreements.append(f"- T = {T}, E = {E}, k = {k}: the Triton op is not the reference")
        lines.append(_row(T, E, k, "Triton", seconds, moved, copy, timed))
        for name, path in PATHS:
            if not timed:  # no CUDA kernels on the CPU: the row says so
                lines.append(_row(T, E, k, name, 0.0, moved, copy, timed))
                continue
            with environment(_FORCE, str(path)), moe_kernels.use_backend("cuda"):
                try:
                    result = call()
                except RuntimeError as exc:  # a forced path this shape does not fit
                    if "does not take these experts" not in str(exc):
                        raise
                    continue
                seconds = time_gpu(call)[0]
            if not all(torch.equal(a, b) for a, b in zip(result, expected)):
                disagreements.append(f"- T = {T}, E = {E}, k = {k}, {name}: not the Triton op's positions and counts")
            lines.append(_row(T, E, k, name, seconds, moved, copy, timed))
    if disagreements:
        lines += ["", "## Paths that disagree with the Triton op", "", *disagreements]
    return lines, not disagreements


def _row(T, E, k, name, seconds, moved, copy, timed) -> str:
    if not timed:
        return f"| {T} | {E} | {k} | {name} | - | - | - |"
    rate = f"{seconds * 1e3:.4f} | {moved / seconds / 1e9:.1f} | {copy / seconds:.0%}"
    return f"| {T} | {E} | {k} | {name} | {rate} |"


def main(argv=None) -> int:
    return variants.main(
        argv,
        __doc__,
        "gpu_capacity_variants",
        "T k = 2048 on CPU tensors (TRITON_INTERPRET=1), untimed",
        smoke=lambda args: run(1 << 8, "cpu", timed=False),
        timed=lambda args: run(1 << 20, "cuda", timed=True),
    )


if __name__ == "__main__":
    sys.exit(main())
