"""The whole capacity routing step on CPU, forward + backward:
topk_softmax -> capacity_positions -> dispatch -> identity expert -> combine, for

  moe_kernels          our ops (C++ kernels on CPU)
  reference            our reference implementations (moe_kernels.reference)
  einsum (GShard)      one-hot [T, E, C] masks, einsum("sec,sm->ecm") / einsum("sec,ecm->sm")
                       (DeepSpeed / GShard); skipped where a mask would exceed --einsum-limit-gb
  permute/unpermute    our dropless ops (topk_softmax -> permute -> identity -> unpermute)
  torch index          plain PyTorch: sort-based positions, index_copy dispatch, index_add combine

plus, for our dispatch and combine alone (forward), the bandwidth against torch.clone of the same
number of bytes measured in the same run (the machine's practical limit), and the peak resident
memory of one forward + backward step of each provider.

    .venv/bin/python bench/bench_dispatch.py [--quick] [--threads N] [--einsum-limit-gb 0.5]
    python -m moe_kernels.bench --op dispatch [--quick]

On a shared machine, --threads 1 gives stable numbers: with other processes on the cores, every
OpenMP fork/join can wait milliseconds for a descheduled worker.
"""

import sys
import time

import torch

import moe_kernels
from moe_kernels import reference
from moe_kernels.bench.output import compile_notes, report
from moe_kernels.bench.timing import compile_sequence, device, measure, peak_memory_mb
from moe_kernels.ops import capacity_for, capacity_positions, combine, dispatch, permute, topk_softmax, unpermute


def ours(x, logits, E, k, C):
    weights, experts = topk_softmax(logits, k)
    positions, _ = capacity_positions(experts, E, C)
    return combine(dispatch(x, experts, positions, E, C), experts, positions, weights)


def ref(x, logits, E, k, C):
    weights, experts = reference.topk_softmax(logits, k)
    positions, _ = reference.capacity_positions(experts, E, C)
    return reference.combine(reference.dispatch(x, experts, positions, E, C), experts, positions, weights)


def torch_gate(logits, k):
    """softmax -> topk -> renormalise, as MoE code usually writes it."""
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def einsum_form(x, logits, E, k, C):
    """GShard / DeepSpeed: positions by a cumsum over one-hot masks (our reference is exactly that),
    then dense [T, E, C] combine weights and dispatch mask and two einsums."""
    weights, experts = torch_gate(logits, k)
    positions, _ = reference.capacity_positions(experts, E, C)
    kept = (positions >= 0).to(x.dtype)
    one_hot_e = torch.nn.functional.one_hot(experts, E).to(x.dtype)  # [T, k, E]
    one_hot_c = torch.nn.functional.one_hot(positions.clamp(min=0), C).to(x.dtype) * kept.unsqueeze(-1)  # [T, k, C]
    dispatch_mask = torch.einsum("tse,tsc->tec", one_hot_e, one_hot_c)
    combine_weights = torch.einsum("tse,tsc,ts->tec", one_hot_e, one_hot_c, weights)
    buffer = torch.einsum("sec,sm->ecm", dispatch_mask, x)
    return torch.einsum("sec,ecm->sm", combine_weights, buffer)


def torch_index(x, logits, E, k, C):
    """Plain PyTorch with index ops: stable sort for the positions, index_copy, index_add."""
    weights, experts = torch_gate(logits, k)
    T, d = x.shape
    flat = experts.t().reshape(-1)  # s-major: first choices before second choices
    sorted_e, idx = torch.sort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    rank = torch.empty_like(flat)
    rank[idx] = torch.arange(flat.numel()) - (counts.cumsum(0) - counts)[sorted_e]
    kept = rank < C
    token = torch.arange(T).repeat(k)[kept]
    slot = (flat * C + rank)[kept]
    buffer = x.new_zeros(E * C, d).index_copy(0, slot, x[token])
    w = weights.t().reshape(-1)[kept].unsqueeze(1)
    return x.new_zeros(T, d).index_add(0, token, buffer[slot] * w)


def dropless(x, logits, E, k, C):
    weights, experts = topk_softmax(logits, k)
    x_sorted, _, order = permute(x, experts, E)
    return unpermute(x_sorted, order, weights, x.shape[0])


COMPILED = "torch.compile torch index"
PROVIDERS = {
    "moe_kernels": ours,
    "reference": ref,
    "einsum (GShard)": einsum_form,
    "permute/unpermute": dropless,
    "torch index": torch_index,
}
QUICK = "one small configuration (smoke test)"


def add_arguments(parser):
    parser.add_argument("--einsum-limit-gb", type=float, default=0.5, help="skip einsum when a mask exceeds this")
    parser.add_argument(
        "--einsum-limit-gflop", type=float, default=20.0, help="skip einsum when one einsum exceeds this (2*T*T*k*d)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (default: torch's)")


