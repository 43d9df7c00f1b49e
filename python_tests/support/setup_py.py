"""setup.py loaded as a module (its helpers; setup() itself runs only under __main__), for the
tests of the build configuration."""

import functools
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def load():
    spec = importlib.util.spec_from_file_location("moe_kernels_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
