"""The one benchmark harness: timing with median and quantiles, a CSV row per measurement with the
machine and the commit, and a markdown table of ratios against a baseline measured in the same run.

Usage in bench/bench_<op>.py:
    rows = [measure("topk_softmax", provider, fn, config={...}, bytes_moved=...), ...]
    rows += measure_interleaved("topk_softmax", {provider: fn, ...}, config={...})  # ratios' rows
    report("topk_softmax", rows, baseline="torch sequence", against="moe_kernels")
"""

from __future__ import annotations

import csv
import ctypes
import datetime
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch

RESULTS = Path(os.environ.get("MOE_KERNELS_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
# MOE_KERNELS_BENCH_DEVICE=cuda (make CUDA=1 bench): the benchmarks' tensors are
# created on the GPU (torch's default device) and timed with CUDA events (timeit_cuda).
DEVICE = os.environ.get("MOE_KERNELS_BENCH_DEVICE", "cpu")
if DEVICE != "cpu":
    torch.set_default_device(DEVICE)


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


def _capture(fn: Callable[[], object], calls: int):
    """A CUDA graph of `calls` calls of fn (warmed up on a side stream first, as capture needs), or
    None when fn cannot be captured (it syncs with the host: .item(), boolean-mask indexing, ...)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception:  # noqa: BLE001 (any capture failure means: time it eagerly)
        torch.cuda.synchronize()
        return None
    return graph


def timeit_cuda(
    fn: Callable[[], object], *, calls: int = 20, rounds: int = 15, min_time: float = 0.05, graph: bool = True
) -> tuple[list[float], str]:
    """GPU seconds of one call of fn, one figure per round, and how they were taken: "graph" (`calls`
    calls captured in one CUDA graph, replayed between two CUDA events) or "loop" (`calls` eager
    calls between the events, where fn cannot be captured). One event pair around many calls:
    around a single call of a kernel of a few microseconds, the events time the launch, not the
    kernel. `calls` grows until a round takes `min_time` / rounds."""
    captured = _capture(fn, calls) if graph else None

    def one_round() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        if captured is not None:
            captured.replay()
        else:
            for _ in range(calls):
                fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    if captured is None:
        for _ in range(3):
            fn()
    one_round()
    first = one_round()
    if first < min_time / rounds and captured is not None:
        scale = min(50, int(min_time / rounds / max(first, 1e-7)) + 1)
        if scale > 1:
            calls *= scale
            captured = _capture(fn, calls)
            one_round()
    elif first < min_time / rounds:
        calls *= min(50, int(min_time / rounds / max(first, 1e-7)) + 1)
    times = [one_round() / calls for _ in range(rounds)]
    return times, "graph" if captured is not None else "loop"


def time_gpu(fn: Callable[[], object], **kwargs) -> tuple[float, str]:
    """The median of timeit_cuda's rounds (seconds per call) and its method."""
    times, method = timeit_cuda(fn, **kwargs)
    return statistics.median(times), method


def timeit(fn: Callable[[], object], *, warmup: int = 3, reps: int = 15, min_time: float = 0.2) -> list[float]:
    """Wall-clock seconds of `fn()` over at least `reps` runs and `min_time` seconds (on the GPU:
    timeit_cuda)."""
    if DEVICE == "cuda":
        return timeit_cuda(fn, rounds=max(5, reps), min_time=min_time)[0]
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


def measure_compiled(op: str, provider: str, fn: Callable, *args, config: dict, notes: list[str], **kwargs) -> dict:
    """measure() of torch.compile(fn, dynamic=False) on args, its compile time (the first call)
    left out of the timing and appended to `notes` as a markdown row (compile_notes)."""
    compiled, seconds = compile_sequence(fn, *args)
    notes.append(f"| {provider} | {' '.join(f'{a}={b}' for a, b in config.items())} | {seconds:.1f} |")
    return measure(op, provider, lambda: compiled(*args), config=config, **kwargs)


def compile_notes(notes: list[str]) -> str:
    """The markdown under a table: the compile time of each measure_compiled row."""
    head = "torch.compile (dynamic=False), first-call compile time (not in the timings):\n\n"
    return head + "| provider | config | compile s |\n|---|---|---|\n" + "\n".join(notes)


# glibc's mallopt parameters (malloc.h) and their defaults: M_MMAP_MAX, how many mappings malloc may
# hold at once (0: never map, always the heap).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
GLIBC_MMAP_MAX = 65536


def _glibc():
    """The process's glibc (for mallopt / malloc_trim), or None on another C library."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim, libc.gnu_get_libc_version  # noqa: B018 (glibc only)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc() if DEVICE == "cpu" else None


def steady_malloc() -> None:
    """Time large CPU tensors as a warm allocator serves them (run when this module is imported, so
    every benchmark times alike): every allocation from glibc's heap (no mmap), freed memory kept
    (trim threshold 1 GiB), so once timeit's warm-up calls have grown the heap, a call's tensors
    are memory already touched. glibc's defaults instead map each tensor above its mmap threshold
    (128 KiB at first, raised after large frees up to 32 MiB) afresh, and every page of a fresh
    mapping faults on first touch (~2.3 us per 4 KiB here, as much as the kernels themselves):
    then whether a 64 MB output faults depends on what the process freed before (glibc serves it
    from the heap's top when that is large enough), and timings of the same call differed 5x
    between configurations. Page faults cost every provider alike and say nothing of a kernel;
    caching allocators (PyTorch's on the GPU, jemalloc or tcmalloc on the CPU) avoid them too.
    peak_memory_mb switches to small thresholds and mappings for its one call."""
    if _LIBC is not None:
        _LIBC.mallopt(M_MMAP_MAX, 0)
        _LIBC.mallopt(M_TRIM_THRESHOLD, 2**30)


def peak_memory_mb(fn: Callable[[], object]) -> float:
    """Peak memory of one call of fn() above what was in use before it, in MB. On CUDA:
    torch.cuda.max_memory_allocated (the caching allocator's tensors). On CPU, torch 2.13 keeps no
    allocator statistics, so this is the process's peak resident memory (Linux VmHWM, reset through
    /proc/self/clear_refs) minus VmRSS before the call: tensors plus any other memory fn touches.
    For the call, glibc maps every tensor above 128 KiB afresh and malloc_trim returns the free heap
    pages, so every large tensor fn allocates is memory the kernel sees being touched (recycled heap
    memory would hide it); steady_malloc's settings are restored after. NaN where /proc does not allow
    the reset or the C library is not glibc."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20

    def status(field):
        return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

    if _LIBC is None:
        return float("nan")
    _LIBC.mallopt(M_MMAP_MAX, GLIBC_MMAP_MAX)
    _LIBC.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    _LIBC.mallopt(M_TRIM_THRESHOLD, 128 * 1024)
    _LIBC.malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = status("VmRSS")
    except (OSError, AttributeError):
        steady_malloc()
        return float("nan")
    try:
        fn()
        return status("VmHWM") - before
    finally:
        steady_malloc()


steady_malloc()


def measure(
    op: str,
    provider: str,
    fn: Callable[[], object],
    *,
    config: dict,
    mode: str = "forward",
    bytes_moved: int | None = None,
    memory: bool = False,
    **timing,
) -> dict:
    """Time `fn` and return a result row (median, 20th and 80th percentiles in ms, GB/s; with
    memory=True also `peak_mb`, peak_memory_mb of one call, measured before the timing)."""
    peak = peak_memory_mb(fn) if memory else None
    return _row(op, provider, mode, config, timeit(fn, **timing), bytes_moved, peak)


def measure_interleaved(
    op: str,
    providers: dict[str, Callable[[], object]],
    *,
    config: dict,
    mode: str = "forward",
    bytes_moved: int | dict[str, int] | None = None,
    memory: bool | Collection[str] = False,
    rounds: int = 15,
    warmup: int = 3,
    reps: int = 15,
    min_time: float = 0.2,
) -> list[dict]:
    """measure() for several providers of one configuration, their timings interleaved: `rounds`
    rounds, each timing every provider in turn (min_time / rounds seconds and reps / rounds runs
    each), so that a slow spell of this shared machine falls on all of them alike instead of on
    whichever was running (one call's median moved up to 2x between runs: the full softmax at
    E = 64, k = 1, 1.79 and 3.47 ms); the ratios between the rows then compare the same stretches
    of time. 15 rounds (~13 ms of each fast provider's runs a round): with 5 (40 ms), a slow spell
    still fell on one provider's rounds and not the others' (the full softmax at E = 64, k = 1:
    3.14 ms, 4.3 read passes, against 1.7-1.8 ms by hand). bytes_moved: one count for all, or one
    per provider (none for those left out); memory: True, or the providers whose peak memory to
    measure. One row per provider, in order."""
    peaks = {
        name: peak_memory_mb(fn) if memory is True or (memory and name in memory) else None
        for name, fn in providers.items()
    }
    for fn in providers.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in providers}
    for _ in range(rounds):
        for name, fn in providers.items():
            times[name] += timeit(fn, warmup=0, reps=-(-reps // rounds), min_time=min_time / rounds)
    moved = bytes_moved if isinstance(bytes_moved, dict) else dict.fromkeys(providers, bytes_moved)
    return [_row(op, name, mode, config, times[name], moved.get(name), peaks[name]) for name in providers]


def _row(
    op: str, provider: str, mode: str, config: dict, times: list[float], bytes_moved: int | None, peak: float | None
) -> dict:
    """A result row from one provider's timings (seconds), printed as it is made."""
    times = sorted(times)
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
        "peak_mb": "" if peak is None else round(peak, 1),
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


def copy_pass(config: dict, nbytes: int, **timing) -> dict:
    """torch's copy_ between two float32 tensors moving `nbytes` (half read, half written): the
    machine's practical limit for an op that moves that many bytes, measured in the same run."""
    n = max(1, nbytes // 8)
    src, dst = torch.ones(n), torch.empty(n)
    return measure("copy_", "copy_", lambda: dst.copy_(src), config=config, bytes_moved=8 * n, **timing)


def bandwidth_section(model: str, entries: list[tuple[str, dict, int, dict, dict]]) -> str:
    """A markdown section: each op's achieved GB/s under its bytes-moved model next to copy_ of
    the same bytes. entries: (op, config, bytes moved, the op's measure() row, copy_pass's row)."""
    lines = [
        "\n## Bandwidth against copy_ of the same bytes (forward)\n",
        model + "\n",
        "| op | config | MB moved | ms | GB/s | copy_ GB/s | fraction of copy_ |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, config, nbytes, row, copy in entries:
        cfg = " ".join(f"{k}={v}" for k, v in config.items())
        lines.append(
            f"| {op} | {cfg} | {nbytes / 1e6:.1f} | {row['median_ms']:.3f} | {row['gb_per_s']:.1f} | "
            f"{copy['gb_per_s']:.1f} | {row['gb_per_s'] / copy['gb_per_s']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def write_csv(name: str, rows: list[dict]) -> Path:
    """Append rows to bench/results/<name>.csv; when they bring a column the file lacks (peak_mb),
    the file is rewritten with the union of the columns (old rows get empty cells)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.csv"
    fields = list(dict.fromkeys(k for r in rows for k in r))
    old: list[dict] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            if set(fields) - set(header):
                old = list(reader)
            fields = list(dict.fromkeys(header + fields))
    with path.open("w" if old or not path.exists() else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        if old or f.tell() == 0:
            writer.writeheader()
        writer.writerows(old + rows)
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


def memory_table(rows: list[dict], providers: list[str]) -> str:
    """Markdown: per (mode, config), each provider's peak_mb where measured ('' if none was)."""
    measured = [r for r in rows if r.get("peak_mb") not in (None, "")]
    if not measured:
        return ""
    shown = [p for p in providers if any(r["provider"] == p for r in measured)]
    keys = list(dict.fromkeys((r["mode"], r["config"]) for r in measured))
    where = "torch.cuda.max_memory_allocated" if DEVICE == "cuda" else "process peak RSS (VmHWM)"
    lines = [
        f"\n## Peak memory of one call, MB above what was in use before it ({where})\n",
        "| mode | config | " + " | ".join(shown) + " |",
        "|---|---|" + "---|" * len(shown),
    ]
    for mode, config in keys:
        m = {r["provider"]: r["peak_mb"] for r in measured if r["mode"] == mode and r["config"] == config}
        cells = [f"{float(m[p]):.1f}" if p in m else "-" for p in shown]
        lines.append(f"| {mode} | {config} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(name: str, rows: list[dict], *, baseline: str, providers: list[str], command: str, notes: str = "") -> str:
    """Write the CSV and bench/results/<name>.md (the table quoted in docs), return the markdown."""
    write_csv(name, rows)
    md = (
        f"# {name}\n\nCommand: `{command}`  \nMachine: {machine()}  \nCommit: {commit()}, torch {torch.__version__}\n\n"
        f"Median of >= 15 runs; ratios are against `{baseline}` measured in the same run.\n\n"
        + ratio_table(rows, baseline=baseline, providers=providers)
        + "\n"
        + memory_table(rows, providers)
        + (f"\n{notes}\n" if notes else "")
    )
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return md
