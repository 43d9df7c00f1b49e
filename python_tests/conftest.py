"""Backends under test.

The suite runs twice (see the Makefile's `test` target):
  1. normally: the "torch" and "cpu" backends, the Triton ahead-of-time compiles, nvcc;
  2. under TRITON_INTERPRET=1 with `-m triton`: the Triton kernels on CPU tensors.
TRITON_INTERPRET must be set before triton decorates a kernel, hence a separate process.
"""

import pytest

from moe_kernels import _extension, backends

INTERPRETING = backends.triton_interpreting()


def kernel_backends():
    """The non-reference backends that can run on CPU tensors in this process."""
    if INTERPRETING:
        return ["triton"] if backends.triton_importable() else []
    return ["cpu"] if _extension.LOADED else []


def all_backends():
    return (["torch"] if not INTERPRETING else []) + kernel_backends()


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", all_backends())
    if "kernel_backend" in metafunc.fixturenames:
        metafunc.parametrize("kernel_backend", kernel_backends())


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "triton" in (callspec.params.get("backend"), callspec.params.get("kernel_backend")):
            item.add_marker(pytest.mark.triton)


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs a Triton kernel (needs TRITON_INTERPRET=1 on CPU)")
    config.addinivalue_line("markers", "slow: long-running (paper reproductions)")
