"""What every rank of a spawned gloo group runs for python_tests/parallel/test_expert_parallel.py.

A run is one process group (W processes, gloo on 127.0.0.1) executing a list of checks in order;
each check records (name, "ok" | "fail", detail, seconds) on a queue the test reads. Spawning
torch processes costs seconds on a loaded 2-core machine, so one group runs many checks.

The single-process computation the checks compare against is written here from the definition
(y[t] = sum over kept choices of weight * FFN_e(x[t]), every expert applied densely), in float64,
over the whole global batch, with the full [E, d, h] / [E, h, d] weights: every rank rebuilds the
same global data from one seed and compares its own slice.
"""

from __future__ import annotations

import datetime
import math
import os
import time
import traceback

import tolerances
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_kernels import MoE
from moe_kernels.ops import capacity_for, capacity_positions, topk_softmax
from moe_kernels.parallel import (
    RemoteRankError,
    expert_parallel_moe,
    expert_parallel_route,
    gather_state_dict,
    route_global_batch,
    shard_experts,
    shard_state_dict,
    sync_replicated_grads,
)
from moe_kernels.routing import Routing

D, H, K = 6, 5, 2
TOL = {"rtol": 1e-10, "atol": 1e-12}  # float64 end to end; only summation order differs


# ---------------------------------------------------------------- data and the single-process MoE
def global_data(token_counts, num_experts, seed):
    """Every rank's x [T_r, D] and logits [T_r, E], the full expert weights, the output grads."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, D, generator=g, dtype=torch.float64) for t in token_counts]
    logits = [torch.randn(t, num_experts, generator=g, dtype=torch.float64) for t in token_counts]
    w1 = torch.randn(num_experts, D, H, generator=g, dtype=torch.float64) / math.sqrt(D)
    w2 = torch.randn(num_experts, H, D, generator=g, dtype=torch.float64) / math.sqrt(H)
    grads = [torch.randn(t, D, generator=g, dtype=torch.float64) for t in token_counts]
    return xs, logits, w1, w2, grads


def single_process_moe(x, experts, weights, kept, w1, w2, b1=None, b2=None):
    """y[t] = sum_s kept[t, s] * weights[t, s] * FFN_e(x[t]), e = experts[t, s], with
    FFN_e(v) = gelu(v @ w1[e] + b1[e]) @ w2[e] + b2[e] (biases [E, H] / [E, D], default 0)."""
    b1 = 0.0 if b1 is None else b1.unsqueeze(0)
    b2 = 0.0 if b2 is None else b2.unsqueeze(0)
    every = torch.einsum("teh,ehd->ted", F.gelu(torch.einsum("td,edh->teh", x, w1) + b1), w2) + b2  # [T, E, D]
    chosen = every.gather(1, experts.clamp(min=0).unsqueeze(-1).expand(-1, -1, x.shape[1]))  # [T, k, D]
    return (chosen * (weights * kept).unsqueeze(-1)).sum(1)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def topk_routing(logits, k=K):
    weights, experts = topk_softmax(logits.float(), k)  # the kernel takes fp32/fp16/bf16 logits
    weights = torch.softmax(logits.gather(1, experts), -1)  # same choices, float64 weights (renormalised)
    return Routing(experts=experts, weights=weights, num_experts=logits.shape[1], aux_loss=logits.new_zeros(()))


class BiasedExperts:
    """The experts interface of expert_parallel_route (forward_buffer / forward_expert) with biases:
    a capacity buffer's empty slots then produce non-zero outputs, which must never reach a token."""

    def __init__(self, w1, b1, w2, b2):
        self.w1, self.b1, self.w2, self.b2 = w1, b1, w2, b2
        self.num_experts = w1.shape[0]

    def forward_buffer(self, buffer):
        return torch.bmm(F.gelu(torch.bmm(buffer, self.w1) + self.b1[:, None]), self.w2) + self.b2[:, None]

    def forward_expert(self, e, rows):
        return F.gelu(rows @ self.w1[e] + self.b1[e]) @ self.w2[e] + self.b2[e]


