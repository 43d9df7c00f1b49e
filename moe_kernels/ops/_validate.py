"""Argument checks shared by the public ops: cheap (no device sync) and explicit. Values are read
only on the host backends (host_readable)."""

import torch

from moe_kernels import backends

ROUTING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def tensor(name: str, value, *, dim: int | None = None, shape: str = "", dtypes=None) -> torch.Tensor:
    """Check that `value` is a tensor of rank `dim` and one of `dtypes`; `shape` names the
    expected shape in the message, e.g. "[T, E]"."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape}, got {type(value).__name__}")
    if dim is not None and value.dim() != dim:
        raise ValueError(f"{name} must be {shape} ({dim}-D), got shape {tuple(value.shape)}")
    if dtypes is not None and value.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {value.dtype}")
    return value


def integer(name: str, value, *, low: int | None = None, high: int | None = None, what: str = "") -> int:
    """Check that `value` is a Python int (bool excluded) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in [{lo}, {hi}]{what}, got {value}")
    return value


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def routing_indices(name: str, value, *, shape: tuple[int, int] | None = None):
    """An int64 [T, k] index tensor (experts or positions), -1 allowed as "empty". Checks the type
    and shape only: the values with index_range, where host_readable allows."""
    tensor(name, value, dim=2, shape="[T, k]", dtypes=(torch.int64,))
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must be [T, k] = {list(shape)}, got shape {tuple(value.shape)}")
    return value


def index_range(name: str, value: torch.Tensor, high: int) -> None:
    """Every value of the int64 index tensor in [-1, high), a ValueError naming `name` otherwise.

    Reads the values: call only where host_readable is True. The GPU backends never read them
    (a device sync) and their kernels drop an out-of-range id instead (docs/reliability.md).
    """
    if value.numel():
        lo, hi = int(value.min()), int(value.max())
        if lo < -1 or hi >= high:
            raise ValueError(f"{name} values must be in [-1, {high}), got min {lo} max {hi}")


HOST_BACKENDS = ("cpu", "torch")


def on_host(*tensors: torch.Tensor) -> bool:
    """True when the tensors' values can be read at no cost: real CPU tensors (not fake, 'meta' or
    CUDA) outside torch.compile tracing. For checks outside any one op (the layers' masks)."""
    if torch.compiler.is_compiling():
        return False
    return not any(_is_fake(t) or t.device.type != "cpu" for t in tensors)


def host_readable(op: str, value: torch.Tensor, *others: torch.Tensor) -> bool:
    """True when `op` may read values of its arguments to check them at no cost: `value` (the
    tensor its backend is chosen by) and the `others` to be read are real CPU tensors outside
    torch.compile tracing, and the backend chosen for `value` is a host one ("cpu" or "torch").

    Never for "triton" / "cuda": their path reads no value back (a device sync per op per layer,
    and CUDA-graph capture fails on it), not even for the CPU tensors the Triton interpreter runs,
    which stand for the GPU path in the tests. Those kernels drop out-of-range ids instead.
    """
    if not on_host(value, *others):
        return False  # e.g. a 'meta' or CUDA argument: same_device names it
    return backends.choose_for(op, value) in HOST_BACKENDS


def _is_fake(value: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor) or value.device.type == "meta"


def same_device(**tensors) -> None:
    """Every given tensor (None skipped) on one device; a ValueError names two that differ. A
    kernel handed a tensor of another device (e.g. a 'meta' mask) would read memory it does not own."""
    first = None
    for name, value in tensors.items():
        if value is None:
            continue
        if first is None:
            first = (name, value.device)
        elif value.device != first[1]:
            raise ValueError(
                f"{name} is on {value.device} but {first[0]} is on {first[1]}: every tensor argument "
                "of the op must be on one device"
            )
