"""The Triton interpreter's numpy dtype of a Triton type, looked up in a table built once (the
interpreter pass only: conftest installs it when TRITON_INTERPRET=1).

triton's interpreter asks `_get_np_dtype(tt_dtype)` at every splat, cast and masked load, and
each call builds its table of 18 numpy dtypes anew, hashing 18 Triton dtypes (536,412 calls in the
batchwise fuzz test). Six batchwise_mask calls on [300, 37] scores took 7.2 s of process time
with the table against 8.0 s without (the Triton op at m = 20, the best of three runs each, the other
interpreter patches installed in both). `install()` puts a
memoizing wrapper in its place: pointers (and blocks of them) are uint64 as there, a block is
stored as its element type, and a scalar type seen before (Triton's scalar types hash and compare
by name) gets the dtype the original gave it, a new one goes to the original.
Installed only under the triton release this was checked against (interpreter_device_calls.CHECKED);
ops/test_interpreter_dtypes.py compares it with the original on every type it knows.
"""

from __future__ import annotations

from interpreter_device_calls import pinned_interpreter  # the same pinned triton (its CHECKED)

STATS = {"misses": 0}  # lookups that went to the original (the test reads it)


def install() -> bool:
    """Installs the memoizing wrapper; False (and nothing changed) where the interpreter has no
    `_get_np_dtype` or triton is not the checked release."""
    interpreter = pinned_interpreter(("_get_np_dtype",))
    if interpreter is None:
        return False
    if getattr(interpreter, "_moe_kernels_dtypes", None) is not None:
        return True
    import numpy as np
    import triton.language as tl

    original = interpreter._get_np_dtype
    pointer = np.dtype(np.uint64)
    table: dict = {}  # scalar Triton type -> numpy dtype

    def np_dtype(tt_dtype):
        # As the original: a block of a type is stored as that type, a pointer as uint64. Only
        # scalar types are looked up: blocks and pointers define __eq__ without __hash__.
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        found = table.get(scalar)
        if found is None:
            STATS["misses"] += 1
            found = table[scalar] = original(scalar)
        return found

    interpreter._get_np_dtype = np_dtype
    interpreter._moe_kernels_dtypes = original
    return True
