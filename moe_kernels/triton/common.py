"""Triton helpers shared by the kernels: the ranking order every backend uses, the launch shape of
the row kernels, and the device every launch runs on."""

import functools
import re

import torch
import triton
import triton.language as tl

from moe_kernels import backends

# Smallest int64: below every rank pair, used to retire selected or padding elements.
NO_PAIR = tl.constexpr(-9223372036854775808)


@triton.jit
def to_float32(x):
    """x (float32 / float16 / bfloat16) as float32, exactly. bfloat16 is float32's upper half, so
    its bits shifted up are the float32: the same instruction on the GPU as the conversion, and
    exact in the interpreter too, whose bfloat16 -> float32 conversion (triton 3.7,
    runtime/interpreter.py _convert_float) renormalises a denormal's mantissa without its
    exponent, turning e.g. 1.0e-39 into 4.4e-39 (so denormal scores ranked wrongly on CPU)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


# Whether the kernels run in Triton's interpreter (fixed for the process: triton.jit reads it when
# a kernel is defined, too).
INTERPRETED = tl.constexpr(backends.triton_interpreting())


@triton.jit
def from_float32(x, dtype: tl.constexpr):
    """x (float32) in `dtype` (float32 / float16 / bfloat16), rounded to nearest even, as torch's
    conversion (a finite value past bfloat16's range becomes inf, NaN a quiet NaN). On a GPU
    bfloat16 is the hardware's conversion (cvt.rn, two values an instruction); in the interpreter
    it is rounded here, on its bits: the interpreter's float32 -> bfloat16 conversion does not
    round to nearest (about half of random values came out one ulp off torch's)."""
    if dtype == tl.bfloat16 and INTERPRETED:
        bits = x.to(tl.int32, bitcast=True)
        upper = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        upper = tl.where(x != x, 0x7FC0, upper)
        return upper.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


def token_stride_unspecialized(kernel):
    """`kernel` (a @triton.jit function with a `stride_t` argument) compiled apart with stride_t
    never specialized, for launches where stride_t is 1 (a [T, 1] column, after batchwise_mask's
    _expert_contiguous). Triton specializes an integer argument equal to 1, and with stride_t
    known to be 1 the compiler lays the [tokens, experts] tiles out token-major, where they are
    otherwise expert-major; the token-major layout is a different program on the GPU
    (batchwise_mask's radix kernels went wrong in it: see there). Without the specialization the
    tiles keep the layout a row-major launch gets."""
    return triton.jit(kernel.fn, do_not_specialize=["stride_t"])


# Triton from 3.7 lays out a load whose axes are equally contiguous (a gather: its addresses are
# data) last axis first; 3.6 laid it out otherwise. Where the gather's layout is not its
# neighbours', each conversion is a trip through shared memory behind barriers, so a kernel with a
# gather in a 2-D tile takes the orientation its triton compiles well (topk_router.choice_rows,
# capacity_positions' packed S_MAJOR positions); python_tests/bench/test_triton_sass.py bounds
# their barriers under 3.6, 3.7 and 3.9.
GATHERS_LAST_AXIS_FIRST = tuple(int(p) for p in re.match(r"(\d+)\.(\d+)", triton.__version__).groups()) >= (3, 7)

# Smallest int32: below every value_key, used to retire selected or padding elements.
NO_KEY = tl.constexpr(-2147483648)


@triton.jit
def value_key(x):
    """int32 keys ordering float32 values as every backend ranks them, without the index: NaN
    above +inf, -0.0 equal to +0.0, every key above NO_KEY. value_of(value_key(x)) is x (-0.0
    back as +0.0, any NaN as one NaN)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0 into +0
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def value_of(key):
    """The float32 a value_key was built from; NO_KEY (an empty row) gives 0.0."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return tl.where(key == NO_KEY, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def rank_pair(x, cols):
    """int64 keys ordering (value, index) as every backend does: larger value, then lower index.

    x: float32 tensor; cols: int32 tensor broadcastable to x (the expert/token index).
    NaN ranks above +inf; -0.0 ties with +0.0. Mirrors csrc/include/moe_kernels/common.h.
    """
    return (value_key(x).to(tl.int64) << 32) | (4294967295 - cols.to(tl.int64))


@triton.jit
def take_best_key(vk, cols, BIG: tl.constexpr):
    """One selection round over int32 value keys [BLOCK_R, BLOCK_W] (value_key, NO_KEY where
    retired): (the best key, its index, the keys with it retired). The largest key, then the
    lowest index holding it: the order of rank_pair in two 32-bit row reductions where a 64-bit
    one costs about twice as many instructions and shuffles. BIG: above every index."""
    best = tl.max(vk, axis=1)
    idx = tl.min(tl.where(vk == best[:, None], cols[None, :], BIG), axis=1)
    return best, idx, tl.where(cols[None, :] == idx[:, None], NO_KEY, vk)


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def value_at(x, cols, idx):
    """x[r, idx[r]] of each row of a [BLOCK_R, BLOCK_W] float32 tile, its bits exactly: the bits
    of the one entry at idx or-reduced with zeros, an integer reduction (one REDUX where a row
    spans a warp) where a masked float sum took a shuffle and an add a step."""
    bits = tl.where(cols[None, :] == idx[:, None], x.to(tl.int32, bitcast=True), 0)
    return tl.reduce(bits, 1, _bitwise_or).to(tl.float32, bitcast=True)


# 16-bit logits ranked by themselves fit the value and the index in one int32 key (packed_key):
# one 32-bit row reduction a round. Needs index < 2^16 (topk_router.MAX_EXPERTS asserts it).
@triton.jit
def packed_key(raw, x, cols):
    """int32 keys ordering (value, index) of float16 / bfloat16 values `raw` (x: their float32
    widening) exactly as rank_pair orders x (each format's order is its float32 value's): the
    16-bit value_key in the upper half, 65535 - index in the lower. Every key is above NO_KEY."""
    if raw.dtype == tl.bfloat16:
        # x's bits are the bfloat16's over 16 zeros: value_key's sign flip (as a shift and one
        # three-input logic op, not a compare and a select) leaves the 16-bit key in the upper
        # half and 0 or 0xFFFF below, which the index replaces; about 6 instructions an entry
        # where the 16-bit form below took 10 (sm_90 SASS).
        bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0 into +0
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        key = tl.where(x != x, 0x7FFFFFFF, key)
        return (key & -65536) | (65535 - cols)
    bits = raw.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
    bits = tl.where(bits == -32768, 0, bits)  # -0 -> +0
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFF)
    key = tl.where(x != x, 0x7FFF, key)
    return (key << 16) | (65535 - cols)


@triton.jit
def packed_index(key):
    """The index in a packed_key, int32."""
    return 65535 - (key & 65535)


@triton.jit
def packed_value(key, dtype: tl.constexpr):
    """The float32 value in a packed_key of `dtype` (float16 / bfloat16) values: exactly the
    widened value (-0.0 as +0.0, any NaN as one NaN)."""
    half = key >> 16  # arithmetic: the signed 16-bit value key
    bits = tl.where(half >= 0, half, half ^ 0x7FFF)
    return to_float32(bits.to(tl.int16).to(dtype, bitcast=True))


@triton.jit
def pair_index(pair):
    """The index encoded in a rank pair, as int32."""
    return (4294967295 - (pair & 4294967295)).to(tl.int32)


@triton.jit
def pair_value(pair):
    """The float32 a rank pair was built from (rank_pair inverted, exactly; -0.0 comes back as
    +0.0 and any NaN as one NaN); NO_PAIR (an empty row) gives 0.0."""
    key = (pair >> 32).to(tl.int32)
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return tl.where(pair == NO_PAIR, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def take_best_ranked(pair, cols):
    """The largest remaining rank pair of every row of a [BLOCK_R, BLOCK_W] tile: (the pair, its
    index, the value it ranks, decoded from it, the pairs with it retired to NO_PAIR)."""
    best = tl.max(pair, axis=1)
    idx = pair_index(best)
    return best, idx, pair_value(best), tl.where(cols[None, :] == idx[:, None], NO_PAIR, pair)


@triton.jit
def _exp2_small(v):
    """2^v of a float32 tensor with |v| <= 1: the hardware's ex2.approx.ftz on a GPU (no subnormal
    comes in or out here, so flushing changes nothing; tl.exp2's non-flushing form rescales
    subnormal arguments: three more instructions an entry), numpy's in the interpreter."""
    if INTERPRETED:
        return tl.exp2(v)
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [v], tl.float32, True, 1)


@triton.jit
def _reciprocal_1_2(v):
    """1 / v of a float32 tensor in [1, 2] (or NaN) to an ulp: the hardware's rcp.approx on a GPU
    (`/` is div.full, whose range checks for huge and subnormal divisors cost six more
    instructions), exact in the interpreter."""
    if INTERPRETED:
        return 1.0 / v
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [v], tl.float32, True, 1)


