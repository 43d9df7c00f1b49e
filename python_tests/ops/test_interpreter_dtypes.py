"""The interpreter pass's table of numpy dtypes (python_tests/support/interpreter_dtypes.py, installed
by conftest): under the pinned triton it gives the original's dtype for every scalar type, block
and pointer, fails as the original on a type it has none for, and asks the original once a type."""

import interpreter_dtypes
import pytest

from moe_kernels import backends

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not backends.triton_interpreting(), reason="the interpreter pass's patching"),
]

triton = pytest.importorskip("triton")
tl = triton.language

SCALARS = [
    tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64,
    tl.float16, tl.bfloat16, tl.float32, tl.float64,
    tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15,
]  # fmt: skip


def _original():
    from triton.runtime import interpreter

    return interpreter, interpreter._moe_kernels_dtypes


def test_installed_under_this_triton():
    # Fails under a triton the table was not checked against (interpreter_device_calls.CHECKED):
    # the pass is still right there, only slower. Read that triton's _get_np_dtype and add its
    # release once the wrapper fits it.
    assert interpreter_dtypes.install()
    interpreter, original = _original()
    assert interpreter._get_np_dtype is not original
    assert interpreter._get_np_dtype.__qualname__ == "install.<locals>.np_dtype"


def test_dtypes_as_the_interpreter_stores_them():
    """Independent of the original: bool for int1, the integer and float types as themselves,
    bfloat16 as uint16 and the float8 types as uint8 (their bits), pointers as uint64."""
    import numpy as np

    interpreter, _ = _original()
    expected = {tl.int1: np.bool_, tl.bfloat16: np.uint16, tl.float16: np.float16, tl.float32: np.float32}
    expected.update({tl.float64: np.float64, tl.int8: np.int8, tl.uint32: np.uint32, tl.int64: np.int64})
    expected.update(dict.fromkeys(SCALARS[-5:], np.uint8))  # the float8 types
    for tt, np_type in expected.items():
        for t in (tt, tl.block_type(tt, [8])):
            assert interpreter._get_np_dtype(t) == np.dtype(np_type), t
        assert interpreter._get_np_dtype(tl.pointer_type(tt)) == np.dtype(np.uint64)
        assert interpreter._get_np_dtype(tl.block_type(tl.pointer_type(tt), [8])) == np.dtype(np.uint64)


@pytest.mark.parametrize("scalar", SCALARS, ids=str)
def test_same_dtype_as_the_original(scalar):
    interpreter, original = _original()
    types = [
        scalar,
        tl.block_type(scalar, [4]),
        tl.block_type(scalar, [2, 8]),
        tl.pointer_type(scalar),
        tl.pointer_type(scalar, const=True),
        tl.block_type(tl.pointer_type(scalar), [16]),
    ]
    for tt in types:
        assert interpreter._get_np_dtype(tt) == original(tt), tt
        assert interpreter._get_np_dtype(tt) == original(tt), tt  # from the table the second time


def test_a_type_without_a_dtype_fails_as_in_the_original():
    interpreter, original = _original()
    for tt in (tl.void, tl.block_type(tl.void, [4])):
        with pytest.raises(KeyError):
            original(tt)
        with pytest.raises(KeyError):
            interpreter._get_np_dtype(tt)


def test_the_original_is_asked_once_a_scalar_type():
    interpreter, _ = _original()
    interpreter._get_np_dtype(tl.float32)  # in the table from here on
    misses = interpreter_dtypes.STATS["misses"]
    for shape in ([1], [8], [4, 4]):
        interpreter._get_np_dtype(tl.block_type(tl.float32, shape))
    interpreter._get_np_dtype(tl.float32)
    assert interpreter_dtypes.STATS["misses"] == misses