# ---------------------------------------------------------------- gates solved over a whole batch
def expert_choice_gate(logits):
    """Batchwise top-m (expert choice): every expert takes the m = ceil(T*K/E) tokens with the
    highest softmax score, ties to the lower token index."""
    T, E = logits.shape
    probs = torch.softmax(logits, -1)
    m = min(T, math.ceil(T * K / E))
    chosen = torch.sort(-probs.detach().t(), dim=1, stable=True).indices[:, :m]  # [E, m]
    mask = torch.zeros(T, E, dtype=torch.bool)
    mask[chosen, torch.arange(E).unsqueeze(1).expand(-1, m)] = True
    experts = torch.where(mask, torch.arange(E), -1)
    return Routing(
        experts=experts,
        weights=torch.where(mask, probs, 0.0),
        num_experts=E,
        aux_loss=logits.new_zeros(()),
        layout="expert_choice",
        expert_tokens=chosen,
        expert_weights=probs.t().gather(1, chosen),
    )


def balanced_gate(logits):
    """Balanced assignment (greedy): pairs by descending score, a token takes its best expert
    that still has room (ceil(T/E) tokens each); weight sigmoid(score)."""
    T, E = logits.shape
    room = [math.ceil(T / E)] * E
    assigned = [-1] * T
    for flat in torch.sort(-logits.detach().reshape(-1), stable=True).indices.tolist():
        t, e = divmod(flat, E)
        if assigned[t] < 0 and room[e] > 0:
            assigned[t], room[e] = e, room[e] - 1
    experts = torch.tensor(assigned, dtype=torch.int64).view(T, 1)
    weights = torch.sigmoid(logits.gather(1, experts.clamp(min=0)))
    return Routing(experts=experts, weights=weights, num_experts=E, aux_loss=logits.new_zeros(()))