# 1.5 * 2^23: a float32 of magnitude below 2^22 plus this is rounded to an integer n, which the
# sum's low mantissa bits hold (0x4B400000 + n).
_ROUNDING_SHIFT = tl.constexpr(12582912.0)


@triton.jit
def exp_negated(a):
    """e^-a of a float32 tensor in [0, 104] (or NaN) to a few float32 ulps, down to the
    subnormals. tl.exp computes 2^(x log2 e) in hardware; rounding x log2 e at |x| ~ 85 alone costs
    ~3e-6 relative (the product's ulp is 2^-17), so the tail of a sigmoid score missed the 1e-6
    relative accuracy every backend holds them to. Here: -a = n ln 2 + r (n an integer, ln 2 in
    two parts so r is exact), e^r in hardware (|r| <= 0.35: its product's rounding is ~6e-8),
    times 2^(n + 64) built from the rounding sum's bits (n + 64 >= -87: a normal), times 2^-64
    (one rounding where the result is subnormal)."""
    t = a * -1.4426950408889634 + _ROUNDING_SHIFT
    n = t - _ROUNDING_SHIFT
    r = -a - n * 0.693145751953125 - n * 1.428606765330187e-06  # ln 2 = hi + lo, hi exact in 16 bits
    # (0x4B400000 + n) << 23 keeps n's low 9 bits as the exponent field: (n + 191) << 23 is
    # 2^(n + 64) for n in [-151, 0]; unsigned, so the shift and the sum wrap in the interpreter too.
    scale_bits = (t.to(tl.uint32, bitcast=True) << 23) + 0x5F800000
    return _exp2_small(r * 1.4426950408889634) * scale_bits.to(tl.float32, bitcast=True) * 5.421010862427522e-20