def run(args):
    """args: quick, out (the results folder), compile (the torch.compile baseline), command (for the
    table), and the flags of add_arguments."""
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = (
        [(2048, 8, 2, 256)]
        if args.quick
        else [(T, E, k, d) for T in (4096, 16384) for E in (8, 64) for k in (1, 2) for d in (512, 1024)]
    )
    print(f"backends: { {op: row[device()] for op, row in moe_kernels.backends().items()} }")
    timing = {"warmup": 1, "reps": 5, "min_time": 0.0}
    slow_timing = {"warmup": 0, "reps": 3, "min_time": 0.0}
    rows, extra, notes = [], [], []
    for T, E, k, d in grid:
        C = capacity_for(T, E, k, 1.0)
        config = {"T": T, "E": E, "k": k, "d": d, "C": C}
        torch.manual_seed(0)
        x = torch.randn(T, d, requires_grad=True)
        logits = torch.randn(T, E, requires_grad=True)
        g = torch.randn(T, d)
        expected = ref(x, logits, E, k, C)
        memory = {}
        for name, fn in PROVIDERS.items():
            if name == "einsum (GShard)":
                gb, gflop = T * E * C * 4 / 2**30, 2 * T * E * C * d / 1e9
                if gb > args.einsum_limit_gb or gflop > args.einsum_limit_gflop:
                    print(f"  {name:<28} skipped: a [T, E, C] mask is {gb:.2f} GB, one einsum {gflop:.0f} GFLOP")
                    continue
            y = fn(x, logits, E, k, C)
            if name != "permute/unpermute":  # dropless differs where capacity drops
                torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)

            def step(fn=fn):
                x.grad = logits.grad = None
                fn(x, logits, E, k, C).backward(g)

            memory[name] = peak_memory_mb(step)
            slow = name in ("einsum (GShard)", "reference")  # seconds per step: fewer repetitions
            rows.append(
                measure("dispatch", name, step, config=config, mode="fwd+bwd", **(slow_timing if slow else timing))
            )
        if args.compile:
            rows.append(compiled_row(x, logits, g, E, k, C, expected, config, memory, notes, timing))
        # Our dispatch and combine alone vs torch.clone of the same bytes.
        with torch.no_grad():
            weights, experts = topk_softmax(logits, k)
            positions, _ = capacity_positions(experts, E, C)
            buffer = dispatch(x, experts, positions, E, C)
        kept = int((positions >= 0).sum())
        dispatch_bytes = (T * d + E * C * d) * 4  # read x once, write every buffer row
        combine_bytes = (kept * d + T * d) * 4  # read every kept row, write y
        with torch.no_grad():
            rd = measure(
                "dispatch",
                "dispatch fwd",
                lambda: dispatch(x, experts, positions, E, C),
                config=config,
                bytes_moved=dispatch_bytes,
                **timing,
            )
            rc = measure(
                "dispatch",
                "combine fwd",
                lambda: combine(buffer, experts, positions, weights),
                config=config,
                bytes_moved=combine_bytes,
                **timing,
            )
            src = torch.empty((dispatch_bytes + combine_bytes) // 8)  # clone reads and writes numel * 4 bytes
            src.fill_(1.0)
            rclone = measure(
                "dispatch",
                "torch.clone",
                src.clone,
                config=config,
                bytes_moved=dispatch_bytes + combine_bytes,
                **timing,
            )
        both = (dispatch_bytes + combine_bytes) / ((rd["median_ms"] + rc["median_ms"]) / 1e3) / 1e9
        extra.append((config, memory, rd["gb_per_s"], rc["gb_per_s"], both, rclone["gb_per_s"]))
    name = "dispatch" + ("_quick" if args.quick else "")
    providers = [*PROVIDERS, COMPILED]
    md = report(
        name,
        rows,
        out=args.out,
        baseline="torch index",
        providers=providers,
        command=args.command or " ".join([".venv/bin/python bench/bench_dispatch.py", *sys.argv[1:]]),
        notes=compile_notes(notes),
    )
    md = md.replace(
        "Median of >= 15 runs",
        f"Median of {timing['reps']} runs after {timing['warmup']} warm-up (reference and einsum: "
        f"{slow_timing['reps']} runs, no warm-up beyond the correctness and memory runs)",
    )
    lines = [
        "\n## Peak resident memory of one forward + backward step (MB above the inputs)\n",
        "| config | " + " | ".join(providers) + " |",
        "|---|" + "---|" * len(providers),
    ]
    for config, memory, *_ in extra:
        cfg = " ".join(f"{k}={v}" for k, v in config.items())
        lines.append(f"| {cfg} | " + " | ".join(f"{memory[p]:.0f}" if p in memory else "-" for p in providers) + " |")
    lines += [
        "\n## Bandwidth of our dispatch and combine (forward) against torch.clone of the same bytes\n",
        "Bytes: dispatch reads x once and writes every buffer row; combine reads every kept row and writes y.\n",
        "| config | dispatch GB/s | combine GB/s | dispatch+combine GB/s | clone GB/s | fraction of clone |",
        "|---|---|---|---|---|---|",
    ]
    for config, _, gd, gc, both, gclone in extra:
        cfg = " ".join(f"{k}={v}" for k, v in config.items())
        lines.append(f"| {cfg} | {gd:.1f} | {gc:.1f} | {both:.1f} | {gclone:.1f} | {both / gclone:.0%} |")
    tail = "\n".join(lines) + "\n"
    print(tail)
    (args.out / f"{name}.md").write_text(md + tail)


def compiled_row(x, logits, g, E, k, C, expected, config, memory, notes, timing):
    """The plain-torch index sequence under torch.compile (what a user tries first), its compile
    time (the first forward and the first backward) reported apart in notes, its peak memory in memory."""
    compiled, seconds = compile_sequence(torch_index, x, logits, E, k, C)

    def compiled_step():
        x.grad = logits.grad = None
        compiled(x, logits, E, k, C).backward(g)

    start = time.perf_counter()
    compiled_step()  # compiles the backward
    cfg = " ".join(f"{a}={b}" for a, b in config.items())
    notes.append(f"| {COMPILED} | {cfg} | {seconds + time.perf_counter() - start:.1f} |")
    torch.testing.assert_close(compiled(x, logits, E, k, C), expected, atol=1e-4, rtol=1e-4)
    memory[COMPILED] = peak_memory_mb(compiled_step)
    return measure("dispatch", COMPILED, compiled_step, config=config, mode="fwd+bwd", **timing)
