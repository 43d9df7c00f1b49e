"""batchwise_mask (eq 18) and threshold_mask (eq 19): every backend against the reference, exactly
m tokens per expert on adversarial input, the expert-choice layout, and bad arguments."""

import contextlib

import pytest
import torch
from shapes import (
    ADVERSARIAL_KINDS,
    BATCHWISE_SHAPES,
    DTYPES,
    SMALL_BATCHWISE_SHAPES,
    adversarial_logits,
    subnormal_values,
)

import moe_kernels
from moe_kernels import reference
from moe_kernels.ops import batchwise_mask, threshold_mask


def run(backend, scores, m, return_indices=True):
    with moe_kernels.use_backend(backend):
        return batchwise_mask(scores, m, return_indices=return_indices)


def shapes_for(backend):
    return SMALL_BATCHWISE_SHAPES if backend == "triton" else BATCHWISE_SHAPES


def check_layout(mask, tokens, m):
    """Exactly m per expert, and the token lists are the mask's columns in ascending order."""
    T, E = mask.shape
    assert mask.dtype == torch.bool and tokens.dtype == torch.int64
    assert tokens.shape == (E, m)
    assert mask.sum(0).tolist() == [m] * E
    if m:
        assert (tokens[:, 1:] > tokens[:, :-1]).all(), "token lists must be strictly ascending"
        rebuilt = torch.zeros(T, E, dtype=torch.bool)
        rebuilt[tokens, torch.arange(E)[:, None].expand(E, m)] = True
        assert torch.equal(rebuilt, mask)


def brute_force(scores, m):
    """eq 18 by counting: token j is kept by expert i iff fewer than m tokens rank above it, where
    `a ranks above b` is (value, -index) order with NaN highest and -0 == +0."""
    x = scores.double()
    T, E = x.shape
    key = torch.where(torch.isnan(x), torch.inf, x)
    nan = torch.isnan(x)
    out = torch.zeros(T, E, dtype=torch.bool)
    for i in range(E):
        for j in range(T):
            above = 0
            for j2 in range(T):
                if j2 == j:
                    continue
                a, b = (nan[j2, i], key[j2, i]), (nan[j, i], key[j, i])
                if a > b or (a == b and j2 < j):
                    above += 1
            out[j, i] = above < m
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_random(backend, dtype):
    for T, E, m in shapes_for(backend):
        scores = torch.randn(T, E, generator=torch.Generator().manual_seed(T * 100 + E)).to(dtype)
        mask, tokens = run(backend, scores, m)
        ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
        check_layout(mask, tokens, m)
        assert torch.equal(mask, ref_mask), (T, E, m)
        assert torch.equal(tokens, ref_tokens), (T, E, m)


@pytest.mark.parametrize("kind", ADVERSARIAL_KINDS + ["nan"])
def test_adversarial_exactly_m(backend, kind):
    for T, E, m in [(9, 4, 3), (12, 3, 12), (5, 1, 1), (20, 2, 7)]:
        if kind == "nan":
            scores = torch.randn(T, E, generator=torch.Generator().manual_seed(T))
            scores[torch.rand(T, E, generator=torch.Generator().manual_seed(1)) < 0.3] = float("nan")
        else:
            scores = adversarial_logits(kind, T, E)
        mask, tokens = run(backend, scores, m)
        check_layout(mask, tokens, m)
        ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
        assert torch.equal(mask, ref_mask) and torch.equal(tokens, ref_tokens), kind


def test_reference_against_brute_force():
    """The reference's sort-based statement agrees with eq 18 written as counting."""
    for kind in ["random", "ties", "neg_inf", "signed_zero"]:
        scores = adversarial_logits(kind, 11, 3, seed=2)
        scores[3, 1] = float("nan")
        for m in (0, 1, 4, 11):
            assert torch.equal(reference.batchwise_mask(scores, m)[0], brute_force(scores, m)), (kind, m)