# torch.sigmoid(x) = 1 / (1 + e^-x) in float32 is exactly 0 below this float (-0x1.62e42ep6): e^-x
# overflows there. csrc/cpu/score/vec_math.h kSigmoidLastNonzero, csrc/include/moe_kernels/topk_router_row.h.
SIGMOID_LAST_NONZERO = tl.constexpr(-88.72283172607422)


@triton.jit
def sigmoid_accurate(x):
    """torch.sigmoid of a float32 tensor: relative error of a few ulps also in the far negative
    tail (e^x / (1 + e^x) there, with exp_negated), where scores are returned as weights, down
    to the denormals; exactly 0 below SIGMOID_LAST_NONZERO as torch's (where the exponential alone
    kept denormals down to x = -104, which rank differently from torch's zeros). NaN stays NaN;
    +-inf give 1 and 0."""
    # |x| <= 104 (e^-104 is below the subnormals); NaN kept, so it reaches the result.
    e = exp_negated(tl.minimum(tl.abs(x), 104.0, propagate_nan=tl.PropagateNan.ALL))
    # The numerator chosen before one product with the reciprocal, so both sides share it.
    y = tl.where(x >= 0, 1.0, e) * _reciprocal_1_2(1.0 + e)
    return tl.where(x < SIGMOID_LAST_NONZERO, 0.0, y)


def row_tile_config(num_rows: int, row_width: int, tile: int, per_thread: int):
    """Launch shape of the kernels that hold whole rows in registers: (grid, BLOCK_ROWS,
    BLOCK_WIDTH, num_warps). BLOCK_WIDTH is row_width rounded up to a power of two; a program takes
    as many rows as fit in `tile` elements (at least one), and enough warps that each thread holds
    at most `per_thread` elements (at most 16 warps), which the AOT test checks against spills."""
    block_w = triton.next_power_of_2(max(row_width, 1))
    block_r = max(1, min(tile // block_w, triton.next_power_of_2(max(num_rows, 1))))
    num_warps = min(16, max(1, block_r * block_w // (32 * per_thread)))
    return (triton.cdiv(num_rows, block_r),), block_r, block_w, num_warps


def on_tensor_device(launcher):
    """Decorator of every function that launches a kernel (python_tests/backends/test_triton_launch_device.py
    checks): runs it with the current CUDA device set to the device of its first tensor argument.

    A Triton launch goes to the current device and its current stream, not the tensors' device, so
    inputs on cuda:1 while cuda:0 is current would run on the wrong GPU. Under TRITON_INTERPRET=1
    the tensors are on the CPU: nothing is set. Sits under @torch.library.custom_op (the schema is
    inferred through functools.wraps)."""

    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is None or tensor.device.type != "cuda":
            return launcher(*args, **kwargs)
        with torch.cuda.device(tensor.device):
            return launcher(*args, **kwargs)

    return launch
