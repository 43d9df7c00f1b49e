"""The CUDA balanced-assignment solver's logic, executed on the host.

csrc/cuda/balanced_assignment.cu is only compiled here (no GPU). Its phases are written once in
csrc/include/moe_kernels/balanced_assignment_steps.h over plain arrays and an executor;
python_tests/ops/emulate/balanced_assignment_cuda.cpp (host_emulation.build) runs them with a
sequential executor in the kernels' order. What this checks: the device algorithm is exactly
optimal (scipy on the expanded matrix), agrees with the C++ CPU kernel where the optimum is unique,
and its result does not depend on the order of the items of any parallel phase nor on the block
width (a phase whose items depended on each other, i.e. a race on the device, would change it).
What it cannot check: the CUDA execution itself (barriers, atomics, shared memory, the host loop).
"""

import math
import subprocess

import host_emulation
import numpy as np
import pytest
import torch
from shapes import ASSIGNMENT_SHAPES

import moe_kernels
from moe_kernels import _extension
from moe_kernels.ops import balanced_assignment

from .test_balanced_assignment import instance, optimum

FORWARDS, BACKWARDS, SHUFFLED = 0, 1, 2
DEVICE_WIDTH = 256  # move_costs_kernel's block size
# The emulator's output header (int64 each; emulate/balanced_assignment_cuda.cpp).
HEAD_FIELDS = ("converged", "rounds", "iterations", "restarted", "failed", "bids", "heap_steps")
HEAD = 8 * len(HEAD_FIELDS)
BIDS_PER_TOKEN = 8  # kDeviceBidsPerToken: the budget of the auction's first attempt


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return host_emulation.build("balanced_assignment_cuda", tmp_path_factory.mktemp("emulate"), shared=False)


