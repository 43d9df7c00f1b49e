"""Argument checks shared by the public ops: cheap (no device sync) and explicit."""

import torch

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


def routing_indices(name: str, value, *, shape: tuple[int, int] | None = None, high: int | None = None):
    """An int64 [T, k] index tensor (experts or positions), -1 allowed as "empty".

    Values are range-checked against [-1, high) only where that costs no device sync (CPU
    tensors, outside torch.compile tracing); the kernels never read or write out of bounds anyway.
    """
    tensor(name, value, dim=2, shape="[T, k]", dtypes=(torch.int64,))
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must be [T, k] = {list(shape)}, got shape {tuple(value.shape)}")
    if high is not None and value.numel() and backends_can_read(value):
        lo, hi = int(value.min()), int(value.max())
        if lo < -1 or hi >= high:
            raise ValueError(f"{name} values must be in [-1, {high}), got min {lo} max {hi}")
    return value


def backends_can_read(value: torch.Tensor) -> bool:
    """True when reading a value of `value` costs no device sync and is not being traced."""
    return value.device.type == "cpu" and not torch.compiler.is_compiling() and not _is_fake(value)


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
