"""Expert parallelism on this machine: one MoE training step (forward + backward) over the same
global batch with 1, 2 and 4 processes (gloo on 127.0.0.1), capacity and dropless modes.

THIS IS A CPU / GLOO PROXY. The ranks share one machine's cores (2 here: 4 ranks oversubscribe
them) and memory bandwidth, and gloo moves tokens through loopback TCP, so the figures say what the
exchange costs relative to the experts' compute on this box, not what NCCL on GPUs would give.
Each rank runs one intra-op thread (OMP spin-waits made a 2-thread W=1 run ~30x slower on this
shared, loaded machine), so W=2 also uses twice the cores of W=1 and W=4 oversubscribes 2 cores.
The time of a step is the slowest rank's.

    .venv/bin/python bench/bench_expert_parallel.py [--quick]
    python -m moe_kernels.bench --op expert_parallel [--quick]    (needs torch.distributed)
"""

import datetime
import math
import multiprocessing
import socket
import statistics
import time

from moe_kernels.bench.output import report
from moe_kernels.bench.timing import commit, machine

WORLDS = (1, 2, 4)
QUICK = "a small batch and few repetitions (smoke test)"


def rank_main(rank, world, port, cfg, queue):
    import torch
    import torch.distributed as dist

    from moe_kernels.ops import topk_softmax
    from moe_kernels.parallel import ExchangeClock, expert_parallel_moe, shard_experts
    from moe_kernels.routing import Routing

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    T, d, h, E, k = cfg["T"], cfg["d"], cfg["h"], cfg["E"], cfg["k"]
    g = torch.Generator().manual_seed(0)
    gate = (torch.randn(d, E, generator=g) / math.sqrt(d)).requires_grad_()
    w1 = shard_experts(torch.randn(E, d, h, generator=g) / math.sqrt(d), None).requires_grad_()
    w2 = shard_experts(torch.randn(E, h, d, generator=g) / math.sqrt(h), None).requires_grad_()
    x = torch.randn(T // world, d, generator=torch.Generator().manual_seed(1 + rank))
    results = {}
    for mode, opts in (("capacity 1.25", {"capacity_factor": 1.25}), ("dropless", {"dropless": True})):
        steps, shares = [], []
        for rep in range(cfg["warmup"] + cfg["reps"]):
            dist.barrier()
            ExchangeClock.reset()
            start = time.perf_counter()
            logits = x @ gate
            weights, experts = topk_softmax(logits, k)
            routing = Routing(experts=experts, weights=weights, num_experts=E, aux_loss=logits.new_zeros(()))
            y, _ = expert_parallel_moe(x, routing, w1, w2, None, **opts)
            y.square().mean().backward()
            seconds = time.perf_counter() - start
            slowest = torch.tensor([seconds, ExchangeClock.seconds / seconds])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
            if rep >= cfg["warmup"]:
                steps.append(float(slowest[0]))
                shares.append(float(slowest[1]))
            gate.grad = w1.grad = w2.grad = None
        results[mode] = (steps, statistics.median(shares))
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world, cfg):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "moe_kernels.parallel"])
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, cfg, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = queue.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return results


def run(args):
    """args: quick, out (the results folder), command (for the table). No torch.compile baseline:
    the baseline is one process (W=1)."""
    cfg = {
        "T": 1024,
        "d": 64,
        "h": 128,
        "E": 8,
        "k": 2,
        "warmup": 2,
        "reps": 5,
    }  # --quick: a smoke test (the report says >= 15 runs: not here)
    if not args.quick:
        cfg.update(T=4096, d=128, h=512, warmup=3, reps=15)
    config = {key: cfg[key] for key in ("T", "d", "h", "E", "k")}
    rows = []
    for world in WORLDS:
        for mode, (steps, share) in run_world(world, cfg).items():
            q = statistics.quantiles(steps, n=5)
            median = statistics.median(steps)
            rows.append({
                "op": "expert_parallel", "provider": f"W={world}", "mode": mode,
                "config": " ".join(f"{k}={v}" for k, v in config.items()),
                "median_ms": median * 1e3, "p20_ms": q[0] * 1e3, "p80_ms": q[3] * 1e3,
                "gb_per_s": "", "exchange_share": f"{share:.2f}",
                "machine": machine(), "commit": commit(), "torch": __import__("torch").__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            })  # fmt: skip
            print(f"  W={world} {mode:<14} {median * 1e3:9.2f} ms/step  {T_per_s(cfg['T'], median):>10} tokens/s"
                  f"  exchange {100 * share:.0f}% of the slowest rank's step", flush=True)  # fmt: skip
    md = report(
        "expert_parallel" + ("_quick" if args.quick else ""),
        rows,
        out=args.out,
        baseline="W=1",
        providers=[f"W={w}" for w in WORLDS],
        command=(args.command or "bench/bench_expert_parallel.py" + (" --quick" if args.quick else ""))
        + "  (CPU/gloo proxy: ranks share this machine's cores; not a GPU/NCCL figure)",
    )  # fmt: skip
    shares = "\n".join(f"| {r['provider']} | {r['mode']} | {float(r['exchange_share']) * 100:.0f}% |" for r in rows)
    path = args.out / f"expert_parallel{'_quick' if args.quick else ''}.md"
    path.write_text(
        md + "\nShare of the step in the exchange (all_to_all + capacity agreement, incl. waiting for "
        "peers; the max over ranks):\n\n| W | mode | exchange |\n|---|---|---|\n" + shares + "\n"
    )


def T_per_s(tokens, seconds):
    return f"{tokens / seconds:,.0f}"