def emulate_raw(
    exe, scores: torch.Tensor, capacity: int, width=DEVICE_WIDTH, order=FORWARDS, seed=0, eps_div=0
) -> bytes:
    """The emulator's output file for one run (its layout: emulate/balanced_assignment_cuda.cpp);
    eps_div: the auction's eps divisor (Problem::eps_div, MOE_KERNELS_SOLVER_EPS_DIV's), 0 the default."""
    n, k = scores.shape
    x = scores.numpy()
    f64 = x.dtype == np.float64
    path = exe.parent / "in.bin"
    result = exe.parent / "out.bin"
    with open(path, "wb") as f:
        np.array([n, k, capacity, int(f64), width, order, seed, eps_div], dtype=np.int64).tofile(f)
        x.astype(np.float64 if f64 else np.float32).tofile(f)
    out = subprocess.run([str(exe), str(path), str(result)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return result.read_bytes()


def header(raw: bytes) -> dict:
    """The emulator's output header, HEAD_FIELDS to their values."""
    return dict(zip(HEAD_FIELDS, map(int, np.frombuffer(raw[:HEAD], dtype=np.int64))))


def emulate(
    exe,
    scores: torch.Tensor,
    capacity: int,
    width=DEVICE_WIDTH,
    order=FORWARDS,
    seed=0,
    restarted=False,
    counts=False,
    eps_div=0,
):
    """Runs the device algorithm on the host. Returns (experts [n] int64, value float,
    distances [k, k] float64, rounds, auction iterations), with `restarted` then whether the
    auction restarted from the column means, and with `counts` then the header's counts as a
    dict (HEAD_FIELDS: bids the experts took, heap steps, ...)."""
    n, k = scores.shape
    raw = emulate_raw(exe, scores, capacity, width, order, seed, eps_div)
    head = header(raw)
    converged, failed = head["converged"], head["failed"]
    assert converged == 1, f"the solve failed (kFailed = {failed}: 1 a guard tripped, 2 a token without a finite bid)"
    experts = np.frombuffer(raw[HEAD : HEAD + 8 * n], dtype=np.int64)
    value = float(np.frombuffer(raw[HEAD + 8 * n : HEAD + 8 + 8 * n], dtype=np.float64)[0])
    dist = np.frombuffer(raw[HEAD + 8 + 8 * n :], dtype=np.float64).reshape(k, k)
    out = (torch.from_numpy(experts.copy()), value, torch.from_numpy(dist.copy()), head["rounds"], head["iterations"])
    out = (*out, bool(head["restarted"])) if restarted else out
    return (*out, head) if counts else out


def check_optimal(scores, capacity, experts, value):
    n, k = scores.shape
    assert experts.min() >= 0 and experts.max() < k
    assert torch.bincount(experts, minlength=k).max() <= capacity, "capacity exceeded"
    achieved = float(scores.double()[torch.arange(n), experts].sum())
    assert math.isclose(value, achieved, rel_tol=0, abs_tol=1e-9)
    scale = max(1.0, float(scores.abs().max()))
    assert achieved >= optimum(scores, capacity) - 1e-9 * scale * n, "suboptimal"


@pytest.mark.parametrize("kind", ["randn", "integer", "equal", "wide"])
def test_optimal_on_many_random_instances(emulator, kind):
    """Every parallel phase visited forwards, backwards or shuffled, at block widths 1, 7 and 256."""
    g = torch.Generator().manual_seed(11)
    for t in range(45):
        n = int(torch.randint(1, 41, (1,), generator=g))
        k = int(torch.randint(1, 10, (1,), generator=g))
        capacity = math.ceil(n / k) + int(torch.randint(0, 3, (1,), generator=g))
        scores = instance(100 + t, n, k, kind)
        experts, value, _, _, _ = emulate(emulator, scores, capacity, width=(1, 7, 256)[t % 3], order=t % 3, seed=t)
        check_optimal(scores, capacity, experts, value)


@pytest.mark.parametrize("eps_div", [512, 4096, 32768, 262144])
def test_optimal_at_every_eps_divisor(emulator, eps_div):
    """The auction's eps divisor (MOE_KERNELS_SOLVER_EPS_DIV, which bench/gpu_solver_variants.py
    sweeps on a GPU) moves work between the auction and the cycle-cancelling passes; the solve is
    exact at each: randn, tied integers and free slots, against scipy."""
    for t, (n, k, slack, kind) in enumerate([(300, 16, 0, "randn"), (257, 8, 1, "integer"), (200, 12, 3, "randn")]):
        scores = instance(500 + t, n, k, kind)
        capacity = math.ceil(n / k) + slack
        experts, value, _, _, _ = emulate(emulator, scores, capacity, order=SHUFFLED, seed=t, eps_div=eps_div)
        check_optimal(scores, capacity, experts, value)


def test_a_finer_eps_bids_longer(emulator):
    """The divisor reaches the auction: on randn (300, 16) a finer eps (a larger divisor) takes
    more bidding iterations (28, 88, 104, 111 at 512 ... 262144), the default's count in between."""
    scores = instance(500, 300, 16, "randn")
    counts = [emulate(emulator, scores, 19, eps_div=d)[4] for d in (512, 4096, 0, 262144)]
    assert counts == sorted(counts) and counts[0] < counts[-1], counts


@pytest.mark.parametrize("n,k,capacity", [s for s in ASSIGNMENT_SHAPES if s[0] > 0])  # n = 0 never reaches the launcher
@pytest.mark.parametrize("kind", ["randn", "integer"])
def test_edge_shapes(emulator, n, k, capacity, kind):
    scores = instance(n * 31 + k, n, k, kind)
    cap = capacity if capacity is not None else max(1, math.ceil(n / k))
    experts, value, dist, _, _ = emulate(emulator, scores, cap, order=SHUFFLED)
    check_optimal(scores, cap, experts, value)
    assert torch.equal(dist.diagonal(), torch.zeros(k, dtype=torch.float64))
    if k * cap == n:  # no free slot: every expert is exactly full
        assert torch.equal(torch.bincount(experts, minlength=k), torch.full((k,), cap))


@pytest.mark.skipif(not _extension.LOADED, reason="needs the C++ CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,k", [(96, 8), (100, 7), (256, 16), (1000, 32), (4096, 64)])
def test_matches_cpu_kernel(emulator, n, k, dtype):
    """Same rules and float64 arithmetic: on randn scores (a unique optimum) the same experts and
    bit-identical d* as the C++ kernel, whose own auction differs (sequential bidding). The
    emulator sums the value in token order, as the CPU does (the device's block sum may differ in
    the last bits)."""
    for seed in range(2):
        scores = instance(seed, n, k, "randn").to(dtype)
        with moe_kernels.use_backend("cpu"):
            e_cpu, v_cpu, d_cpu = balanced_assignment(scores, return_distances=True)
        experts, value, dist, _, _ = emulate(emulator, scores, math.ceil(n / k), order=SHUFFLED, seed=seed)
        assert torch.equal(experts, e_cpu)
        assert value == float(v_cpu)
        assert torch.equal(dist, d_cpu)


def halves(seed: int, n: int, k: int) -> torch.Tensor:
    """randn rounded to multiples of 1/2: many tied bids and tied move costs on cycle edges."""
    g = torch.Generator().manual_seed(seed)
    return torch.round(torch.randn(n, k, generator=g) * 2) / 2


# Free slots on every shape (up to 13 rounds), so tied argmin tokens end up on cycle edges.
@pytest.mark.parametrize("n,k,capacity", [(61, 6, 12), (150, 10, 18), (40, 4, 12), (90, 9, 10)])
def test_independent_of_item_order_and_width(emulator, n, k, capacity):
    """Experts, d*, rounds and auction iterations identical whatever order the items of each
    parallel phase (and the blocks of move_costs) run in and whatever the block width: the device
    result is deterministic. On these tie-heavy instances, breaking either tie rule (better_move,
    holder_worse) makes the order matter (checked by hand: 2 and 21 of the 24 instances change)."""
    for seed in range(6):
        scores = halves(seed, n, k)
        runs = [
            emulate(emulator, scores, capacity, width=width, order=order, seed=s)
            for width in (1, DEVICE_WIDTH)
            for order, s in ((FORWARDS, 0), (BACKWARDS, 0), (SHUFFLED, seed + 1))
        ]
        experts, value, dist, rounds, iterations = runs[0]
        check_optimal(scores, capacity, experts, value)
        for e, v, d, r, it in runs[1:]:
            assert torch.equal(e, experts) and torch.equal(d, dist)
            assert (r, it) == (rounds, iterations)
            assert math.isclose(v, value, rel_tol=1e-15, abs_tol=1e-12)  # summation order only


@pytest.mark.parametrize("n,k,extra", [(100, 5, 0), (200, 8, 0), (300, 16, 3)])
def test_bid_budget_restart(emulator, n, k, extra):
    """Experts that differ in popularity run the auction past its bid budget: without free slots it
    restarts from the column means (its second attempt), with free slots it runs on from zero
    prices (column means would leave a free slot above the lowest price). Optimal, and the same
    result whatever the order of the items and the width, either way."""
    for seed in range(3):
        scores = instance(seed, n, k, "bias")
        capacity = math.ceil(n / k) + extra
        runs = [
            emulate(emulator, scores, capacity, width=width, order=order, seed=seed, restarted=True)
            for width in (1, 7, DEVICE_WIDTH)
            for order in (FORWARDS, SHUFFLED)
        ]
        experts, value, dist, rounds, iterations, restarted = runs[0]
        assert restarted == (extra == 0)
        check_optimal(scores, capacity, experts, value)
        for e, v, d, r, it, again in runs[1:]:
            assert torch.equal(e, experts) and torch.equal(d, dist)
            assert (r, it, again) == (rounds, iterations, restarted)
            assert math.isclose(v, value, rel_tol=1e-15, abs_tol=1e-12)  # summation order only


def test_a_token_without_a_finite_bid_stops_the_auction(emulator):
    """A token whose every value s - price is -inf has no expert to bid for: the auction stops with
    kFailed = 2 (the op raises a ValueError from it) rather than index the prices with expert -1.
    The op rejects non-finite scores before the solve, and from zero prices a token always has a
    non-full expert at price 0, so with finite scores only prices that overflow to inf (float64
    scores near the float64 limit) could bring it about; the -inf row here reaches it directly."""
    inf = float("inf")
    scores = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-inf, -inf]], dtype=torch.float64)
    for width in (1, DEVICE_WIDTH):
        head = header(emulate_raw(emulator, scores, 2, width=width))
        assert (head["converged"], head["failed"]) == (0, 2)


