"""batchwise_mask (eq 18) on CPU: the C++ kernel vs torch.topk(scores, m, dim=0) + scatter (the
plain PyTorch way to take each expert's top m tokens), and the reference, at m = 2T/E. Also the
expert-choice layout (return_indices=True) against topk + sort of the indices, which is what the
layout needs (ascending token lists).

    .venv/bin/python bench/bench_batchwise.py [--quick] [--threads N]
    python -m moe_kernels.bench --op batchwise [--quick]
"""

import torch

import moe_kernels
from moe_kernels import reference
from moe_kernels.bench.output import compile_notes, report
from moe_kernels.bench.timing import measure, measure_compiled
from moe_kernels.ops import batchwise_mask

QUICK = "one small configuration (smoke test)"


def topk_scatter(scores, m):
    """The baseline of issue 5: torch.topk over the token dimension, scattered into a bool mask."""
    idx = torch.topk(scores, m, dim=0).indices  # [m, E]
    return torch.zeros(scores.shape, dtype=torch.bool).scatter_(0, idx, True)


def topk_sorted_indices(scores, m):
    """Baseline for the expert-choice layout: the [E, m] token lists in ascending order, and the mask."""
    idx = torch.topk(scores, m, dim=0).indices
    mask = torch.zeros(scores.shape, dtype=torch.bool).scatter_(0, idx, True)
    return mask, idx.t().sort(dim=1).values


def check_agreement(x, m):
    """The kernel must equal the reference; topk may differ from both only where a column has a
    tie at its m-th score (it breaks ties arbitrarily)."""
    ours = batchwise_mask(x, m)
    assert torch.equal(ours, reference.batchwise_mask(x, m)[0]), "batchwise_mask differs from the reference"
    base = topk_scatter(x, m)
    if not torch.equal(ours, base):
        kth = x.sort(dim=0, descending=True).values[m - 1 : m + 1]
        tied = (kth[0] == kth[1]).nonzero().flatten().tolist()
        print(
            f"  note: topk+scatter differs from the reference in {int((ours != base).sum())} entries; "
            f"columns tied at the m-th score: {tied}"
        )


def add_arguments(parser):
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")


def run(args):
    """args: quick, out (the results folder), compile (the torch.compile baseline), command (for the
    table), and the flags of add_arguments."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)  # the same scores every run (torch's default seed differs per process)
    grid = [(4096, 8)] if args.quick else [(T, E) for T in (4096, 65536) for E in (8, 64, 256)]
    print(f"backend: {moe_kernels.backends()['batchwise_mask']}, threads {torch.get_num_threads()}")
    rows, notes = [], []
    for T, E in grid:
        m = 2 * T // E
        x = torch.randn(T, E)
        config = {"T": T, "E": E, "m": m}
        check_agreement(x, m)
        providers = {
            "moe_kernels": lambda: batchwise_mask(x, m),
            "torch.topk(dim=0)+scatter": lambda: topk_scatter(x, m),
        }
        if T <= 4096:  # the reference sorts every column in a Python loop: slow at T = 65536
            providers["reference"] = lambda: reference.batchwise_mask(x, m)
        bytes_moved = x.numel() * 5 + E * m * 8
        for name, fn in providers.items():
            mem = name != "reference"
            rows.append(measure("batchwise_mask", name, fn, config=config, bytes_moved=bytes_moved, memory=mem))
        if args.compile:
            rows.append(
                measure_compiled(
                    "batchwise_mask",
                    "torch.compile topk+scatter",
                    topk_scatter,
                    x,
                    m,
                    config=config,
                    notes=notes,
                    bytes_moved=bytes_moved,
                )
            )
        # One read of the scores: the limit of an op that must read every score.
        rows.append(measure("batchwise_mask", "read pass", lambda: x.amax(0), config=config, bytes_moved=x.numel() * 4))
        for name, fn in {
            "moe_kernels": lambda: batchwise_mask(x, m, return_indices=True),
            "torch.topk(dim=0)+scatter": lambda: topk_sorted_indices(x, m),
        }.items():
            rows.append(measure("batchwise_mask", name, fn, config=config, mode="+indices"))
    report(
        "batchwise" + ("_quick" if args.quick else ""),
        rows,
        out=args.out,
        baseline="torch.topk(dim=0)+scatter",
        providers=["moe_kernels", "torch.topk(dim=0)+scatter", "reference", "torch.compile topk+scatter", "read pass"],
        command=args.command
        or ".venv/bin/python bench/bench_batchwise.py" + (f" --threads {args.threads}" if args.threads else ""),
        notes=compile_notes(notes),
    )
