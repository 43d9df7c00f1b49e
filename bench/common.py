"""The one benchmark harness: timing with median and quantiles, a CSV row per measurement with the
machine and the commit, and a markdown table of ratios against a baseline measured in the same run.

Usage in bench/bench_<op>.py:
    rows = [measure("topk_softmax", provider, fn, config={...}, bytes_moved=...), ...]
    report("topk_softmax", rows, baseline="torch sequence", against="moe_kernels")
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS = Path(os.environ.get("MOE_KERNELS_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
# MOE_KERNELS_BENCH_DEVICE=cuda (make CUDA=1 bench, make gpu-report): the benchmarks' tensors are
# created on the GPU (torch's default device) and timed with CUDA events (timeit_cuda).
DEVICE = os.environ.get("MOE_KERNELS_BENCH_DEVICE", "cpu")
if DEVICE != "cpu":
    torch.set_default_device(DEVICE)


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} x{os.cpu_count()} threads={torch.get_num_threads()}"


def commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def timeit_cuda(fn: Callable[[], object], *, warmup: int = 3, reps: int = 15, min_time: float = 0.2) -> list[float]:
    """GPU seconds of `fn()` per run, between CUDA events around each run on the current stream
    (the launches are asynchronous: host wall-clock time would measure the launch, not the kernel)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    start = time.perf_counter()
    while len(events) < reps or (time.perf_counter() - start < min_time and len(events) < 1000):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        events.append((begin, end))
        if len(events) % 50 == 0:
            torch.cuda.synchronize()  # keep the host from queueing far ahead of min_time
    torch.cuda.synchronize()
    return [b.elapsed_time(e) / 1e3 for b, e in events]


def timeit(fn: Callable[[], object], *, warmup: int = 3, reps: int = 15, min_time: float = 0.2) -> list[float]:
    """Wall-clock seconds of `fn()` over at least `reps` runs and `min_time` seconds (on the GPU:
    timeit_cuda)."""
    if DEVICE == "cuda":
        return timeit_cuda(fn, warmup=warmup, reps=reps, min_time=min_time)
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_time and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def compile_sequence(fn: Callable, *args) -> tuple[Callable, float]:
    """`torch.compile(fn, dynamic=False)` and the seconds its first call `fn(*args)` took (the
    compilation), so benchmarks time the compiled code only and report the compile time apart."""
    compiled = torch.compile(fn, dynamic=False)
    start = time.perf_counter()
    compiled(*args)
    return compiled, time.perf_counter() - start


def measure(
    op: str,
    provider: str,
    fn: Callable[[], object],
    *,
    config: dict,
    mode: str = "forward",
    bytes_moved: int | None = None,
    **timing,
) -> dict:
    """Time `fn` and return a result row (median, 20th and 80th percentiles in ms, GB/s)."""
    times = sorted(timeit(fn, **timing))
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0]] * 4
    median = statistics.median(times)
    row = {
        "op": op,
        "provider": provider,
        "mode": mode,
        "config": " ".join(f"{k}={v}" for k, v in config.items()),
        "median_ms": median * 1e3,
        "p20_ms": q[0] * 1e3,
        "p80_ms": q[3] * 1e3,
        "gb_per_s": (bytes_moved / median / 1e9) if bytes_moved else "",
        "machine": machine(),
        "commit": commit(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
    }
    print(
        f"  {provider:<28} {mode:<8} {row['config']:<32} {row['median_ms']:9.3f} ms"
        + (f"  {row['gb_per_s']:6.2f} GB/s" if bytes_moved else ""),
        flush=True,
    )
    return row


def write_csv(name: str, rows: list[dict]) -> Path:
    """Append rows to bench/results/<name>.csv."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
    return path


def ratio_table(rows: list[dict], *, baseline: str, providers: list[str]) -> str:
    """Markdown: per (mode, config), each provider's median and baseline_time / provider_time."""
    keys = sorted({(r["mode"], r["config"]) for r in rows}, key=lambda k: [r["config"] for r in rows].index(k[1]))
    head = "| mode | config | " + " | ".join(f"{p} ms" for p in providers)
    head += " | " + " | ".join(f"speed-up of {p} vs {baseline}" for p in providers if p != baseline) + " |"
    lines = [head, "|" + "---|" * (2 + len(providers) + len(providers) - 1)]
    for mode, config in keys:
        t = {r["provider"]: r["median_ms"] for r in rows if r["mode"] == mode and r["config"] == config}
        cells = [f"{t[p]:.3f}" if p in t else "-" for p in providers]
        ratios = [f"{t[baseline] / t[p]:.2f}x" if p in t and baseline in t else "-" for p in providers if p != baseline]
        lines.append(f"| {mode} | {config} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def report(name: str, rows: list[dict], *, baseline: str, providers: list[str], command: str, notes: str = "") -> str:
    """Write the CSV and bench/results/<name>.md (the table quoted in docs), return the markdown."""
    write_csv(name, rows)
    md = (
        f"# {name}\n\nCommand: `{command}`  \nMachine: {machine()}  \nCommit: {commit()}, torch {torch.__version__}\n\n"
        f"Median of >= 15 runs; ratios are against `{baseline}` measured in the same run.\n\n"
        + ratio_table(rows, baseline=baseline, providers=providers)
        + "\n"
        + (f"\n{notes}\n" if notes else "")
    )
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return md