@pytest.mark.skipif(not _extension.LOADED, reason="needs the C++ CPU kernel")
@pytest.mark.parametrize("kind", ["randn", "integer", "bias"])
def test_a_bid_costs_at_most_one_sift(emulator, kind):
    """A full expert takes a bid as the CPU kernel does: a bid worse than its worst holder
    (holder_worse) is turned away with the heap untouched, else it replaces the worst holder with
    one sift-down. So the heap steps are at most floor(log2(capacity)) a bid; a push of the bid and
    a pop of the worst (the same kept set) ran 1.2-1.4x over that on integer ties and biased
    experts. The CPU solver's experts (randn, bias: a unique optimum) or value (integer ties)."""
    n, k = 2000, 32
    capacity = math.ceil(n / k)
    for seed in range(2):
        scores = instance(seed, n, k, kind)
        with moe_kernels.use_backend("cpu"):
            e_cpu, v_cpu = balanced_assignment(scores, capacity, return_distances=True)[:2]
        experts, value, _, _, _, counts = emulate(emulator, scores, capacity, order=SHUFFLED, seed=seed, counts=True)
        assert counts["heap_steps"] <= counts["bids"] * int(math.log2(capacity))
        assert value == float(v_cpu)
        if kind != "integer":
            assert torch.equal(experts, e_cpu)


