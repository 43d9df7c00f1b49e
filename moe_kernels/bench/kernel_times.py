"""Where a call's device time goes: the kernels (and memsets / copies) one call of a function runs,
each with its time a call, from torch.profiler. bench/gpu_bench.py adds it to every row it times,
so one GPU run says which kernel of an op bounds it (issue 33 asks the op's doc to say so, measured)
without a second run to profile.

On CPU tensors the profile is of the CPU's operators (self time): the same code runs in the smoke
tests, where no GPU is."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class KernelTime:
    """One kernel's (or operator's) share of a call: `ms` its device time a call (CPU: its self
    time), `launches` how many times a call runs it."""

    name: str
    ms: float
    launches: float


def short_name(name: str) -> str:
    """A kernel's name without what makes a CUDA kernel's demangled name long: its return type,
    parameter list, template arguments and namespaces (`void ns::scatter_rows<bf16, 8>(...)` ->
    `scatter_rows`); Triton's kernels, torch's operators (`aten::mm`) and the profiler's
    `Memset (Device)` stay as they are."""
    if name.startswith("aten::") or not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):  # the parameter list: the balanced (...) at the end
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            break
    if i == 0 or name[i - 1] == " ":  # "Memset (Device)": a label, not a parameter list
        return name
    depth, kept = 0, []
    head = name[:i].removeprefix("void ").replace("->", "")  # an arrow's '>' closes no bracket
    for ch in head:  # template arguments, however nested
        depth += ch == "<"
        if depth == 0:
            kept.append(ch)
        depth -= ch == ">" and depth > 0
    return "".join(kept).rsplit("::", 1)[-1]


def kernel_times(fn: Callable[[], object], *, device: str, calls: int = 3) -> list[KernelTime]:
    """The kernels of one `fn()` on `device` ("cuda": device time of each kernel, memset and copy;
    else the CPU operators' self time), longest first, averaged over `calls` profiled calls after
    one unprofiled call (which compiles, autotunes and fills the caching allocator)."""
    cuda = device == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync()
    # By short name: kernels whose full names differ only in their template arguments (torch's
    # elementwise kernels of fill and copy) add up under one.
    by_name: dict[str, list[float]] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        # On the GPU only the device's own events: a host event (a launch, an operator where the
        # CPU is profiled too) may carry its kernels' time again.
        if us > 0 and (not cuda or event.device_type != DeviceType.CPU):
            total = by_name.setdefault(short_name(event.key), [0.0, 0])
            total[0] += us
            total[1] += event.count
    out = [KernelTime(name, us / 1e3 / calls, count / calls) for name, (us, count) in by_name.items()]
    return sorted(out, key=lambda t: (-t.ms, t.name))


def summary(times: list[KernelTime], top: int = 4) -> str:
    """`total ms: name ms (share) x launches, ...` of the `top` longest, the rest as `other`: the
    form of gpu_bench's `kernels` column."""
    total = sum(t.ms for t in times)
    if not times or total <= 0:
        return "no kernels recorded"
    parts = []
    for t in times[:top]:
        launches = f" x{t.launches:g}" if t.launches != 1 else ""
        parts.append(f"{t.name} {t.ms:.4f} ({t.ms / total:.0%}){launches}")
    rest = times[top:]
    if rest:
        ms = sum(t.ms for t in rest)
        parts.append(f"{len(rest)} other {ms:.4f} ({ms / total:.0%})")
    return f"{total:.4f} ms: " + ", ".join(parts)