def test_ties_go_to_lower_token(backend):
    scores = torch.tensor([[1.0, -0.0], [3.0, 0.0], [3.0, float("-inf")], [0.0, 0.0], [3.0, float("nan")]])
    mask, tokens = run(backend, scores, 2)
    assert tokens.tolist() == [[1, 2], [0, 4]]  # expert 1: NaN first, then the first of the zeros
    assert mask.tolist() == [[False, True], [True, False], [True, False], [False, False], [False, True]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_subnormal_scores(backend, dtype):
    """Issue 34, defect 3: denormal scores rank by their values on every backend (the Triton
    kernel, in the interpreter, read bfloat16 denormals as other numbers)."""
    v = subnormal_values(dtype)
    scores = torch.stack([v, v.flip(0), v.roll(5)], 1)  # [T, 3]
    for m in (1, 3, v.numel() // 2):
        mask, tokens = run(backend, scores, m)
        want_mask, want_tokens = reference.batchwise_mask(scores, m)
        assert torch.equal(tokens, want_tokens), (m, tokens, want_tokens)
        assert torch.equal(mask, want_mask)


def test_neg_inf_still_counts(backend):
    scores = torch.full((6, 3), float("-inf"))
    scores[4, 0] = 1.0
    mask, tokens = run(backend, scores, 3)
    assert tokens.tolist() == [[0, 1, 4], [0, 1, 2], [0, 1, 2]]
    check_layout(mask, tokens, 3)


def test_mask_only_by_default(backend):
    scores = torch.randn(10, 4)
    with moe_kernels.use_backend(backend):
        mask = batchwise_mask(scores, 3)
    assert isinstance(mask, torch.Tensor) and torch.equal(mask, reference.batchwise_mask(scores, 3)[0])


def test_non_contiguous(backend):
    """Column-major, sliced and one-expert views (the Triton op copies strided experts row-major
    and views one expert with expert stride 1: on a GPU its kernels went wrong on the others)."""
    base = torch.randn(12, 80)
    ties = adversarial_logits("ties", 9, 70, seed=3)
    views = [
        (base.t()[:, ::2], 9),  # [80, 6], strides (1, 160)
        (ties.t(), 5),  # [70, 9] with many ties, strides (1, 70)
        (ties[:, 3:4], 2),  # one expert, strides (70, 1)
        (ties[2][:, None], 3),  # one expert, strides (1, 1): the token stride 1
        (ties[2:3].t(), 3),  # one expert, strides (1, 70)
        (ties[::2].t()[:, 1:2], 4),  # one expert, strides (1, 140)
        (torch.randn(40, 9)[:, 1:7], 6),  # row-major rows of a wider tensor, strides (9, 1)
    ]
    for scores, m in views:
        mask, tokens = run(backend, scores, m)
        ref_mask, ref_tokens = reference.batchwise_mask(scores.contiguous(), m)
        assert torch.equal(mask, ref_mask) and torch.equal(tokens, ref_tokens), (scores.shape, scores.stride())


def test_larger_batch_many_experts(kernel_backend):
    """A multi-tile column per expert; in C++ big enough (T x 16 experts >= 2^18 scores) to
    run several tasks in parallel, with a last group of fewer experts."""
    T, E, m = (700, 5, 35) if kernel_backend == "triton" else (20000, 40, 1000)
    scores = torch.randn(T, E, generator=torch.Generator().manual_seed(5)).half()  # fp16: many ties
    mask, tokens = run(kernel_backend, scores, m)
    ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
    check_layout(mask, tokens, m)
    assert torch.equal(mask, ref_mask) and torch.equal(tokens, ref_tokens)


def test_past_the_triton_grid(backend, monkeypatch):
    """More experts than the Triton radix path's grid holds (65535 groups of 16 on its axis 1;
    transposed scores, most likely) are valid input: the op hands them on (backends.fallback: the
    CUDA kernel for CUDA tensors, the reference under the interpreter), never a launch error; the
    raw op raises. The limit is lowered to 40 experts here: a million columns take the reference
    minutes."""
    from moe_kernels.triton import batchwise_mask as triton_kernels

    assert triton_kernels.supports(65535 * 16) and not triton_kernels.supports(65535 * 16 + 1)
    if backend != "triton":
        pytest.skip("the limit is the Triton kernels'")
    monkeypatch.setattr(triton_kernels, "MAX_EXPERTS", 40)
    launched = []
    monkeypatch.setattr(triton_kernels, "radix_select", lambda *args, **kw: launched.append(args))
    scores = torch.randn(50, 41, generator=torch.Generator().manual_seed(0))
    scores[1::2] = scores[::2]  # ties: the lower token
    mask, tokens = run(backend, scores, 7)
    ref_mask, ref_tokens = reference.batchwise_mask(scores, 7)
    assert torch.equal(mask, ref_mask) and torch.equal(tokens, ref_tokens)
    assert not launched
    if backend.device == "cpu":  # the raw op refuses it (on a GPU the device axis redirects the op's tensors only)
        with pytest.raises(ValueError, match="E <= 40 experts"):
            torch.ops.moe_kernels_triton.batchwise_mask(scores, 7)
    run(backend, scores[:, :40], 7)
    assert launched, "40 experts are the kernels' own"


@pytest.mark.parametrize("m", [1, 250, 600])
def test_tiles_and_expert_groups(kernel_backend, m, monkeypatch):
    """Several token tiles (256 on Triton: the last one ragged) and expert groups (16 on Triton: the
    last one ragged), ties that span tiles (scores of 8 values) and NaN, on a strided input. The
    Triton scan down the tile counts takes 2 tiles a step here, so its sums carry over steps."""
    from moe_kernels.triton import batchwise_mask as triton_kernels

    monkeypatch.setattr(triton_kernels, "_SCAN_BLOCK", 2)
    T, E = 600, 37
    g = torch.Generator().manual_seed(m)
    base = torch.randint(0, 8, (E, T), generator=g).float().t()  # [T, E] with strides (1, T)
    base[torch.rand(T, E, generator=g) < 0.01] = float("nan")
    for scores in (base, base.bfloat16()):
        mask, tokens = run(kernel_backend, scores, m)
        ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
        check_layout(mask, tokens, m)
        assert torch.equal(mask, ref_mask) and torch.equal(tokens, ref_tokens)


def sampled_threshold_scores(T, E, seed):
    """Columns for the C++ kernel's sampled-threshold select (csrc/cpu/select/column_filter.h, T >= 4096,
    m << T), including columns it must hand back to the whole-column select: one whose sampled rows
    (every 16th at T = 8192) hold its largest scores, so the sample's bound leaves fewer than m
    candidates; one constant (every score a candidate, more than the lists hold)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g)
    x[::16, 0] += 10.0
    x[:, 1] = 0.5
    x[:, 2] = torch.linspace(-1, 1, T)
    x[torch.rand(T, generator=g) < 0.05, 3] = float("nan")
    x[torch.rand(T, generator=g) < 0.9, 4] = float("-inf")
    x[:, 5] = (x[:, 5] * 4).round() / 4  # many ties at every threshold
    return x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 37, 300, 2000])
def test_sampled_threshold_select(dtype, m):
    if not moe_kernels._extension.has_kernel("batchwise_mask", "CPU"):
        pytest.skip("no C++ kernel in this build")
    scores = sampled_threshold_scores(8192, 23, seed=m).to(dtype)
    for x in (scores, scores.t().contiguous().t()):  # row-major, and strided (converted by rows)
        with moe_kernels.use_backend("cpu"):
            mask, tokens = batchwise_mask(x, m, return_indices=True)
        ref_mask, ref_tokens = reference.batchwise_mask(x, m)
        check_layout(mask, tokens, m)
        assert torch.equal(tokens, ref_tokens) and torch.equal(mask, ref_mask), (dtype, m, x.stride())


@pytest.mark.parametrize("m", [1, 37, 300])
def test_sampled_select_columns(backend, m):
    """T = 8192 with m << T: the Triton kernel's sampled select (moe_kernels/triton/batchwise_sampled.py),
    the C++ kernel's (column_filter.h), with the columns each hands back to its whole-column select."""
    scores = sampled_threshold_scores(8192, 23, seed=m)
    views = [scores, scores.bfloat16().t().contiguous().t()]  # row-major float32, strided bfloat16
    # One expert with token stride 1 (the kernels' compiles without that specialization): the
    # planted-sample column (redone by the radix path) and a random one (the sampled path alone).
    views += [scores[:, 0].contiguous()[:, None], scores[:, 6].contiguous()[:, None]]
    for x in views:
        mask, tokens = run(backend, x, m)
        ref_mask, ref_tokens = reference.batchwise_mask(x, m)
        check_layout(mask, tokens, m)
        assert torch.equal(tokens, ref_tokens) and torch.equal(mask, ref_mask), (m, x.dtype)


@contextlib.contextmanager
def torch_threads(threads):
    """torch's intra-op threads set for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("E, threads", [(64, 1), (128, 2), (200, 1), (65, 2)])
def test_sampled_threshold_select_row_words(E, threads):
    """The row pass's word shapes: one 64-column word per row (its own instance; E = 128 split
    between two threads is 64 per task), several words per row with a short last one (words of one
    row, and of consecutive rows, share an append loop), and 65 (a word of one column)."""
    if not moe_kernels._extension.has_kernel("batchwise_mask", "CPU"):
        pytest.skip("no C++ kernel in this build")
    T = 8192
    m = 2 * T // E
    scores = sampled_threshold_scores(T, E, seed=E)
    with torch_threads(threads), moe_kernels.use_backend("cpu"):
        mask, tokens = batchwise_mask(scores, m, return_indices=True)
    ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
    check_layout(mask, tokens, m)
    assert torch.equal(tokens, ref_tokens) and torch.equal(mask, ref_mask)


@pytest.mark.parametrize("threads", [1, 2])
def test_mask_written_in_row_blocks(threads):
    """The C++ mask is zeroed and set a block of 256 KiB of rows at a time, each thread from its own
    first row: a mask of several blocks, split between two threads, over memory that held ones."""
    if not moe_kernels._extension.has_kernel("batchwise_mask", "CPU"):
        pytest.skip("no C++ kernel in this build")
    T, E, m = 20000, 40, 700  # blocks of 6553 rows; two threads take 10000 rows each
    scores = sampled_threshold_scores(T, E, seed=3)
    with torch_threads(threads), moe_kernels.use_backend("cpu"):
        for _ in range(2):  # the second call's mask may reuse the first's memory
            torch.ones(T, E, dtype=torch.bool).fill_(True)
            mask, tokens = batchwise_mask(scores, m, return_indices=True)
    ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
    check_layout(mask, tokens, m)
    assert torch.equal(tokens, ref_tokens) and torch.equal(mask, ref_mask)


@pytest.mark.parametrize(
    "scores, m, error",
    [
        (torch.randn(4), 1, ValueError),  # 1-D
        (torch.randn(2, 3, 4), 1, ValueError),  # 3-D
        (torch.randn(4, 0), 1, ValueError),  # no experts
        (torch.randn(4, 3), 5, ValueError),  # m > T
        (torch.randn(4, 3), -1, ValueError),  # m < 0
        (torch.randn(0, 3), 1, ValueError),  # m > T = 0
        (torch.randn(4, 3), 1.0, TypeError),  # m not an int
        (torch.randn(4, 3), True, TypeError),  # bool is not an int here
        (torch.randint(0, 5, (4, 3)), 1, TypeError),  # dtype (float64 is accepted: test_float64.py)
        ([[1.0, 2.0]], 1, TypeError),  # not a tensor
    ],
)
def test_bad_arguments(scores, m, error):
    with pytest.raises(error, match="scores|m "):
        batchwise_mask(scores, m)


def test_bad_return_indices():
    with pytest.raises(TypeError, match="return_indices"):
        batchwise_mask(torch.randn(3, 2), 1, return_indices=1)


def test_opcheck(kernel_backend):
    op = (
        torch.ops.moe_kernels.batchwise_mask if kernel_backend == "cpu" else torch.ops.moe_kernels_triton.batchwise_mask
    )
    for T, E, m in [(7, 8, 2), (0, 4, 0), (5, 3, 5), (6, 2, 0)]:
        torch.library.opcheck(op, (torch.randn(T, E), m))


def test_torch_compile_fullgraph(kernel_backend):
    def route(x):
        mask, tokens = batchwise_mask(x, 3, return_indices=True)
        return torch.where(mask, x, 0.0).sum(0) + tokens.sum(1)

    x = torch.randn(16, 8)
    with moe_kernels.use_backend(kernel_backend):
        compiled = torch.compile(
            route, fullgraph=True, backend="aot_eager" if kernel_backend == "triton" else "inductor"
        )
        torch.testing.assert_close(compiled(x), route(x))


# threshold_mask (eq 19): one elementwise comparison, no kernels.


def test_threshold_mask_values():
    scores = torch.tensor([[0.5, 0.2, float("nan")], [0.1, -0.0, 0.3], [0.7, 0.2, float("-inf")]])
    thresholds = torch.tensor([0.5, 0.0, float("-inf")])
    mask = threshold_mask(scores, thresholds)
    # strictly greater; NaN above every threshold; -0.0 is not above +0.0; -inf not above -inf
    assert mask.tolist() == [[False, True, True], [False, False, True], [True, True, False]]
    assert not threshold_mask(torch.tensor([[float("nan")]]), torch.tensor([float("nan")])).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_mask_dtypes(dtype):
    scores = torch.rand(20, 4).to(dtype)
    thresholds = torch.full((4,), 0.5)
    assert torch.equal(threshold_mask(scores, thresholds), scores.float() > 0.5)
    assert threshold_mask(scores, thresholds.to(dtype)).shape == (20, 4)


def test_threshold_mask_reproduces_batchwise_mask_at_its_threshold():
    """With T_i set between the m-th and (m+1)-th score, eq 19 equals eq 18 on distinct scores."""
    scores = torch.randn(50, 6, generator=torch.Generator().manual_seed(3))
    m = 7
    top = scores.sort(0, descending=True).values
    thresholds = (top[m - 1] + top[m]) / 2
    assert torch.equal(threshold_mask(scores, thresholds), reference.batchwise_mask(scores, m)[0])


@pytest.mark.parametrize(
    "scores, thresholds, error",
    [
        (torch.randn(4, 3), torch.randn(4), ValueError),  # wrong length
        (torch.randn(4, 3), torch.randn(1, 3), ValueError),  # wrong rank
        (torch.randn(4, 3), torch.randn(()), ValueError),  # scalar
        (torch.randn(3), torch.randn(3), ValueError),  # 1-D scores
        (torch.randn(4, 3), [0.0, 0.0, 0.0], TypeError),  # not a tensor
        (torch.randn(4, 3), torch.zeros(3, dtype=torch.int64), TypeError),  # integer thresholds
    ],
)
def test_threshold_mask_bad_arguments(scores, thresholds, error):
    with pytest.raises(error, match="thresholds|scores"):
        threshold_mask(scores, thresholds)


def test_sampled_plan():
    """The sampled select's sizes, from the shapes alone: the issue-33 goal shape (T = 2^20, E =
    256, k = 2) takes it with lists of about 3m; small T, and m a large part of T, do not."""
    from moe_kernels.triton import batchwise_sampled as sampled

    p = sampled.plan(1 << 20, 8192)
    assert (p.sample_rows, p.step, p.rank) == (4096, 256, 51)
    assert p.capacity == 2 * 51 * 256 + 256 and 3 * 8192 < p.capacity < 4 * 8192
    assert sampled.plan(sampled.SAMPLED_FROM - 1, 8) is None and sampled.plan(1 << 20, 0) is None
    assert sampled.plan(8192, 2000) is None  # lo would keep more than a quarter of a column
    for T in (4096, 5000, 1 << 16, 1 << 20):
        for m in (1, 7, T // 256, T // 64, T // 16):
            p = sampled.plan(T, m)
            if p is not None:
                assert p.sample_rows * p.step <= T and p.rank <= p.sample_rows and m <= p.capacity <= T


def _planted_columns(T, E, seed):
    """[T, E] random scores with, in the second expert group (16 a group), a column whose sampled
    rows hold its largest scores (fewer than m candidates) and, in the third, a column of ties
    (more candidates than a list holds, its best past the capacity); the first group is left
    random."""
    from moe_kernels.triton import batchwise_sampled as sampled

    scores = torch.randn(T, E, generator=torch.Generator().manual_seed(seed))
    step = T // min(sampled.SAMPLE_ROWS, T // 16)
    scores[::step, 20] += 10.0
    # Constant but for its last 5 tokens: lists cut at their capacity would lose those.
    scores[:, 40] = 0.25
    scores[-5:, 40] = 1.0
    return scores


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_select_redoes_only_flagged_groups(kernel_backend, dtype, monkeypatch):
    """The Triton sampled select flags exactly the expert groups with a column it cannot select
    (short of m candidates; past the capacity) and the radix path behind it selects those groups
    again: smaller sizes than the real threshold (SAMPLED_FROM lowered), every float dtype, a
    ragged last group, and a strided input; 2 programs a group for the radix path, so that each
    loops over several tiles."""
    if kernel_backend != "triton":
        pytest.skip("the Triton kernel's sampled select")
    from moe_kernels.triton import batchwise_mask as radix
    from moe_kernels.triton import batchwise_sampled as sampled

    monkeypatch.setattr(sampled, "SAMPLED_FROM", 512)
    monkeypatch.setattr(radix, "_REDO_PROGRAMS", 2)
    T, E, m = 1024, 45, 8
    scores = _planted_columns(T, E, seed=7).to(dtype)
    p = sampled.plan(T, m)
    assert p is not None
    mask = torch.zeros(T, E, dtype=torch.bool)
    tokens = torch.empty(E, m, dtype=torch.int64)
    redo = sampled.sampled_select(scores, m, p, mask, tokens, group=16)
    assert redo.tolist() == [0, 1, 1]
    ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
    assert torch.equal(tokens[:16], ref_tokens[:16]) and torch.equal(mask[:, :16], ref_mask[:, :16])
    for x in (scores, scores.t().contiguous().t()):
        got_mask, got_tokens = run("triton", x, m)
        check_layout(got_mask, got_tokens, m)
        assert torch.equal(got_tokens, ref_tokens) and torch.equal(got_mask, ref_mask), x.stride()


def test_sampled_select_ties_and_nonfinite(kernel_backend, monkeypatch):
    """Candidates ranked as every backend ranks: NaN above +inf, -0 == +0, equal scores to the lower
    token (the packed value's low half); words of every bit and a short last word; on columns the
    sampled path selects itself."""
    if kernel_backend != "triton":
        pytest.skip("the Triton kernel's sampled select")
    from moe_kernels.triton import batchwise_sampled as sampled

    monkeypatch.setattr(sampled, "SAMPLED_FROM", 512)
    T, E, m = 2051, 6, 12  # a last word of 3 tokens
    g = torch.Generator().manual_seed(4)
    scores = (torch.randn(T, E, generator=g) * 4).round() / 4  # ties at every threshold
    scores[torch.rand(T, E, generator=g) < 0.003] = float("nan")
    scores[torch.rand(T, E, generator=g) < 0.003] = float("inf")
    # Column 4: 5 positive scores, then its m-th among 30 zeros of both signs, the rest negative.
    scores[:, 2] = -10.0 - torch.rand(T, generator=g)  # candidates with negative keys (packed: negative values)
    scores[:, 4] = -1.0 - torch.rand(T, generator=g)
    rows = torch.randperm(T, generator=g)
    scores[rows[:30], 4] = torch.tensor([-0.0, 0.0]).repeat(15)
    scores[rows[30:35], 4] = 1.0
    scores[torch.rand(T, generator=g) < 0.5, 5] = float("-inf")
    # Column 3: its best are 40 consecutive tokens (every bit of a word, the sign bit among them)
    # and the last one (in the last, short word).
    scores[:, 3] = torch.rand(T, generator=g)
    scores[60:100, 3] = 2.0 + torch.rand(40, generator=g)
    scores[T - 1, 3] = 5.0
    p = sampled.plan(T, m)
    mask = torch.zeros(T, E, dtype=torch.bool)
    tokens = torch.empty(E, m, dtype=torch.int64)
    redo = sampled.sampled_select(scores, m, p, mask, tokens, group=16)
    assert redo.tolist() == [0], "every column here has between m and capacity candidates"
    ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
    assert torch.equal(tokens, ref_tokens) and torch.equal(mask, ref_mask)
    got_mask, got_tokens = run("triton", scores, m)
    assert torch.equal(got_tokens, ref_tokens) and torch.equal(got_mask, ref_mask)


def test_column_tokens_radix_select_extremes(kernel_backend):
    """column_tokens_kernel's radix select of each column's M-th best packed value, on lists whose
    values (score keys) span the whole int32 range (the int64 sign bit, both extremes, runs
    sharing every high digit but the last, equal keys ranked by token), list lengths around a
    step (2048) and M from 1 to the whole list; a column short of M or past its capacity takes
    none and flags its group."""
    if kernel_backend != "triton":
        pytest.skip("the Triton kernel's sampled select")
    from moe_kernels.triton import batchwise_sampled as sampled

    g = torch.Generator().manual_seed(11)
    T, C, group = 5000, 4200, 2
    i32 = torch.iinfo(torch.int32)
    cases = [  # (candidate count, M, keys [count])
        (2049, 1, torch.randint(i32.min, i32.max, (2049,), generator=g)),
        (2049, 2049, torch.randint(-5, 5, (2049,), generator=g)),
        (4097, 700, torch.tensor([i32.min, i32.max, -1, 0]).repeat(1025)[:4097]),
        (3000, 1500, 0x12345600 + torch.randint(0, 3, (3000,), generator=g)),
        (2048, 100, torch.randint(i32.min, i32.max, (2048,), generator=g)),
        (50, 60, torch.zeros(50, dtype=torch.int64)),  # short of M: flagged
        (C + 1, 5, torch.zeros(C + 1, dtype=torch.int64)),  # past the capacity: flagged
        (1, 1, torch.tensor([i32.min])),
    ]
    E = len(cases)
    lists = torch.full((E, C), -(2**63), dtype=torch.int64)
    prefix = torch.zeros((E, 1), dtype=torch.int32)
    for e, (n, _, keys) in enumerate(cases):
        prefix[e, 0] = n
        t = torch.sort(torch.randperm(T, generator=g)[: min(n, C)]).values
        lists[e, : len(t)] = (keys[: len(t)].to(torch.int64) << 32) | (2**31 - 1 - t)
    counts = prefix[:, 0]
    for e, (n, m_e, _) in enumerate(cases):
        # One launch takes one M: each column is checked at its own M in a launch of its own.
        out_tokens = torch.full((E, m_e), -7, dtype=torch.int64)
        out_mask = torch.zeros((T, E), dtype=torch.bool)
        out_redo = torch.zeros(-(-E // group), dtype=torch.int32)
        sampled.column_tokens_kernel[(E,)](
            lists, prefix, out_tokens, out_mask, out_redo, T, E, 1, C, m_e, group,
            BLOCK=sampled._SELECT_BLOCK, RADIX_BITS=sampled._SELECT_RADIX_BITS,
        )  # fmt: skip
        flagged = (counts < m_e) | (counts > C)
        assert out_redo.tolist() == flagged.view(-1, group).any(dim=1).int().tolist(), e
        if flagged[e]:
            assert not out_mask[:, e].any() and (out_tokens[e] == -7).all()
            continue
        best = torch.topk(lists[e, :n], m_e).indices  # distinct values: one answer
        want = torch.sort(2**31 - 1 - (lists[e, best] & (2**31 - 1))).values
        assert torch.equal(out_tokens[e], want), e
        assert torch.equal(out_mask[:, e].nonzero().flatten(), want), e


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_select_row_segments_and_nan_bound(kernel_backend, dtype, monkeypatch):
    """The word pass over whole row segments: E = 32 (a program's columns exactly, so no column
    mask), E = 40 (a ragged column block) and E = 300 (several column blocks: 128 float32 or 256
    16-bit columns a program, the last ragged), T = 1030 (a last word of 6 tokens; the rows past T
    read as row T - 1 and weigh nothing). Two columns whose sample is NaN at the bound's rank (lo
    NaN): their candidates are NaN and +inf, which the sampled path selects itself where they
    number m or more."""
    if kernel_backend != "triton":
        pytest.skip("the Triton kernel's sampled select")
    from moe_kernels.triton import batchwise_sampled as sampled

    monkeypatch.setattr(sampled, "SAMPLED_FROM", 512)
    T, m = 1030, 8
    p = sampled.plan(T, m)
    assert p is not None and p.rank <= 5
    nan, inf = float("nan"), float("inf")
    for E in (32, 40, 300):
        scores = torch.randn(T, E, generator=torch.Generator().manual_seed(E))
        scores[T - 1, 7] = 9.0  # the last token, in the short last word
        sampled_rows = torch.arange(0, T, p.step)[: p.sample_rows]
        scores[sampled_rows[:10], 3] = nan  # 10 NaNs: the column's best 8 are NaNs
        scores[[5, 6, 7], 3] = inf
        scores[sampled_rows[:5], 20] = nan  # 5 NaNs and 4 +inf: the best 8 are all 5 and 3 +inf
        scores[[9, 99, 500, 1029], 20] = inf
        scores = scores.to(dtype)
        mask = torch.zeros(T, E, dtype=torch.bool)
        tokens = torch.empty(E, m, dtype=torch.int64)
        redo = sampled.sampled_select(scores, m, p, mask, tokens, group=16)
        assert not redo.any(), redo
        ref_mask, ref_tokens = reference.batchwise_mask(scores, m)
        assert torch.equal(tokens, ref_tokens) and torch.equal(mask, ref_mask), (E, dtype)
        assert tokens[20].tolist() == sorted(sampled_rows[:5].tolist() + [9, 99, 500])