def row_constant(seed: int, n: int, k: int) -> torch.Tensor:
    """Every row constant: integers in -3..3, their zeros +0.0 and -0.0 at random (equal values,
    so still constant rows: any assignment is optimal there)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, (n, 1), generator=g).float().expand(n, k).contiguous()
    s[(s == 0) & (torch.rand(n, k, generator=g) < 0.5)] = -0.0
    return s


@pytest.mark.skipif(not _extension.LOADED, reason="needs the C++ CPU kernel")
@pytest.mark.parametrize("kind", ["equal", "row_constant"])
@pytest.mark.parametrize(
    "n,k,extra,dtype",
    [
        (8192, 64, 0, torch.float32),
        (1000, 16, 0, torch.float64),
        (300, 16, 3, torch.float32),
        (50, 4, 10**6, torch.float32),
    ],
)
def test_constant_rows_skip_the_auction(emulator, kind, n, k, extra, dtype):
    """Where every row is constant the auction is skipped (no bidding iteration, no bid) and token
    i goes to expert i // capacity: the auction's own result there, which piled every unplaced
    token onto one expert an iteration (335k bids at (8192, 64), the H200's 656 ms). The passes
    then find no cycle and compute d* from it: the CPU solver's experts, value and d*. One score
    off its row's and the auction runs."""
    scores = (torch.zeros(n, k) if kind == "equal" else row_constant(n + k, n, k)).to(dtype)
    capacity = math.ceil(n / k) + extra
    with moe_kernels.use_backend("cpu"):
        e_cpu, v_cpu, d_cpu = balanced_assignment(scores, capacity, return_distances=True)
    for width, order in ((DEVICE_WIDTH, SHUFFLED), (7, BACKWARDS)):
        experts, value, dist, rounds, _, counts = emulate(emulator, scores, capacity, width, order, seed=1, counts=True)
        assert (counts["iterations"], counts["bids"], rounds) == (0, 0, 1)
        assert torch.equal(experts, torch.arange(n) // capacity)
        assert torch.equal(experts, e_cpu) and value == float(v_cpu) and torch.equal(dist, d_cpu)
    scores[-1, -1] += 1  # one score off its row's: the auction runs
    with moe_kernels.use_backend("cpu"):
        v_cpu = balanced_assignment(scores, capacity, return_distances=True)[1]
    _, value, _, _, iterations = emulate(emulator, scores, capacity, order=SHUFFLED, seed=2)
    assert iterations > 0 and value == float(v_cpu)


def zero_mean_columns(seed: int, n: int, k: int) -> torch.Tensor:
    """Rows nearly constant (a few cells off by -2..2) and their negations: every column sums to
    exactly 0, and the auction piles tokens onto one expert an iteration, past its bid budget."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-3, 4, (n // 2, 1), generator=g).float().expand(n // 2, k).contiguous()
    h += (torch.rand(n // 2, k, generator=g) < 0.004).float() * torch.randint(-2, 3, (n // 2, k), generator=g)
    return torch.cat([h, -h])[torch.randperm(n, generator=g)]


@pytest.mark.skipif(not _extension.LOADED, reason="needs the C++ CPU kernel")
@pytest.mark.parametrize("n,k", [(512, 16), (2000, 50)])
def test_no_restart_from_zero_column_means(emulator, n, k):
    """Past its bid budget the auction restarts from the column means; where they are all 0, its
    starting prices, the restart would replay the same bids and run on, so the auction runs on
    instead: past the budget, not restarted, the CPU solver's value, and the same result whatever
    the order of the items and the width."""
    capacity = math.ceil(n / k)
    for seed in range(2):
        scores = zero_mean_columns(seed, n, k)
        with moe_kernels.use_backend("cpu"):
            v_cpu = balanced_assignment(scores, capacity, return_distances=True)[1]
        runs = [
            emulate(emulator, scores, capacity, width=width, order=order, seed=seed, restarted=True, counts=True)
            for width, order in ((DEVICE_WIDTH, FORWARDS), (7, SHUFFLED))
        ]
        experts, value, dist, rounds, iterations, restarted, counts = runs[0]
        assert counts["bids"] > BIDS_PER_TOKEN * n and not restarted
        assert value == float(v_cpu)
        e, _, d, r, it, _, _ = runs[1]
        assert torch.equal(e, experts) and torch.equal(d, dist) and (r, it) == (rounds, iterations)
