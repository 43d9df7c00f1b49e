"""Loads the compiled extension moe_kernels._C, if it was built, and remembers why not otherwise.

Three states, read by moe_kernels.backends (backends() says which ops run the reference and why):
  loaded      LOADED is True: the C++ (and, in a CUDA build, CUDA) kernels are registered.
  not built   no moe_kernels/_C*.so (a source checkout before `make build`): every op runs the
              pure-PyTorch reference, quietly: that is what a tree without a build is for.
  broken      the .so is there but does not load, typically built against another torch than this
              one (a CUDA build under a CPU torch: "libc10_cuda.so: cannot open shared object file";
              another torch release: undefined symbols). `import moe_kernels` warns once with the
              reason, since every op would otherwise run the reference without a word.

MOE_KERNELS_REQUIRE_EXTENSION=1 turns both "not built" and "broken" into an ImportError at import
(`make test` and CI set it: they must test the kernels, not the fallback).
"""

import importlib
import importlib.util
import os
import warnings

import torch

LOADED = False
# Why the extension did not load ("" when it did): the loader's own message for a broken build.
LOAD_ERROR = ""
# True when a build of the extension exists beside the package (loaded or not).
BUILT = False
REQUIRE_VARIABLE = "MOE_KERNELS_REQUIRE_EXTENSION"


class ExtensionWarning(RuntimeWarning):
    """The extension moe_kernels._C exists but did not load: every op runs the reference."""


def _torch_build() -> str:
    cuda = torch.version.cuda
    return f"torch {torch.__version__} ({f'CUDA {cuda}' if cuda else 'CPU'} build)"


def _load() -> None:
    global LOADED, LOAD_ERROR, BUILT
    try:
        spec = importlib.util.find_spec("moe_kernels._C")
    except (ImportError, ValueError):
        spec = None
    BUILT = spec is not None
    if not BUILT:
        LOAD_ERROR = "not built: no moe_kernels/_C*.so beside the package (make build, or pip install the package)"
        if os.environ.get(REQUIRE_VARIABLE) == "1":
            raise ImportError(f"moe_kernels: {REQUIRE_VARIABLE}=1 but the extension is {LOAD_ERROR}")
        return
    try:
        importlib.import_module("moe_kernels._C")
    except (ImportError, OSError) as exc:
        LOAD_ERROR = str(exc) or type(exc).__name__
        message = (
            f"moe_kernels: the compiled extension {spec.origin} did not load: {LOAD_ERROR}. Every op runs the "
            f"pure-PyTorch reference instead of its kernels. It was most likely built against another torch "
            f"than this {_torch_build()}: rebuild it against this one (`pip install --no-build-isolation .` "
            f"from the source, or `make build`). {REQUIRE_VARIABLE}=1 makes this an ImportError."
        )
        if os.environ.get(REQUIRE_VARIABLE) == "1":
            raise ImportError(message) from exc
        warnings.warn(message, ExtensionWarning, stacklevel=2)
        return
    LOADED = True


_load()


def defines(op: str) -> bool:
    """True when the loaded extension defines torch.ops.moe_kernels.<op>. A build older than the
    Python package lacks newer ops: they then run on the reference instead of failing at import
    (rebuild with `make build` to get their kernels)."""
    return LOADED and hasattr(torch.ops.moe_kernels, op)


def has_kernel(op: str, dispatch_key: str) -> bool:
    """True when the extension registered a kernel for torch.ops.moe_kernels.<op> on the key."""
    # The dispatcher's answer costs 3 us (it parses the name), more than the op at a few tokens,
    # and cannot change: the extension registers its kernels when it loads, before any call.
    known = _KERNELS.get((op, dispatch_key))
    if known is None:
        known = _KERNELS[op, dispatch_key] = defines(op) and torch._C._dispatch_has_kernel_for_dispatch_key(
            f"moe_kernels::{op}", dispatch_key
        )
    return known


_KERNELS: dict[tuple[str, str], bool] = {}
