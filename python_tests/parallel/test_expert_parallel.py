"""Expert parallelism (moe_kernels.parallel) in real process groups: gloo on 127.0.0.1, 2 and 4
spawned ranks. The checks each rank runs are in _expert_parallel_ranks.py; one spawned group runs a
whole plan of them (spawning is the slow part), and each test below asserts on one check's record.

Equal to a single process: outputs and gradients (x, gate logits, w1, w2) in float64, capacity and
dropless modes, top-k and batchwise gates, balanced assignment over the global batch, unequal and
zero token counts. Failures: a bad input on one rank, a rank whose experts raise and whose
process dies, a rank that stalls — every rank ends with an error, within bounded time.
"""

import multiprocessing
import socket
import time

import _expert_parallel_ranks as ranks
import pytest
import torch.distributed as dist

from moe_kernels.ops import capacity_for, capacity_positions
from moe_kernels.parallel import (
    ExchangeClock,
    agree_capacity,
    all_gather_rows,
    expert_parallel_moe,
    local_experts,
    shard_experts,
)

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

RUN_DEADLINE = 60.0  # seconds for a whole spawned run (normally ~10 s); a hang fails the test, not the CI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_plan(world: int, plan: str) -> dict:
    """Start `world` ranks running PLANS[plan]; {(rank, check): (status, detail, seconds)}.

    forkserver with torch and the checks preloaded: the server imports them once (seconds on a
    loaded machine) and forks every rank of both runs from that clean, single-threaded process
    (forking the test process itself could inherit OpenMP or gloo threads).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "moe_kernels.parallel", "_expert_parallel_ranks"])
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=ranks.worker, args=(r, world, port, plan, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    records, done, deadline = {}, set(), time.monotonic() + RUN_DEADLINE
    try:
        while len(done) < world and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                break  # a rank crashed without reporting (its checks will show as missing)
            try:
                rank, name, status, detail, seconds = queue.get(timeout=0.5)
            except Exception:  # noqa: BLE001 - queue.Empty: poll again
                continue
            if name == "done":
                done.add(rank)
            else:
                records[(rank, name)] = (status, detail, seconds)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()  # only the processes this test started
    return records


@pytest.fixture(scope="module")
def two_ranks():
    return run_plan(2, "two_ranks")


@pytest.fixture(scope="module")
def four_ranks():
    return run_plan(4, "four_ranks")


def assert_ok_on_every_rank(records, world, name):
    for rank in range(world):
        assert (rank, name) in records, f"rank {rank} never reported {name!r} (hang or crash); have {sorted(records)}"
        status, detail, _ = records[(rank, name)]
        assert status == "ok", f"rank {rank} {name}:\n{detail}"


TWO = [name for name, _, _ in ranks.PLANS["two_ranks"]]
FOUR = [name for name, _, _ in ranks.PLANS["four_ranks"]]


@pytest.mark.parametrize("name", TWO)
def test_two_ranks(two_ranks, name):
    assert_ok_on_every_rank(two_ranks, 2, name)


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks(four_ranks, name):
    assert_ok_on_every_rank(four_ranks, 4, name)


def test_failures_are_fast(two_ranks, four_ranks):
    """The error reaches the peers through a collective (a bad input: well under the timeout), a
    dead peer's closed connection, or the 2 s timeout of the stalled rank's group."""
    for rank in (0, 1):
        for name in ("bad_input_capacity", "bad_input_dropless"):
            assert two_ranks[(rank, name)][2] < 10, two_ranks[(rank, name)]
    assert "after" in two_ranks[(0, "rank_stalls")][1]
    for rank in (0, 1, 3):
        detail = four_ranks[(rank, "rank_dies")][1]
        assert float(detail.split(" after ")[1].split("s")[0]) < 20, detail


# ---------------------------------------------------------------- single-process behaviour
def test_single_process_fallbacks():
    """Without a process group everything degrades to W = 1: no collective is attempted."""
    import torch

    assert not dist.is_initialized()
    assert local_experts(6, 1) == 6
    with pytest.raises(ValueError, match="divisible"):
        local_experts(6, 4)
    assert agree_capacity(3, None) == 3 and agree_capacity(0, None, capacity=5) == 5
    with pytest.raises(KeyError):
        agree_capacity(1, None, error=KeyError("local"))  # a rank's own error is re-raised
    x = torch.randn(3, 2)
    assert all_gather_rows(x, None) is x
    assert torch.equal(shard_experts(x, None), x)
    ExchangeClock.reset()
    assert ExchangeClock.seconds == 0.0


@pytest.mark.parametrize("dropless", [False, True])
def test_one_process_equals_the_definition(dropless):
    """W = 1 (no process group): the same step, outputs and gradients equal the dense definition;
    capacity mode with a small capacity factor drops choices and counts them."""
    import torch

    xs, logits, w1, w2, grads = ranks.global_data([11], 4, seed=5)
    x, lg, a, b = ranks.leaves(xs[0], logits[0], w1, w2)
    routing = ranks.topk_routing(lg)
    opts = {"dropless": True} if dropless else {"capacity_factor": 0.5}
    y, stats = expert_parallel_moe(x, routing, a, b, None, **opts)
    (y * grads[0]).sum().backward()

    rx, rlg, ra, rb = ranks.leaves(xs[0], logits[0], w1, w2)
    r = ranks.topk_routing(rlg)
    kept = torch.ones_like(r.weights)
    if not dropless:
        positions, _ = capacity_positions(r.experts, 4, stats["capacity"])
        kept = (positions >= 0).double()
        assert stats["capacity"] == capacity_for(11, 4, 2, 0.5) and int(stats["dropped"]) == int((kept == 0).sum()) > 0
    ref = ranks.single_process_moe(rx, r.experts, r.weights, kept, ra, rb)
    (ref * grads[0]).sum().backward()
    torch.testing.assert_close(y, ref.detach(), **ranks.TOL)
    for got, want in ((x, rx), (lg, rlg), (a, ra), (b, rb)):
        torch.testing.assert_close(got.grad, want.grad, **ranks.TOL)


def test_moe_layer_without_a_group():
    """MoE(group=None) is the single-process layer: full_state_dict is its state_dict,
    load_full_state_dict its load_state_dict, and shard() needs a process group."""
    import torch

    from moe_kernels import MoE

    moe = MoE(6, 4, 5)
    assert moe.group is None and moe.experts.num_experts == 4
    sd = moe.full_state_dict()
    assert sd.keys() == moe.state_dict().keys()
    other = MoE(6, 4, 5)
    other.load_full_state_dict(sd)
    for name, t in other.state_dict().items():
        assert torch.equal(t, sd[name]), name
    with pytest.raises(ValueError, match="process group"):
        moe.shard(None)
