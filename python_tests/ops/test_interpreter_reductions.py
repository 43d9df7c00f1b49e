"""The interpreter pass's numpy reductions and scans (python_tests/support/interpreter_reductions.py,
installed by conftest): installed under the pinned triton, the same values, dtypes and shapes as
triton's generic element-by-element loop for every axis, keep_dims and direction, tl.sort through
them equal to torch.sort, and combines they do not know (a float max scan) left to the loop."""

import interpreter_reductions
import pytest
import torch

from moe_kernels import backends

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not backends.triton_interpreting(), reason="the interpreter pass's patching"),
]

triton = pytest.importorskip("triton")
tl = triton.language


def test_installed_under_this_triton():
    # Fails under a triton this was not checked against (interpreter_device_calls.CHECKED): the
    # pass is still right there, only slower. Read that triton's ReduceOps / ScanOps and add it.
    from triton.runtime import interpreter

    assert interpreter_reductions.install()
    assert interpreter.ReduceOps.apply_impl.__qualname__ == "install.<locals>.reduce_apply_impl"
    assert interpreter.ScanOps.apply_impl.__qualname__ == "install.<locals>.scan_apply_impl"


from moe_kernels.triton.capacity_positions import _maximum  # noqa: E402
from moe_kernels.triton.common import _bitwise_or  # noqa: E402


@triton.jit
def reduce_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr, KEEP: tl.constexpr,
                  WHICH: tl.constexpr):  # fmt: skip
    # Each combine the numpy path knows, reduced over AXIS (None: all), then broadcast back to
    # [R, C] to store (without keep_dims, the reduced axis put back first).
    offsets = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + offsets)
    if WHICH == 0:
        y = tl.xor_sum(x, AXIS, keep_dims=KEEP)
    elif WHICH == 1:
        y = tl.reduce_or(x, AXIS, keep_dims=KEEP)
    else:
        y = tl.reduce(x, AXIS, _bitwise_or, keep_dims=KEEP)
    if not KEEP and AXIS is not None:
        y = tl.expand_dims(y, AXIS)
    tl.store(out_ptr + offsets, tl.broadcast_to(y, (R, C)))


@triton.jit
def scan_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr, REVERSE: tl.constexpr):
    offsets = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, tl.associative_scan(x, AXIS, _maximum, reverse=REVERSE))


def fast_and_generic(kernel, x, counter, **constexprs):
    """The kernel's output through the numpy path (which must be taken) and through the generic loop."""
    fast, slow = torch.empty_like(x), torch.empty_like(x)
    before = interpreter_reductions.STATS[counter]
    kernel[(1,)](x, fast, *x.shape, **constexprs)
    assert interpreter_reductions.STATS[counter] > before
    with interpreter_reductions.generic_only():
        kernel[(1,)](x, slow, *x.shape, **constexprs)
    return fast, slow


INTS = [torch.int32, torch.int64, torch.int16, torch.uint8]


def random_ints(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["xor_sum", "reduce_or", "bitwise_or"])
@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_reduce_matches_the_generic_loop(which, dtype):
    for shape in [(1, 1), (1, 8), (4, 2), (8, 16)]:  # block shapes: powers of 2
        x = random_ints(shape, dtype, seed=shape[1])
        for axis in (None, 0, 1):
            for keep in (False, True):
                if axis is None and keep:
                    continue  # triton's generic loop fails there (a rank mismatch): below
                fast, slow = fast_and_generic(reduce_kernel, x, "reduce", AXIS=axis, KEEP=keep, WHICH=which)
                assert torch.equal(fast, slow), (shape, axis, keep)
        # Over every element with keep_dims, where the generic loop itself fails: the same value
        # as without keep_dims.
        kept = torch.empty_like(x)
        reduce_kernel[(1,)](x, kept, *x.shape, AXIS=None, KEEP=True, WHICH=which)
        assert torch.equal(kept, fast_and_generic(reduce_kernel, x, "reduce", AXIS=None, KEEP=False, WHICH=which)[1])


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("dtype", INTS[:2], ids=str)
def test_integer_max_scan_matches_the_generic_loop(reverse, dtype):
    for shape in [(1, 1), (1, 16), (4, 8)]:
        x = torch.randint(-50, 50, shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        for axis in (0, 1):
            fast, slow = fast_and_generic(scan_kernel, x, "scan", AXIS=axis, REVERSE=reverse)
            assert torch.equal(fast, slow), (shape, axis)


def test_float_scan_stays_in_the_generic_loop():
    # tl.maximum's NaN rule is not np.maximum's: a float max scan keeps the generic loop.
    x = torch.tensor([[1.0, float("nan"), 0.5, 2.0]])
    out = torch.empty_like(x)
    before = interpreter_reductions.STATS["scan"]
    scan_kernel[(1,)](x, out, 1, 4, AXIS=1, REVERSE=False)
    assert interpreter_reductions.STATS["scan"] == before


@triton.jit
def sort_rows(x_ptr, out_ptr, N: tl.constexpr, DESCENDING: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + row * N + cols)
    tl.store(out_ptr + row * N + cols, tl.sort(x, descending=DESCENDING))


@pytest.mark.parametrize("descending", [False, True], ids=["ascending", "descending"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_sort_through_the_numpy_xor(descending, dtype):
    # tl.sort's compare-and-swap steps are xor_sums: through the numpy path, still torch.sort.
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-1000, 1000, (3, 64), generator=g).to(dtype)
    x[0, :32] = 7  # ties
    out = torch.empty_like(x)
    before = interpreter_reductions.STATS["reduce"]
    sort_rows[(3,)](x, out, N=64, DESCENDING=descending)
    assert interpreter_reductions.STATS["reduce"] > before
    assert torch.equal(out, torch.sort(x, dim=1, descending=descending).values)
