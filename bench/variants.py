"""The harness of the gpu_*_variants scripts (bench/gpu_router_variants.py, gpu_capacity_variants.py,
gpu_solver_variants.py) and of gpu_router_bounds.py: each times an op's ways (or stages) against
each other on a GPU in one process, prints its table's rows as they come (a device call stopped at
its limit keeps what it timed), and has a --smoke run on the CPU that its test runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import time_gpu


def copy_seconds(nbytes: int, device: str) -> float:
    """copy_ of nbytes / 2 into as many: the practical limit for nbytes of traffic."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_gpu(lambda: dst.copy_(src))[0]


class Lines(list):
    """The report's lines, each printed as it is added: a device call stopped at its limit keeps
    the rows timed so far."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)

    def __iadd__(self, more):
        for line in more:
            self.append(line)
        return self


Run = Callable[[argparse.Namespace], tuple[list[str], bool]]


def main(argv, doc: str, name: str, smoke_help: str, smoke: Run, timed: Run, options=()) -> int:
    """A variants script's command line: --out FILE (the table, also printed), --smoke (`smoke`, on
    the CPU) or the device run (`timed`; exit 2 without a CUDA device), and `options`, each
    (flags, keywords) for add_argument. Exit 0 where `run` says every variant agreed, else 1."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flags, keywords in options:
        parser.add_argument(*flags, **keywords)
    parser.add_argument("--out", help="also write the tables to this file")
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    args = parser.parse_args(argv)
    if args.smoke:
        lines, agree = smoke(args)
    else:
        if not torch.cuda.is_available():
            print(f"{name}: no CUDA device (use --smoke to check it on the CPU)", file=sys.stderr)
            return 2
        lines, agree = timed(args)
    if args.out:  # (each line was printed as it came)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if agree else 1
