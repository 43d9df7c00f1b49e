"""The Triton helpers every kernel shares (moe_kernels/triton/common.py), on their own: a kernel
that only applies one helper to a tensor, compared bit for bit with torch. Triton cases (the
interpreter on CPU tensors, and the GPU)."""

import pytest
import torch

from moe_kernels import backends

if backends.triton_importable():
    import triton
    import triton.language as tl

    from moe_kernels.triton import topk_router
    from moe_kernels.triton.common import (
        from_float32,
        packed_index,
        packed_key,
        packed_value,
        rank_pair,
        take_best_key,
        take_best_ranked,
        to_float32,
        value_key,
        value_of,
    )

    @triton.jit
    def convert_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < N, other=0.0)
        tl.store(y_ptr + i, from_float32(x, y_ptr.dtype.element_ty), mask=i < N)

    @triton.jit
    def keys_kernel(
        raw_ptr, cols_ptr, packed_ptr, pair_ptr, index_ptr, value_ptr, vkey_ptr, vvalue_ptr, N, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < N
        raw = tl.load(raw_ptr + i, mask=ok, other=0.0)
        cols = tl.load(cols_ptr + i, mask=ok, other=0)
        x = to_float32(raw)
        tl.store(pair_ptr + i, rank_pair(x, cols), mask=ok)
        tl.store(vkey_ptr + i, value_key(x), mask=ok)
        tl.store(vvalue_ptr + i, value_of(value_key(x)), mask=ok)
        if raw_ptr.dtype.element_ty != tl.float32:
            key = packed_key(raw, x, cols)
            tl.store(packed_ptr + i, key, mask=ok)
            tl.store(index_ptr + i, packed_index(key), mask=ok)
            tl.store(value_ptr + i, packed_value(key, raw_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def rounds_kernel(x_ptr, pair_idx_ptr, key_idx_ptr, key_best_ptr, W, ROUNDS: tl.constexpr, BLOCK_W: tl.constexpr):
        """ROUNDS selections over each row of a [rows, W] float32 tile, by rank pairs and by
        take_best_key: the indices each picks and the value keys the latter decodes."""
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK_W)
        ok = cols < W
        x = tl.load(x_ptr + r * W + cols, mask=ok, other=0.0)[None, :]
        pairs = tl.where(ok[None, :], rank_pair(x, cols[None, :]), -9223372036854775808)
        keys = tl.where(ok[None, :], value_key(x), -2147483648)
        for s in tl.static_range(ROUNDS):
            _b, idx, _v, pairs = take_best_ranked(pairs, cols)
            best, kidx, keys = take_best_key(keys, cols, BLOCK_W)
            tl.store(pair_idx_ptr + r * ROUNDS + s + tl.arange(0, 1), idx)
            tl.store(key_idx_ptr + r * ROUNDS + s + tl.arange(0, 1), kidx)
            tl.store(key_best_ptr + r * ROUNDS + s + tl.arange(0, 1), best)

    @triton.jit
    def runs_kernel(keys_ptr, runs_ptr, heads_ptr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, RV: tl.constexpr):
        """topk_router.sorted_runs of a [BLOCK_T, BLOCK_E] int32 tile: run i of each thread's RV
        entries (cols RV * j to RV * j + RV - 1) at runs[row, RV * j + i]; then BLOCK_E rounds of
        take_head, each row's best at heads[row, s] (for rows of unique keys)."""
        rows = tl.arange(0, BLOCK_T)[:, None]
        keys = tl.load(keys_ptr + rows * BLOCK_E + tl.arange(0, BLOCK_E)[None, :])
        run = topk_router.sorted_runs(keys, BLOCK_T, BLOCK_E, RV)
        lanes = tl.arange(0, BLOCK_E // RV)[None, :]
        for i in tl.static_range(RV):
            tl.store(runs_ptr + rows * BLOCK_E + lanes * RV + i, run[i])
        for s in tl.static_range(BLOCK_E):
            best, run = topk_router.take_head(run, RV)
            tl.store(heads_ptr + rows * BLOCK_E + s, best[:, None])


def _bf16_edge_values() -> torch.Tensor:
    """float32 values over bfloat16's whole range, its rounding ties and its limits."""
    # From float32's subnormals (2^-149) to past bfloat16's largest finite (2^127 and above).
    wide = torch.randn(8192, generator=torch.Generator().manual_seed(0)) * torch.logspace(-150, 127, 8192, base=2)
    bits = [
        0x7F7FFFFF,  # float32 max: rounds past bfloat16's max to inf
        0x7F7F7FFF,  # just below the tie that overflows
        0x3F808000,  # 1 + 2^-8: a tie, rounds to even (down)
        0x3F818000,  # a tie that rounds up
        0x00000001,  # the smallest subnormal
        0x007FFFFF,  # the largest subnormal: rounds up to the smallest normal
        0x7FFFFFFF,  # a NaN whose rounding would carry into the sign
        0x7FC00001,
        -1,  # 0xFFFFFFFF: a negative NaN whose rounding would wrap to zero
        -2139095041,  # 0x807FFFFF: the largest negative subnormal
    ]
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
    return torch.cat([wide, torch.tensor(bits, dtype=torch.int32).view(torch.float32), special])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_float32_rounds_as_torch(backend, dtype):
    """from_float32 is torch's float32 -> dtype conversion (nearest even), NaN as NaN: the
    interpreter's own bfloat16 conversion put about half of random values one ulp off."""
    if "triton" not in backend:
        pytest.skip("a Triton helper")
    x = _bf16_edge_values().to(backend.device)
    y = torch.empty(x.shape, dtype=dtype, device=backend.device)
    convert_kernel[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = x.to(dtype)
    ints = torch.int32 if dtype == torch.float32 else torch.int16
    same = (y.view(ints) == want.view(ints)) | (y.isnan() & want.isnan())
    assert same.all(), (x[~same][:8], y[~same][:8], want[~same][:8])


def _every_pattern(dtype) -> torch.Tensor:
    """Every 16-bit pattern of `dtype` (float16 / bfloat16): NaNs of both signs, +-0, +-inf,
    the subnormals."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_value_and_packed_keys_order_as_rank_pair(backend, dtype):
    """value_key is rank_pair's upper half and decodes back to the value; packed_key (16-bit
    logits, the router's one-reduction rounds) orders every pattern of its format, at every
    index, as rank_pair orders the widened value, and decodes back to the index and the value
    (-0 as +0, NaN as NaN)."""
    if "triton" not in backend:
        pytest.skip("a Triton helper")
    if dtype == torch.float32:
        raw = torch.cat([_bf16_edge_values(), torch.randn(4096, generator=torch.Generator().manual_seed(1))])
    else:
        raw = _every_pattern(dtype)
    n = raw.numel()
    # Indices over the kernel's range (E <= 2048), ties of equal values at neighbouring indices.
    cols = torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    raw, cols = raw.to(backend.device), cols.to(backend.device)
    out = {
        name: torch.empty(n, dtype=dt, device=backend.device)
        for name, dt in [
            ("packed", torch.int32), ("pair", torch.int64), ("index", torch.int32), ("value", torch.float32),
            ("vkey", torch.int32), ("vvalue", torch.float32),
        ]
    }  # fmt: skip
    block = 1024
    keys_kernel[(triton.cdiv(n, block),)](raw, cols, *out.values(), n, BLOCK=block)
    out = {k: v.cpu() for k, v in out.items()}
    raw, cols = raw.cpu(), cols.cpu()
    x = raw.float()
    assert torch.equal(out["vkey"].long(), out["pair"] >> 32)
    # The router's rounds over value keys pack an index into their lowest log2(BLOCK_E) bits and
    # check that the upper bits of a row's k + 1 best differ: no real key's upper bits may be
    # NO_KEY's (padding, ineligible groups, the NO_KEY its sorted runs shift in).
    index_bits = topk_router.MAX_EXPERTS.bit_length() - 1
    no_key = topk_router.NO_KEY.value
    assert bool(((out["vkey"] >> index_bits) > (no_key >> index_bits)).all()), "a value key at NO_KEY's upper bits"
    folded = torch.where(x == 0, 0.0, x)  # -0 back as +0
    decoded = out["vvalue"]
    assert torch.equal(decoded.isnan(), x.isnan())
    assert torch.equal(decoded[~x.isnan()].view(torch.int32), folded[~x.isnan()].view(torch.int32))
    if dtype == torch.float32:
        return
    packed, pair = out["packed"].long(), out["pair"]
    order = torch.sort(pair, stable=True).indices  # ascending rank
    p, q = packed[order], pair[order]
    assert bool((p[1:] >= p[:-1]).all()), "packed keys out of rank order"
    assert torch.equal(p[1:] == p[:-1], q[1:] == q[:-1]), "packed keys tie unlike rank pairs"
    assert bool((packed > no_key).all()), "a packed key at NO_KEY, which the sorted runs shift in"
    assert torch.equal(out["index"], cols)
    value = out["value"]
    assert torch.equal(value.isnan(), x.isnan())
    assert torch.equal(value[~x.isnan()].view(torch.int32), folded[~x.isnan()].view(torch.int32))


@pytest.mark.parametrize("width", [5, 32, 100])
def test_take_best_key_rounds_pick_as_rank_pairs(backend, width):
    """take_best_key's two 32-bit reductions pick, round after round, what take_best_ranked's
    64-bit rank pairs pick: on rows of ties (few values), NaN, +-inf and -0."""
    if "triton" not in backend:
        pytest.skip("a Triton helper")
    g = torch.Generator().manual_seed(width)
    rows, rounds = 64, min(width, 8)
    x = torch.randint(-2, 3, (rows, width), generator=g).float()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    hit = torch.rand(rows, width, generator=g) < 0.3
    x[hit] = special[torch.randint(0, 5, (int(hit.sum()),), generator=g)]
    x = x.to(backend.device)
    picks = [torch.empty(rows * rounds, dtype=torch.int32, device=backend.device) for _ in range(3)]
    rounds_kernel[(rows,)](x, *picks, width, ROUNDS=rounds, BLOCK_W=triton.next_power_of_2(width))
    by_pair, by_key, best = (p.cpu().view(rows, rounds) for p in picks)
    assert torch.equal(by_key, by_pair)
    xs = x.cpu()
    picked = xs.gather(1, by_key.long())
    assert torch.equal(best == 2147483647, picked.isnan()), "a NaN pick's key is not the largest"


@pytest.mark.parametrize("rv", [1, 2, 4, 8])
def test_sorted_runs_sort_each_run_and_take_heads_in_order(backend, rv):
    """The router's sorted_runs sorts each thread's run of rv keys, largest first: on every 0/1
    run (a comparator network that sorts them sorts every input) and on runs of few values
    (ties, NO_KEY, the largest key). Rounds of take_head over rows of unique keys give the row's
    keys in descending order, NO_KEY once all are taken."""
    if "triton" not in backend:
        pytest.skip("a Triton helper")
    no_key = topk_router.NO_KEY.value
    g = torch.Generator().manual_seed(rv)
    binary = ((torch.arange(2**rv)[:, None] >> torch.arange(rv)) & 1).int()  # every 0/1 run
    few = torch.tensor([no_key, -5, 0, 3, 2**31 - 1], dtype=torch.int32)[torch.randint(0, 5, (64, rv), generator=g)]
    width = 32
    runs = torch.cat([binary, few]).reshape(-1)
    t = triton.next_power_of_2(triton.cdiv(runs.numel(), width))
    keys = torch.full((t * width,), no_key, dtype=torch.int32)
    keys[: runs.numel()] = runs
    keys = keys.view(t, width)
    out_runs, heads = torch.empty_like(keys), torch.empty_like(keys)
    keys, out_runs, heads = keys.to(backend.device), out_runs.to(backend.device), heads.to(backend.device)
    runs_kernel[(1,)](keys, out_runs, heads, BLOCK_T=t, BLOCK_E=width, RV=rv)
    want = keys.cpu().view(t, width // rv, rv).sort(dim=2, descending=True).values.view(t, width)
    assert torch.equal(out_runs.cpu(), want)
    # Unique keys: each row a permutation of distinct values, NO_KEY among them.
    unique = torch.stack([torch.randperm(1 << 20, generator=g)[:width] for _ in range(16)]).int() - (1 << 19)
    unique[:, 5] = no_key
    out_runs, heads = torch.empty_like(unique), torch.empty_like(unique)
    unique, out_runs, heads = unique.to(backend.device), out_runs.to(backend.device), heads.to(backend.device)
    runs_kernel[(1,)](unique, out_runs, heads, BLOCK_T=16, BLOCK_E=width, RV=rv)
    assert torch.equal(heads.cpu(), unique.cpu().sort(dim=1, descending=True).values)
