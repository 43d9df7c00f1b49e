"""`python -m moe_kernels.bench` (or `moe-kernels-bench`): the op benchmarks against their torch
baselines, eager and under torch.compile, from an installed moe_kernels.

    python -m moe_kernels.bench --list                      # the benchmarks, and which can run here
    python -m moe_kernels.bench --quick                     # every benchmark, small shapes
    python -m moe_kernels.bench --quick --op topk_softmax routers --out results/
    python -m moe_kernels.bench --device cuda --backend triton --backend cuda

Each benchmark prints its rows as it measures them and its markdown table (medians, and ratios
against a baseline measured in the same run) when done, and writes <out>/<name>.csv (appended
to: every row carries the machine, the commit or version, torch and the date) and <out>/<name>.md;
with matplotlib installed, also <out>/<name>.png. --quick names them <name>_quick. With several
--backend, each backend's files go to <out>/<backend>/. A benchmark whose optional dependency
(scipy, transformers, torch.distributed) is missing is skipped with the reason. The repository's
bench/bench_<name>.py scripts and `make bench` run the same code into bench/results/.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
import traceback
from pathlib import Path

import moe_kernels
from moe_kernels.backends import BACKENDS
from moe_kernels.bench import BENCHES, BY_NAME, unavailable
from moe_kernels.bench.output import csv_stamps

DEFAULT_OUT = "moe_kernels_bench"
# The backends that run tensors of each device (moe_kernels.backends checks each op on top).
DEVICE_BACKENDS = {"cpu": ("cpu", "torch"), "cuda": ("triton", "cuda", "torch")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_kernels.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors live (default: cpu)")
    p.add_argument("--quick", action="store_true", help="each benchmark's small shapes (a smoke run: about a minute)")
    p.add_argument(
        "--op",
        nargs="+",
        action="extend",
        metavar="NAME",
        choices=list(BY_NAME),
        help="only these benchmarks (--list names them)",
    )
    p.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        metavar="NAME",
        help=f"time our ops on this backend ({', '.join(BACKENDS)}; repeat for several); "
        "default: the one moe_kernels.backends picks per op",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"the folder for the CSV, markdown and PNG files (default: ./{DEFAULT_OUT}/ in the current folder)",
    )
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baselines (they compile)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and whether each can run here, and exit")
    return p


def list_benches(device: str) -> None:
    width = max(len(b.name) for b in BENCHES)
    for b in BENCHES:
        reason = unavailable(b, device)
        print(f"{b.name:<{width}}  {b.summary}" + (f"  [skipped here: {reason}]" if reason else ""))


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> Path:
    """Arguments argparse cannot check alone; the output folder, resolved."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    for backend in args.backend or ():
        if backend not in DEVICE_BACKENDS[args.device]:
            p.error(
                f"--backend {backend} does not run {args.device} tensors; "
                f"for --device {args.device}: {', '.join(DEVICE_BACKENDS[args.device])}"
            )
    out = Path(args.out).expanduser().resolve()
    package = Path(moe_kernels.__file__).resolve().parent
    if out == package or package in out.parents:
        p.error(f"--out {args.out}: inside the moe_kernels package ({package}); name a folder of your own")
    if out.exists() and not out.is_dir():
        p.error(f"--out {args.out}: exists and is not a folder")
    return out


def op_defaults(module) -> dict:
    """The defaults of a benchmark's own flags (bench/bench_<name>.py's --threads, ...)."""
    if not hasattr(module, "add_arguments"):
        return {}
    own = argparse.ArgumentParser(add_help=False)
    module.add_arguments(own)
    return vars(own.parse_args([]))


def command(args: argparse.Namespace, name: str, backend: str | None) -> str:
    """The command line that reruns one benchmark, for its markdown."""
    parts = ["python -m moe_kernels.bench", "--op", name]
    parts += ["--quick"] * args.quick + ["--device", args.device] * (args.device != "cpu")
    parts += ["--backend", backend] if backend else []
    return " ".join(parts + ["--no-compile"] * args.no_compile)


def plot(paths: list[Path]) -> list[Path]:
    """PNGs of the CSVs a benchmark wrote (none without matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    from moe_kernels.bench.plot import plot_csv

    pngs = []
    for path in paths:
        try:
            pngs.append(plot_csv(path))
        except Exception as exc:  # a plot that fails loses the picture, not the results
            print(f"plot of {path.name} failed: {type(exc).__name__}: {exc}")
    return pngs


def progress(items: list):
    """tqdm's bar over the runs where tqdm is installed, else the items as they are."""
    if importlib.util.find_spec("tqdm") is None:
        return items
    from tqdm import tqdm

    return tqdm(items, desc="moe_kernels.bench", unit="bench", file=sys.stderr)


def run_one(args: argparse.Namespace, name: str, backend: str | None, out: Path) -> tuple[str, list[Path]]:
    """One benchmark into `out`: ("ok" | "failed: ...", the files it wrote)."""
    module = importlib.import_module(f"moe_kernels.bench.{name}")
    bench_args = argparse.Namespace(
        quick=args.quick, out=out, compile=not args.no_compile, command=command(args, name, backend)
    )
    vars(bench_args).update(op_defaults(module))
    before = csv_stamps(out)
    previous = os.environ.get("MOE_KERNELS_BACKEND")
    if backend:
        os.environ["MOE_KERNELS_BACKEND"] = backend  # as bench/'s --backend: inherited by spawned ranks too
    try:
        module.run(bench_args)
        status = "ok"
    except Exception as exc:  # one benchmark's failure must not lose the others
        traceback.print_exc()
        status = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if backend:
            if previous is None:
                os.environ.pop("MOE_KERNELS_BACKEND", None)
            else:
                os.environ["MOE_KERNELS_BACKEND"] = previous
    written = sorted(p for p, stamp in csv_stamps(out).items() if before.get(p) != stamp)
    pngs = plot(written)
    written += [p.with_suffix(".md") for p in written if p.with_suffix(".md").exists()]
    return status, written + pngs


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.list:
        list_benches(args.device)
        return 0
    out = check(p, args)
    from moe_kernels.bench import timing

    timing.set_device(args.device)
    import torch

    print(f"moe_kernels {moe_kernels.__version__}, torch {torch.__version__}, device {args.device}; results -> {out}")
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no PNG plots (pip install matplotlib), the CSV and markdown only")
    backends = args.backend or [None]
    runs = [(name, backend) for backend in backends for name in (args.op or [b.name for b in BENCHES])]
    summary = []
    start = time.monotonic()
    for name, backend in progress(runs):
        folder = out / backend if backend and len(backends) > 1 else out
        label = name + (f" [{backend}]" if backend else "")
        reason = unavailable(BY_NAME[name], args.device)
        if reason:
            print(f"== {label}: skipped, {reason}", flush=True)
            summary.append((label, f"skipped: {reason}", []))
            continue
        print(f"== {label}", flush=True)
        summary.append((label, *run_one(args, name, backend, folder)))
    print(f"\nmoe_kernels.bench: {len(runs)} runs in {time.monotonic() - start:.0f} s, results in {out}")
    for label, status, files in summary:
        shown = ", ".join(str(f.relative_to(out)) for f in files)
        print(f"  {label:<28} {status}" + (f"  ({shown})" if shown else ""))
    return 1 if any(status.startswith("failed") for _, status, _ in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
