"""The Triton interpreter's reductions and scans by a bitwise or max combine, in numpy (the
interpreter pass only: conftest installs it when TRITON_INTERPRET=1).

triton's interpreter runs tl.sum, tl.max, tl.cumsum and their kind with numpy, but any other
combine function (`tl.reduce(x, axis, fn)`, `tl.associative_scan`) through `generic_reduce` /
`generic_scan`: a Python loop over every element, which wraps each one in a tl.tensor and calls
the combine on it. tl.sort is such a loop: its bitonic network's compare-and-swap is an xor_sum
(triton.language.standard._xor_combine) at every step, so the sorted blocks of
capacity_positions (1024 choices a block) spent nearly all of their interpreter time in it; the
router's `value_at` or-reduces a row's bits the same way, and the sorted blocks scan with a max.

`install()` sends those combines to the numpy ufunc that computes the same thing in one call:
xor and or (`np.bitwise_xor` / `np.bitwise_or`, exact on integers in any order: associative and
commutative), and an integer max scan (`np.maximum.accumulate`; a float max is left to the
generic scan, whose NaN handling is tl.maximum's). The combines are named by module and name
(REDUCE_COMBINES, SCAN_COMBINES), so a kernel's own combine of another meaning is never taken for
one. Everything else runs as before. Installed only under the triton releases whose interpreter
this was checked against (interpreter_device_calls.CHECKED, as that patch);
ops/test_interpreter_reductions.py checks it against the generic loop.
"""

from __future__ import annotations

import contextlib

import numpy as np
from interpreter_device_calls import pinned_interpreter  # the same pinned triton (its CHECKED)

STATS = {"reduce": 0, "scan": 0}  # reductions and scans done in numpy (the test reads it)

# (module, name) of a combine function -> the numpy ufunc of the same elementwise operation.
REDUCE_COMBINES = {
    ("triton.language.standard", "_xor_combine"): np.bitwise_xor,
    ("triton.language.standard", "_or_combine"): np.bitwise_or,
    ("moe_kernels.triton.common", "_bitwise_or"): np.bitwise_or,
}
SCAN_COMBINES = {
    ("moe_kernels.triton.capacity_positions", "_maximum"): np.maximum,
}


def _ufunc(combine_fn, table, data):
    """The ufunc for this combine on integer data, or None (the generic loop then)."""
    fn = getattr(combine_fn, "fn", None)
    if fn is None or not np.issubdtype(data.dtype, np.integer):
        return None
    return table.get((getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)))


def install() -> bool:
    """Installs the numpy paths into triton's interpreter; False (and nothing changed) where its
    internals are not the ones this was written against."""
    interpreter = pinned_interpreter(("ReduceOps", "ScanOps"))
    if interpreter is None:
        return False
    if getattr(interpreter, "_moe_kernels_reductions", False):
        return True
    reduce_impl = interpreter.ReduceOps.apply_impl
    scan_impl = interpreter.ScanOps.apply_impl

    def reduce_apply_impl(self, input):
        ufunc = _ufunc(self.combine_fn, REDUCE_COMBINES, input[0].handle.data) if len(input) == 1 else None
        if ufunc is None:
            return reduce_impl(self, input)
        STATS["reduce"] += 1
        # axis None: over every element, a scalar (keep_dims: ones of the input's rank), as the
        # generic loop gives.
        out = ufunc.reduce(input[0].handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(out, input[0].dtype)

    def scan_apply_impl(self, input):
        ufunc = _ufunc(self.combine_fn, SCAN_COMBINES, input[0].handle.data) if len(input) == 1 else None
        if ufunc is None:
            return scan_impl(self, input)
        STATS["scan"] += 1
        data = input[0].handle.data
        if self.reverse:
            data = np.flip(data, axis=self.axis)
        out = ufunc.accumulate(data, axis=self.axis)
        if self.reverse:
            out = np.flip(out, axis=self.axis)
        return [self.to_tensor(out, input[0].dtype)]

    interpreter.ReduceOps.apply_impl = reduce_apply_impl
    interpreter.ScanOps.apply_impl = scan_apply_impl
    interpreter._moe_kernels_reductions = (reduce_impl, scan_impl)
    return True


@contextlib.contextmanager
def generic_only():
    """Inside, the interpreter's own reductions and scans (what the test compares with)."""
    from triton.runtime import interpreter

    fast = interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl
    interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl = interpreter._moe_kernels_reductions
    try:
        yield
    finally:
        interpreter.ReduceOps.apply_impl, interpreter.ScanOps.apply_impl = fast
