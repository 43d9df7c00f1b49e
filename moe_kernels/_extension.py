"""Loads the compiled extension moe_kernels._C, if it was built, and remembers why not otherwise."""

import importlib

import torch

LOADED = False
LOAD_ERROR = ""

try:
    importlib.import_module("moe_kernels._C")
    LOADED = True
except ImportError as exc:  # not built: the ops fall back to the PyTorch reference
    LOAD_ERROR = str(exc)


def defines(op: str) -> bool:
    """True when the loaded extension defines torch.ops.moe_kernels.<op>. A build older than the
    Python package lacks newer ops: they then run on the reference instead of failing at import
    (rebuild with `make build` to get their kernels)."""
    return LOADED and hasattr(torch.ops.moe_kernels, op)


def has_kernel(op: str, dispatch_key: str) -> bool:
    """True when the extension registered a kernel for torch.ops.moe_kernels.<op> on the key."""
    if not defines(op):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_kernels::{op}", dispatch_key)
