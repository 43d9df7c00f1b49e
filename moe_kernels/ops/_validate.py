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
