"""Timing, the one way every benchmark measures: the device the tensors live on (set_device), glibc's
allocator held warm on CPU (steady_malloc), wall-clock or CUDA-graph timing with the median and
quantiles (timeit, timeit_cuda, time_gpu), one result row per provider (measure, and
measure_interleaved for providers timed in alternating rounds), peak memory of one call, the
torch.compile baselines with their compile time apart, and copy_ of the same bytes.

Importing this module changes nothing in the process: set_device() does (the default device, the
allocator settings). bench/common.py calls it at import with MOE_KERNELS_BENCH_DEVICE; the package
CLI (python -m moe_kernels.bench) with --device.
"""

from __future__ import annotations

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

import moe_kernels

# "cpu", or "cuda": the benchmarks' tensors are created on the GPU (torch's default device) and
# timed with CUDA events (timeit_cuda). Read at call time: set_device changes it.
DEVICE = "cpu"


def set_device(device: str) -> None:
    """Where the benchmarks run: "cpu" (glibc's allocator held warm: steady_malloc) or "cuda" (torch's
    default device, so every tensor a benchmark creates is on the GPU; CUDA-event timing)."""
    global DEVICE
    DEVICE = device
    if device != "cpu":
        torch.set_default_device(device)
    steady_malloc()


def device() -> str:
    """The benchmarks' device, as set_device set it."""
    return DEVICE


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
    """The checkout's commit (+dirty) where moe_kernels is imported from a git checkout, else the
    package's version (an installed package: site-packages is no checkout of ours)."""
    root = Path(moe_kernels.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return f"moe_kernels {moe_kernels.__version__}"
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def generator(seed: int) -> torch.Generator:
    """A seeded generator on the benchmarks' device: with torch.set_default_device("cuda"), a CPU
    generator cannot draw a tensor (torch.randn(..., generator=cpu_generator) raises)."""
    return torch.Generator(DEVICE).manual_seed(seed)


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


def _one_call(fn: Callable[[], object]) -> float:
    """GPU seconds of one eager call of fn, after a first call (compiles, allocator warm-up)."""
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def fit_to_call(one: float, calls: int, rounds: int, min_time: float, budget: float = 1.0) -> tuple[int, int]:
    """(calls per round, rounds) for a call of `one` seconds. A round of `calls` calls longer than
    `min_time` needs fewer calls (one call of milliseconds is far above the launch cost), and the
    rounds are cut to about `budget` seconds in all, at least 3 (the median of a few)."""
    if one * calls <= min_time:
        return calls, rounds
    calls = max(1, int(min_time / one))
    return calls, max(3, min(rounds, int(budget / (one * calls))))


def timeit_cuda(
    fn: Callable[[], object],
    *,
    calls: int = 20,
    rounds: int = 15,
    min_time: float = 0.05,
    graph: bool = True,
    single_call: float = 0.25,
) -> tuple[list[float], str]:
    """GPU seconds of one call of fn, one figure per round, and how they were taken: "graph" (`calls`
    calls captured in one CUDA graph, replayed between two CUDA events) or "loop" (`calls` eager
    calls between the events, where fn cannot be captured). One event pair around many calls:
    around a single call of a kernel of a few microseconds, the events time the launch, not the
    kernel. `calls` grows until a round takes `min_time` / rounds; for a slow call (a torch
    baseline of tens of ms) `calls` and `rounds` shrink so that the timing takes about a second.
    A call of `single_call` seconds or more (a torch baseline thousands of times slower than the
    kernel it is set against) is timed once, after its first call ("one call"): the median of
    three rounds would take seven calls, tens of seconds of a GPU run's fixed budget."""
    one = _one_call(fn)
    if one >= single_call:
        return [one], "one call"
    calls, rounds = fit_to_call(one, calls, rounds, min_time)
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


_LIBC = _glibc()


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
    peak_memory_mb switches to small thresholds and mappings for its one call. Only on CPU (a GPU
    run's tensors come from torch's caching allocator)."""
    if _LIBC is not None and DEVICE == "cpu":
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