# ---------------------------------------------------------------- checks
def check_equal_to_single_process(
    group, token_counts, num_experts, *, dropless, capacity_factor=None, gate=None, bias=False, priority=False, seed=0
):
    """EP outputs and gradients (x, logits, w1, w2, biases) equal the single-process MoE's slice."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    xs, logits, w1, w2, grads = global_data(token_counts, num_experts, seed)
    g = torch.Generator().manual_seed(seed + 100)
    b1, b2 = (torch.randn(num_experts, n, generator=g, dtype=torch.float64) for n in (H, D))
    E_l = num_experts // W

    # expert-parallel step on this rank's tokens and experts
    x, lg = leaves(xs[rank], logits[rank])
    w1_l, w2_l, b1_l, b2_l = leaves(*(shard_experts(t, group) for t in (w1, w2, b1, b2)))
    routing = topk_routing(lg) if gate is None else route_global_batch(lg, gate, group)
    opts = {"dropless": True} if dropless else {"capacity_factor": capacity_factor}
    if priority:  # slots to the highest gate values first (Megatron's "probs" policy)
        opts["priority"] = routing.weights.detach()
    if bias:  # the duck-typed experts interface (what the MoE layer's expert modules provide)
        y, stats = expert_parallel_route(x, routing, BiasedExperts(w1_l, b1_l, w2_l, b2_l), group, **opts)
    else:
        y, stats = expert_parallel_moe(x, routing, w1_l, w2_l, group, **opts)
    (y * grads[rank]).sum().backward()

    # the same computation in one process: every rank's tokens, all experts
    ref_x, ref_lg = leaves(torch.cat(xs), torch.cat(logits))
    ref_w1, ref_w2, ref_b1, ref_b2 = leaves(w1, w2, b1, b2)
    biases = (ref_b1, ref_b2) if bias else ()
    start = sum(token_counts[:rank])
    rows = slice(start, start + token_counts[rank])
    if gate is not None:  # one routing problem over the global batch
        ref_routing = gate(ref_lg)
        kept = (ref_routing.experts >= 0).double()
        ref_y = single_process_moe(ref_x, ref_routing.experts, ref_routing.weights, kept, ref_w1, ref_w2, *biases)
        assert torch.equal(routing.experts, ref_routing.experts[rows]), "global routing differs"
        expected_dropped = 0
    else:  # each rank's batch routed on its own (top-k is per token), capacity per source rank
        C = max(capacity_for(t, num_experts, K, capacity_factor) for t in token_counts) if capacity_factor else None
        if C is None:  # drop-free capacity: the largest per-expert count of any rank
            C = max(int(torch.bincount(topk_routing(lq).experts.flatten(), minlength=num_experts).max()) if lq.numel()
                    else 0 for lq in logits)  # fmt: skip
        outs, drops = [], []
        for q, t in enumerate(token_counts):
            s = slice(sum(token_counts[:q]), sum(token_counts[:q]) + t)
            r = topk_routing(ref_lg[s])
            kept = torch.ones(t, K, dtype=torch.float64)
            if not dropless:
                prio = r.weights.detach() if priority else None
                positions, _ = capacity_positions(r.experts, num_experts, C, priority=prio)
                kept = (positions >= 0).double()
                drops.append(int((positions < 0).sum()))
                assert stats["capacity"] == C, f"agreed capacity {stats['capacity']} != {C}"
            outs.append(single_process_moe(ref_x[s], r.experts, r.weights, kept, ref_w1, ref_w2, *biases))
        ref_y = torch.cat(outs)
        expected_dropped = 0 if dropless else drops[rank]
    (ref_y * torch.cat(grads)).sum().backward()

    torch.testing.assert_close(y, ref_y[rows].detach(), **TOL)
    torch.testing.assert_close(x.grad, ref_x.grad[rows], **TOL)
    torch.testing.assert_close(lg.grad, ref_lg.grad[rows], **TOL)
    local = slice(rank * E_l, (rank + 1) * E_l)
    torch.testing.assert_close(w1_l.grad, ref_w1.grad[local], **TOL)
    torch.testing.assert_close(w2_l.grad, ref_w2.grad[local], **TOL)
    if bias:
        torch.testing.assert_close(b1_l.grad, ref_b1.grad[local], **TOL)
        torch.testing.assert_close(b2_l.grad, ref_b2.grad[local], **TOL)
    assert int(stats["dropped"]) == expected_dropped, (int(stats["dropped"]), expected_dropped)
    if gate is None and not dropless and capacity_factor is not None and sum(token_counts):
        assert sum(drops) > 0, "capacity case should drop some choices (test data too small?)"
    return f"T={token_counts[rank]} dropped={int(stats['dropped'])}"


def check_low_precision(group, token_counts, num_experts):
    """float32 and bfloat16 through the exchange (both modes, forward): float32 within the table's
    tolerance of the float64 computation, bfloat16 by flash-attention's rule against it."""
    rank = dist.get_rank(group)
    xs, logits, w1, w2, _ = global_data(token_counts, num_experts, seed=11)
    routing = topk_routing(logits[rank])
    start = sum(token_counts[:rank])
    rows = slice(start, start + token_counts[rank])
    every = [topk_routing(lq) for lq in logits]
    experts, weights = torch.cat([r.experts for r in every]), torch.cat([r.weights for r in every])
    kept = torch.ones_like(weights)
    ref = single_process_moe(torch.cat(xs), experts, weights, kept, w1, w2)[rows]
    for dtype in (torch.float32, torch.bfloat16):
        low = Routing(routing.experts, routing.weights.to(dtype), num_experts, routing.aux_loss)
        local = [shard_experts(w, group).to(dtype) for w in (w1, w2)]
        eager = single_process_moe(
            torch.cat(xs).to(dtype), experts, weights.to(dtype), kept.to(dtype), w1.to(dtype), w2.to(dtype)
        )[rows]
        for opts in ({"dropless": True}, {}):  # {}: drop-free capacity, so both equal the reference
            y, _ = expert_parallel_moe(xs[rank].to(dtype), low, *local, group, **opts)
            assert y.dtype == dtype
            if dtype == torch.float32:
                tolerances.assert_close(y, ref)
            else:
                tolerances.assert_lowp_close(y, ref.float(), eager)
    return "ok"


