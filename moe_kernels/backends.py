"""The one place that decides which implementation of an op runs.

Backends:
  "torch"   the pure-PyTorch reference (moe_kernels.reference): always available, any device.
  "cpu"     the C++ kernels of the extension moe_kernels._C, for CPU tensors.
  "cuda"    the CUDA kernels of the extension, for CUDA tensors (CUDA builds only).
  "triton"  the Triton kernels, for CUDA tensors; also for CPU tensors when the process runs
            under TRITON_INTERPRET=1 (that is how the tests exercise them on this machine).

Default order: CPU tensors use "cpu", else "torch"; CUDA tensors use "triton", else "cuda", else
"torch", except where the CUDA kernel measured faster on a GPU (_MEASURED_ORDER; _MEASURED_FROM
for an op whose faster backend changes with a size the op passes: capacity_positions' CUDA
kernels from 64 experts). Triton comes first by default because its kernels also run in the test
suite's interpreter pass, on every commit.

float64: an op declares which backends have a float64 path (`register(..., float64=(...))`,
default: all of them). A float64 tensor whose chosen backend has none runs the reference, forced
or not, so every op takes float64 everywhere (gradcheck on the public functions); backends() says
which ops do that ("cpu float64" / "cuda float64").

Kernel limits: a kernel that cannot take a valid input (the Triton routers past the sizes their
rows-in-registers tiles hold: load_probabilities E > 4096, topk_router E > 2048 or more than 64
groups, dselect_k more than 1024 experts; and Triton's batchwise_mask past its grid, which holds
65535 x 16 experts) hands the call on with `fallback(op, "triton", tensor)`: the next backend of
the device's default order that has a kernel here ("cuda" for CUDA tensors where the extension has
it), else the reference; forced or not, like float64, so a valid input is never an error. Under
TRITON_INTERPRET=1 on CPU tensors that is the reference.

A kernel registered as opt-in (`register(..., opt_in=("cuda",))`: compiled here but never run on
its device) is used only when forced; the default order skips it.

Override with the environment variable MOE_KERNELS_BACKEND=torch|cpu|triton|cuda, or for a block
of code with `with moe_kernels.use_backend("triton"): ...` (scoped, thread- and task-local). A
forced backend that cannot run the op on the tensor's device raises a ValueError naming the valid
choices: a forced choice is never silently ignored.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_kernels import _extension

BACKENDS = ("torch", "cpu", "triton", "cuda")
_ORDER = {"cpu": ("cpu", "torch"), "cuda": ("triton", "cuda", "torch")}
# Ops whose CUDA kernel measured faster than their Triton one on a GPU take it first there. None
# does at every size its goal names: in the goals run of 2026-11-29 (bench/results/gpu-nvidia-h200.md,
# CUDA-graph replay) the Triton kernels led wherever both exist (batchwise_mask at T = 1M, E = 256,
# bf16: 1.23 ms and 23.1 ms; the routers by 8x to 53x; dispatch and combine forward by 1.0x to
# 1.4x; only combine's fwd+bwd ran faster on CUDA, by 1.07x and 1.09x), except
# capacity_positions at E = 256 (T = 1M, k = 8: Triton 0.713 ms, CUDA 0.228 ms), where at E = 8
# the Triton kernels are the faster (0.112 ms, 0.145 ms): _MEASURED_FROM below.
_MEASURED_ORDER: dict[tuple[str, str], tuple[str, ...]] = {}
# (op, device type) -> (size, order): the order from `size` on, the size an op passes with its
# call (implementation(..., size=)). capacity_positions passes num_experts: from 64 experts, where
# the Triton op changes from its packed scan to sorted blocks (triton/capacity_positions.py,
# SORTED_FROM), those blocks took 3.1x the CUDA kernels' time at E = 256; below, the packed scan
# is the faster (1.3x at E = 8). Both on the H200, T = 1M, k = 8, 2026-11-29, the CUDA kernels on
# their strided path, still the launcher's; their tile path (untimed, forced only: docs/dispatch.md)
# and the threshold are for bench/gpu_capacity_variants.py's table to confirm or move.
_MEASURED_FROM: dict[tuple[str, str], tuple[int, tuple[str, ...]]] = {
    ("capacity_positions", "cuda"): (64, ("cuda", "triton", "torch")),
}


def default_order(op: str, device_type: str, size: int | None = None) -> tuple[str, ...]:
    """The backends `op` tries, in order, for a tensor on `device_type` when none is forced; `size`
    (the op's own measure, e.g. capacity_positions' num_experts) selects a _MEASURED_FROM order."""
    rule = _MEASURED_FROM.get((op, device_type))
    if rule is not None and size is not None and size >= rule[0]:
        return rule[1]
    return _MEASURED_ORDER.get((op, device_type)) or _ORDER.get(device_type, ("torch",))


_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("moe_kernels_backend", default=None)


@dataclass(frozen=True)
class _Op:
    torch: Callable
    cpu: Callable | None
    triton: Callable | None
    cuda: Callable | None
    opt_in: tuple[str, ...] = ()
    float64: tuple[str, ...] = BACKENDS
    extension: bool = True


_REGISTRY: dict[str, _Op] = {}


def register(
    op: str,
    *,
    torch: Callable,
    cpu=None,
    triton=None,
    cuda=None,
    opt_in: tuple[str, ...] = (),
    float64: tuple[str, ...] = BACKENDS,
    extension: bool = True,
) -> None:
    """Declare the implementations of `op`. Each is a callable with the op's signature, or None.

    `cpu` / `cuda` are used only when the extension registered a kernel for that dispatch key;
    `triton` only when triton imports (and, for CPU tensors, under TRITON_INTERPRET=1). Backends
    named in `opt_in` run only when forced (use_backend / MOE_KERNELS_BACKEND). `float64` names
    the backends with a float64 path; float64 tensors on the others run "torch" (the reference).
    `extension=False` says the extension has no kernel for the op at all (the op modules pass
    cpu=None when the extension did not load, so only this tells an op without a kernel from one
    whose kernel is missing: backends()'s "why").
    """
    for what, names in (("opt_in", opt_in), ("float64", float64)):
        unknown = set(names) - set(BACKENDS)
        if unknown:
            raise ValueError(f"register({op!r}): unknown {what} backends {sorted(unknown)}; valid names: {BACKENDS}")
    _REGISTRY[op] = _Op(
        torch=torch,
        cpu=cpu,
        triton=triton,
        cuda=cuda,
        opt_in=tuple(opt_in),
        float64=("torch", *float64),
        extension=extension,
    )


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _environment(name: str):
    """os.environ.get(name) without its cost on the hot path: a miss there raises and catches a
    KeyError inside Mapping.get (0.7 us, a tenth of an op's call at one token); this reads the
    mapping os.environ keeps (updated by every os.environ write, as monkeypatch.setenv makes)."""
    data = getattr(os.environ, "_data", None)
    if data is None:  # not CPython's os._Environ
        return os.environ.get(name)
    key = _ENVIRONMENT_KEYS.get(name)
    if key is None:
        key = _ENVIRONMENT_KEYS[name] = os.environ.encodekey(name)
    value = data.get(key)
    return None if value is None else os.environ.decodevalue(value)


_ENVIRONMENT_KEYS: dict[str, object] = {}


def triton_interpreting() -> bool:
    return _environment("TRITON_INTERPRET") == "1"


def _available(op: str, backend: str, device_type: str) -> bool:
    impl = getattr(_REGISTRY[op], backend)
    if impl is None:
        return False
    if backend == "torch":
        return True
    if backend == "cpu":
        return device_type == "cpu" and _extension.has_kernel(op, "CPU")
    if backend == "cuda":
        return device_type == "cuda" and _extension.has_kernel(op, "CUDA")
    if backend == "triton":
        if not triton_importable():
            return False
        return device_type == "cuda" or (device_type == "cpu" and triton_interpreting())
    raise AssertionError(backend)


def forced() -> str | None:
    """The backend forced by use_backend() or MOE_KERNELS_BACKEND, validated; None if not forced."""
    name = _forced.get() or _environment("MOE_KERNELS_BACKEND") or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"MOE_KERNELS_BACKEND / use_backend: unknown backend {name!r}; valid names: {BACKENDS}")
    return name


# A host decision made once per traced call site: torch.compile treats the result as a constant
# (it cannot trace ContextVar reads), so a compiled function keeps the backend it was compiled with.
@torch.compiler.assume_constant_result
def choose(op: str, device_type: str, size: int | None = None) -> str:
    """The backend `op` would use for a tensor on `device_type` ("cpu" or "cuda"); `size` as
    default_order's."""
    entry = _REGISTRY.get(op)
    if entry is None:
        raise ValueError(f"unknown op {op!r}; registered: {sorted(_REGISTRY)}")
    name = forced()
    if name is not None:
        if not _available(op, name, device_type):
            valid = [b for b in BACKENDS if _available(op, b, device_type)]
            raise ValueError(
                f"backend {name!r} cannot run {op} on {device_type} tensors here; "
                f"valid names for {device_type}: {valid} (all backends: {BACKENDS})"
            )
        return name
    for name in default_order(op, device_type, size):
        if name not in entry.opt_in and _available(op, name, device_type):
            return name
    return "torch"


def _size_bucket(op: str, device_type: str, size) -> int | None:
    """`size` as choose() takes it: the threshold of the op's _MEASURED_FROM rule where `size`
    reaches it, else None. A plain int either way: under torch.compile a symbolic size (dynamic
    shapes) becomes a guard on this comparison, where choose(), a constant to the compiler, takes
    constant arguments only."""
    rule = _MEASURED_FROM.get((op, device_type))
    if rule is None or size is None:
        return None
    return rule[0] if size >= rule[0] else None


def choose_for(op: str, tensor: torch.Tensor, size: int | None = None) -> str:
    """The backend `op` uses for `tensor`: choose() for its device, then "torch" if `tensor` is
    float64 and that backend has no float64 path."""
    # is_cpu first: building tensor.device costs 0.3 us; a fake tensor's is_cpu is its fake device's
    device_type = "cpu" if getattr(tensor, "is_cpu", False) else tensor.device.type
    name = choose(op, device_type, _size_bucket(op, device_type, size))
    if tensor.dtype == torch.float64 and name not in _REGISTRY[op].float64:
        return "torch"
    return name


def implementation(op: str, tensor: torch.Tensor, size: int | None = None) -> Callable:
    """The callable to run `op` on inputs living on `tensor`'s device (and of its dtype); `size` as
    default_order's."""
    return getattr(_REGISTRY[op], choose_for(op, tensor, size))


def fallback(op: str, past: str, tensor: torch.Tensor) -> Callable:
    """The implementation of `op` for `tensor` when backend `past` was chosen but its kernel cannot
    take this input (a Triton kernel past its size limits; the module docstring): the first backend
    after `past` in the default order of `tensor`'s device that has a kernel here (opt-in ones
    skipped, the float64 rule kept), else the reference. Asked by the implementation of `past`
    itself, so the limits live with the kernel and the choice stays here."""
    device_type = tensor.device.type
    order = default_order(op, device_type)
    entry = _REGISTRY[op]
    for name in order[order.index(past) + 1 :] if past in order else ():
        if name == "torch" or name in entry.opt_in or not _available(op, name, device_type):
            continue
        if tensor.dtype == torch.float64 and name not in entry.float64:
            continue
        return getattr(entry, name)
    return entry.torch


def extension_kernel(op: str, tensor: torch.Tensor):
    """torch.ops.moe_kernels.<op> if the extension has a kernel for `tensor`'s device, else None.

    For internal helper ops (e.g. a fused backward) that follow the public op's backend: the
    public op's choice was already made by `choose`; this only asks whether the kernel exists.
    """
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(tensor.device.type)
    if key is None or not _extension.has_kernel(op, key):
        return None
    return getattr(torch.ops.moe_kernels, op)


@contextlib.contextmanager
def use_backend(name: str):
    """Force `name` for every op called inside the block (validated at each call)."""
    if name not in BACKENDS:
        raise ValueError(f"use_backend: unknown backend {name!r}; valid names: {BACKENDS}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def why_reference(op: str, device_type: str) -> str:
    """Why `op` runs the reference ("torch") on `device_type` tensors rather than a kernel: forced,
    no kernel for the op, the extension not built or not loaded (its loader's message), a build
    older than the op, triton missing, an opt-in kernel. Worded for backends()'s "why"."""
    entry = _REGISTRY[op]
    if forced() == "torch":
        return "forced (use_backend / MOE_KERNELS_BACKEND)"
    extension_ok = _extension.LOADED and _extension.defines(op)
    kernels = [
        name
        for name in _ORDER.get(device_type, ())
        if name != "torch"
        and (getattr(entry, name) is not None or (name in ("cpu", "cuda") and entry.extension and not extension_ok))
    ]
    if not kernels:
        return "the op has no kernel (the reference is its implementation)"
    reasons = []
    for name in kernels:
        if name in entry.opt_in:
            reason = f"its {name} kernel is opt-in (runs only when forced)"
        elif name == "triton":
            reason = "triton is not installed" if not triton_importable() else f"no {name} kernel can run here"
        elif not _extension.LOADED:
            reason = f"the extension moe_kernels._C did not load ({_extension.LOAD_ERROR})"
        elif not _extension.defines(op):
            reason = "the loaded extension was built before this op existed (rebuild it: make build)"
        else:
            reason = f"the extension has no {name} kernel for it (built without {name.upper()} kernels)"
        if reason not in reasons:
            reasons.append(reason)
    return "; ".join(reasons)


def backends() -> dict[str, dict[str, str]]:
    """For every op, the backend a CPU tensor and a CUDA tensor would use now, and why the
    reference runs where it does.

    e.g. {"dselect_k": {"cpu": "cpu", "cuda": "unavailable", "cpu float64": "torch",
    "cuda float64": "unavailable", "why": "cpu float64: the cpu kernel has no float64 path"}}.
    "unavailable" means no CUDA device (or a forced backend that cannot run there); "<device>
    float64" is the backend a float64 tensor would use; "why" says, for each column that runs the
    reference ("torch"), the reason (e.g. "cpu: the extension moe_kernels._C did not load (...)"),
    and where the choice changes with a size the op passes, from which size (e.g. capacity_positions
    on CUDA: "cuda: cuda from a size of 64 (_MEASURED_FROM)", its num_experts), "" when neither."""
    cuda_present = torch.cuda.is_available()
    out = {}
    for op in sorted(_REGISTRY):
        row = {}
        for device_type in ("cpu", "cuda"):
            if device_type == "cuda" and not cuda_present:
                row[device_type] = "unavailable"
                continue
            try:
                row[device_type] = choose(op, device_type)
            except ValueError:
                row[device_type] = "unavailable"
        why = []
        for device_type in ("cpu", "cuda"):
            name = row[device_type]
            if name == "torch":
                why.append(f"{device_type}: {why_reference(op, device_type)}")
            rule = _MEASURED_FROM.get((op, device_type))
            if rule is not None and name != "unavailable" and choose(op, device_type, rule[0]) != name:
                why.append(
                    f"{device_type}: {choose(op, device_type, rule[0])} from a size of {rule[0]} (_MEASURED_FROM)"
                )
            if name != "unavailable" and name not in _REGISTRY[op].float64:
                why.append(f"{device_type} float64: the {name} kernel has no float64 path")
                name = "torch"
            row[f"{device_type} float64"] = name
        row["why"] = "; ".join(why)
        out[op] = row
    return out


class _CallableModule(types.ModuleType):
    """`moe_kernels.backends()` is the summary above while `moe_kernels.backends.choose` etc.
    stay reachable: the module and the function share the name the design gives them."""

    def __call__(self) -> dict[str, dict[str, str]]:
        return backends()


sys.modules[__name__].__class__ = _CallableModule