def check_state_dict_round_trip(group, num_experts):
    """shard_state_dict then gather_state_dict gives back the full state dict on every rank."""
    _, _, w1, w2, _ = global_data([1], num_experts, seed=7)
    full = {"gate.weight": torch.randn(num_experts, D, generator=torch.Generator().manual_seed(3)), "w1": w1, "w2": w2}
    sharded = shard_state_dict(full, group, {"w1", "w2"})
    W = dist.get_world_size(group)
    assert sharded["w1"].shape == (num_experts // W, D, H) and sharded["gate.weight"] is full["gate.weight"]
    back = gather_state_dict(sharded, group, lambda name: name.startswith("w"))
    for name in full:
        assert torch.equal(back[name], full[name]), name
    return "ok"


def check_indivisible_experts(group):
    """E not divisible by W: ValueError on every rank, before any collective."""
    W = dist.get_world_size(group)
    x = torch.randn(3, D, dtype=torch.float64)
    E = W + 1
    r = topk_routing(torch.randn(3, E, dtype=torch.float64), 1)
    try:
        expert_parallel_moe(x, r, torch.zeros(1, D, H), torch.zeros(1, H, D), group)
    except ValueError as e:
        assert "divisible" in str(e), e
        return str(e)
    raise AssertionError("no ValueError")


def check_capacity_must_agree(group):
    rank = dist.get_rank(group)
    x = torch.randn(3, D, dtype=torch.float64)
    r = topk_routing(torch.randn(3, 4, dtype=torch.float64))
    w1, w2 = torch.zeros(4 // dist.get_world_size(group), D, H), torch.zeros(4 // dist.get_world_size(group), H, D)
    try:
        expert_parallel_moe(x, r, w1.double(), w2.double(), group, capacity=2 + rank)
    except ValueError as e:
        assert "same on every rank" in str(e), e
        return str(e)
    raise AssertionError("no ValueError")


def check_bad_input_on_one_rank(group, dropless):
    """Rank 1 passes x with a wrong d: it raises ValueError, every other rank RemoteRankError
    (from the first collective, no timeout), and the group still works afterwards."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E = 2 * W
    x = torch.randn(4, D + (1 if rank == 1 else 0), dtype=torch.float64)
    r = topk_routing(torch.randn(4, E, dtype=torch.float64))
    w1, w2 = torch.randn(2, D, H, dtype=torch.float64), torch.randn(2, H, D, dtype=torch.float64)
    start = time.perf_counter()
    try:
        expert_parallel_moe(x, r, w1, w2, group, dropless=dropless)
        raise AssertionError("no error")
    except (ValueError, RemoteRankError) as e:
        expected = ValueError if rank == 1 else RemoteRankError
        assert type(e) is expected, f"rank {rank} raised {type(e).__name__}: {e}"
        # Issue 34, defect 7: the peers name the rank that failed (the capacity all-reduce named
        # rank 0 on every rank).
        assert rank == 1 or "rank(s) [1] " in str(e), f"rank {rank}: {e}"
        message = f"{type(e).__name__} after {time.perf_counter() - start:.2f}s"
    x = torch.randn(4, D, dtype=torch.float64)  # the group is still usable
    y, _ = expert_parallel_moe(x, r, w1, w2, group, dropless=dropless)
    assert y.shape == (4, D)
    return message


class InjectedFailure(RuntimeError):
    pass


class ExitProcess(BaseException):
    """A check asks its worker to report it and then end the process at once (a dying rank)."""


def _fail_on(rank_to_fail, rank):
    def activation(h):
        if rank == rank_to_fail:
            raise InjectedFailure(f"rank {rank}: injected failure inside the experts")
        return F.gelu(h)

    return activation


def run_failing_step(group, rank_to_fail, dropless):
    """A step in which one rank's experts raise between the two exchanges; returns
    (exception type name, message, seconds until this rank's error)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    x = torch.randn(5, D)
    r = topk_routing(torch.randn(5, 2 * W))
    w1, w2 = torch.randn(2, D, H), torch.randn(2, H, D)
    start = time.perf_counter()
    try:
        expert_parallel_moe(x, r, w1, w2, group, dropless=dropless, activation=_fail_on(rank_to_fail, rank))
    except Exception as e:  # noqa: BLE001 - any error is what we want; a hang is the failure
        return type(e).__name__, str(e)[:200], time.perf_counter() - start
    return None, "no error", time.perf_counter() - start


# ---------------------------------------------------------------- the MoE layer, sharded
class ExpertChoiceGate(nn.Module):
    """expert_choice_gate on this batch's logits x @ w (an "expert_choice" Routing for the layer)."""

    def __init__(self, d, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w = nn.Parameter(torch.randn(d, num_experts))

    def forward(self, x, mask=None):
        return expert_choice_gate(x @ self.w.to(x.dtype))


class TopKGate64(nn.Module):
    """topk_routing of x @ w (choices on fp32 logits, float64 weights), with a float64 aux loss
    (squared mean router probabilities, 0 for an empty batch) so the gate's loss path is checked."""

    def __init__(self, d, num_experts):
        super().__init__()
        self.num_experts = num_experts
        self.w = nn.Parameter(torch.randn(d, num_experts))

    def forward(self, x, mask=None):
        logits = x @ self.w.to(x.dtype)
        routing = topk_routing(logits)
        probs = torch.softmax(logits, -1) if mask is None else torch.softmax(logits, -1) * mask[:, None]
        routing.aux_loss = 0.01 * (probs.sum(0) ** 2).sum() / max(x.shape[0], 1)
        return routing


def build_moe(num_experts, kind, gate, capacity_factor, seed):
    """The same single-process float64 MoE on every rank (seeded): batched or module experts,
    a deterministic top-k gate with an aux loss, or the expert-choice gate."""
    torch.manual_seed(seed)
    experts = None
    if kind == "modules":
        experts = [nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(num_experts)]
    router = ExpertChoiceGate(D, num_experts) if gate == "expert_choice" else TopKGate64(D, num_experts)
    moe = MoE(D, num_experts, H, gate=router, k=K, capacity_factor=capacity_factor, experts=experts, activation=F.gelu)
    with torch.no_grad():  # non-zero biases: a capacity buffer's empty slots must never reach a token
        for p in moe.experts.parameters():
            p.add_(0.1 * torch.randn(p.shape))
    return moe.double()


def local_name(name, rank, num_local):
    """(name in the full layer's state dict, slice of dim 0) of a sharded layer's entry."""
    parts = name.split(".")
    if parts[:2] == ["experts", "experts"]:  # module experts: local index -> global index
        return ".".join(parts[:2] + [str(rank * num_local + int(parts[2]))] + parts[3:]), slice(None)
    if parts[0] == "experts":
        return name, slice(rank * num_local, (rank + 1) * num_local)
    return name, slice(None)


def check_moe_layer(group, token_counts, num_experts, *, kind, capacity_factor, gate="topk", masked=False, seed=0):
    """MoE.shard(group) on rank r equals the single-process MoE on rank r's batch: output, stats,
    the gradients of x, of the gate (summed over ranks by sync_replicated_grads) and of this rank's
    experts, for a loss = sum_r (y_r * g_r).sum() + aux_loss_r (the gate's loss included)."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E_l = num_experts // W
    full = build_moe(num_experts, kind, gate, capacity_factor, seed).train()
    sharded = full.shard(group)
    assert sharded.group is group and full.group is None and sharded.experts.num_experts == E_l
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(t, D, generator=g, dtype=torch.float64) for t in token_counts]
    grads = [torch.randn(t, D, generator=g, dtype=torch.float64) for t in token_counts]
    masks = [torch.rand(t, generator=g) > 0.25 if masked else None for t in token_counts]

    x = xs[rank].clone().requires_grad_()
    y = sharded(x, mask=masks[rank])
    ((y * grads[rank]).sum() + sharded.aux_loss).backward()
    replicated = [p for n, p in sharded.named_parameters() if not n.startswith("experts.")]
    sync_replicated_grads(replicated, group)
    stats = sharded.stats

    ref_xs = [xq.clone().requires_grad_() for xq in xs]
    total, dropped = 0.0, 0
    for q, xq in enumerate(ref_xs):
        yq = full(xq, mask=masks[q])
        total = total + (yq * grads[q]).sum() + full.aux_loss
        dropped += int(full.stats["dropped_fraction"] > 0)  # batches with drops
        if q == rank:
            ref_y, ref_stats = yq, full.stats
    total.backward()

    torch.testing.assert_close(y, ref_y.detach(), **TOL)
    torch.testing.assert_close(x.grad, ref_xs[rank].grad, **TOL)
    full_params = dict(full.named_parameters())
    for name, p in sharded.named_parameters():
        ref_name, rows = local_name(name, rank, E_l)
        torch.testing.assert_close(p.grad, full_params[ref_name].grad[rows], **TOL, msg=name)
    for key in ("load", "importance", "dropped_fraction"):
        torch.testing.assert_close(stats[key], ref_stats[key], **TOL, msg=key)
    assert stats["capacity"] == ref_stats["capacity"], (stats["capacity"], ref_stats["capacity"])
    if capacity_factor is not None and gate == "topk":
        assert dropped > 0, "capacity case should drop some choices (test data too small?)"
    dropped_fraction = float(stats["dropped_fraction"])
    return f"T={token_counts[rank]} capacity={stats['capacity']} dropped_fraction={dropped_fraction:.3f}"


def check_moe_checkpoint(group, num_experts, kind):
    """full_state_dict gathers the experts back into the single-process layout (after rank-specific
    updates); resuming from it (load_state_dict + shard, or load_full_state_dict on a layer built
    with group=) gives the same layer; E not divisible by W is a ValueError."""
    rank, W = dist.get_rank(group), dist.get_world_size(group)
    E_l = num_experts // W
    full = build_moe(num_experts, kind, "topk", None, seed=21).train()
    full(torch.randn(3, D, dtype=torch.float64))  # a step before sharding: aux_loss holds a graph
    sharded = full.shard(group)
    assert sharded.aux_loss.grad_fn is None and full.aux_loss.grad_fn is not None
    with torch.no_grad():  # a "training step" that differs per rank's experts
        for p in sharded.experts.parameters():
            p.add_(rank + 1.0)
    sd = sharded.full_state_dict()
    expected = {n: t.clone() for n, t in full.state_dict().items()}
    for q in range(W):
        for name in sharded.state_dict():
            ref_name, rows = local_name(name, q, E_l)
            if name.startswith("experts."):
                expected[ref_name][rows] += q + 1.0
    assert sd.keys() == expected.keys(), sorted(set(sd) ^ set(expected))
    for name in expected:
        assert torch.equal(sd[name], expected[name]), name

    x = torch.randn(7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    want = sharded.eval()(x)
    resumed = build_moe(num_experts, kind, "topk", None, seed=99)  # other weights, then the checkpoint
    resumed.load_state_dict(sd)
    torch.testing.assert_close(resumed.shard(group).eval()(x), want, **TOL)
    experts = None
    if kind == "modules":  # this rank's E/W modules only
        experts = [nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(E_l)]
    options = {"k": K, "capacity_factor": None, "experts": experts, "activation": F.gelu, "group": group}
    direct = MoE(D, num_experts, H, gate=TopKGate64(D, num_experts), **options)
    direct.double().load_full_state_dict(sd)
    torch.testing.assert_close(direct.eval()(x), want, **TOL)
    try:
        MoE(D, W + 1, H, group=group)
        raise AssertionError("no ValueError for E % W != 0")
    except ValueError as e:
        assert "divisible" in str(e), e
    return "ok"


# ---------------------------------------------------------------- the spawned process
def worker(rank, world, port, plan, queue):
    """Join the gloo group and run the plan's checks in order, reporting each on `queue`."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    group = dist.group.WORLD
    for name, fn, kwargs in PLANS[plan]:
        start = time.perf_counter()
        try:
            detail = fn(group, **kwargs)
            status = "ok"
        except ExitProcess as e:
            queue.put((rank, name, "ok", str(e), time.perf_counter() - start))
            break
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            status, detail = "fail", traceback.format_exc()[-2000:]
        queue.put((rank, name, status, detail, time.perf_counter() - start))
    queue.put((rank, "done", "ok", "", 0.0))
    queue.close()
    queue.join_thread()
    os._exit(0)  # no destroy_process_group: a peer may be gone (the failure checks)


def check_rank_dies(group):
    """Last check of a run: rank 2 raises inside its experts and its process exits at once
    (the worker's os._exit); every other rank must get an error, not hang."""
    kind, message, seconds = run_failing_step(group, rank_to_fail=2, dropless=False)
    if dist.get_rank(group) == 2:
        assert kind == "InjectedFailure", (kind, message)
        raise ExitProcess(f"{kind}: {message}")
    assert kind is not None, "no error on a peer of the dead rank"
    return f"{kind} after {seconds:.2f}s: {message}"


def check_rank_stalls(group):
    """Last check of a run: rank 1 raises inside its experts and stays alive without calling any
    collective (a caught exception in a training loop); rank 0 must fail with the group's timeout
    (a 2 s group made for this check), not wait forever."""
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2))
    kind, message, seconds = run_failing_step(short, rank_to_fail=1, dropless=True)
    if dist.get_rank(group) == 1:
        assert kind == "InjectedFailure", (kind, message)
        time.sleep(3)  # alive, silent, past the peer's timeout
        return "stalled"
    assert kind is not None and seconds < 15, (kind, message, seconds)
    return f"{kind} after {seconds:.2f}s: {message}"


PLANS = {
    "two_ranks": [
        ("capacity_unequal", check_equal_to_single_process,
         {"token_counts": [9, 4], "num_experts": 4, "dropless": False, "capacity_factor": 1.0}),
        ("capacity_priority", check_equal_to_single_process,
         {"token_counts": [8, 5], "num_experts": 4, "dropless": False, "capacity_factor": 0.75, "priority": True}),
        ("capacity_zero_tokens_dropfree", check_equal_to_single_process,
         {"token_counts": [6, 0], "num_experts": 4, "dropless": False}),
        ("capacity_all_zero", check_equal_to_single_process,
         {"token_counts": [0, 0], "num_experts": 4, "dropless": False, "capacity_factor": 1.0}),
        ("dropless_unequal", check_equal_to_single_process,
         {"token_counts": [7, 3], "num_experts": 4, "dropless": True}),
        ("dropless_zero_tokens", check_equal_to_single_process,
         {"token_counts": [0, 5], "num_experts": 4, "dropless": True}),
        ("global_expert_choice", check_equal_to_single_process,
         {"token_counts": [6, 3], "num_experts": 4, "dropless": True, "gate": expert_choice_gate}),
        ("global_balanced_assignment", check_equal_to_single_process,
         {"token_counts": [5, 0], "num_experts": 2, "dropless": True, "gate": balanced_gate}),
        ("capacity_experts_with_bias", check_equal_to_single_process,
         {"token_counts": [6, 2], "num_experts": 4, "dropless": False, "capacity_factor": 1.0, "bias": True}),
        ("dropless_experts_with_bias", check_equal_to_single_process,
         {"token_counts": [3, 0], "num_experts": 4, "dropless": True, "bias": True}),
        ("float32_and_bfloat16", check_low_precision, {"token_counts": [7, 4], "num_experts": 4}),
        ("state_dict_round_trip", check_state_dict_round_trip, {"num_experts": 4}),
        ("indivisible_experts", check_indivisible_experts, {}),
        ("capacity_must_agree", check_capacity_must_agree, {}),
        ("bad_input_capacity", check_bad_input_on_one_rank, {"dropless": False}),
        ("bad_input_dropless", check_bad_input_on_one_rank, {"dropless": True}),
        ("moe_capacity_equal_tokens", check_moe_layer,
         {"token_counts": [8, 8], "num_experts": 4, "kind": "batched", "capacity_factor": 1.0}),
        ("moe_capacity_masked_modules", check_moe_layer,
         {"token_counts": [7, 7], "num_experts": 4, "kind": "modules", "capacity_factor": 0.5, "masked": True,
          "seed": 1}),
        ("moe_dropless_unequal", check_moe_layer,
         {"token_counts": [9, 3], "num_experts": 4, "kind": "batched", "capacity_factor": None, "seed": 2}),
        ("moe_dropless_modules_zero_tokens", check_moe_layer,
         {"token_counts": [0, 6], "num_experts": 4, "kind": "modules", "capacity_factor": None, "masked": True,
          "seed": 3}),
        ("moe_expert_choice", check_moe_layer,
         {"token_counts": [6, 4], "num_experts": 4, "kind": "batched", "capacity_factor": 1.0,
          "gate": "expert_choice", "seed": 4}),
        ("moe_checkpoint_batched", check_moe_checkpoint, {"num_experts": 4, "kind": "batched"}),
        ("moe_checkpoint_modules", check_moe_checkpoint, {"num_experts": 4, "kind": "modules"}),
        ("rank_stalls", check_rank_stalls, {}),
    ],
    "four_ranks": [
        ("capacity_unequal", check_equal_to_single_process,
         {"token_counts": [5, 0, 8, 2], "num_experts": 8, "dropless": False, "capacity_factor": 1.0, "seed": 1}),
        ("dropless_unequal", check_equal_to_single_process,
         {"token_counts": [5, 0, 8, 2], "num_experts": 8, "dropless": True, "seed": 2}),
        ("global_expert_choice", check_equal_to_single_process,
         {"token_counts": [3, 4, 0, 2], "num_experts": 4, "dropless": False, "gate": expert_choice_gate,
          "seed": 3}),
        ("moe_dropless_unequal", check_moe_layer,
         {"token_counts": [5, 0, 8, 2], "num_experts": 8, "kind": "modules", "capacity_factor": None, "seed": 5}),
        ("moe_capacity_equal_tokens", check_moe_layer,
         {"token_counts": [6, 6, 6, 6], "num_experts": 8, "kind": "batched", "capacity_factor": 1.0, "seed": 6}),
        ("moe_checkpoint_batched", check_moe_checkpoint, {"num_experts": 8, "kind": "batched"}),
        ("bad_input_capacity", check_bad_input_on_one_rank, {"dropless": False}),
        ("bad_input_dropless", check_bad_input_on_one_rank, {"dropless": True}),
        ("rank_dies", check_rank_dies, {}),
    ],
}  # fmt: skip
