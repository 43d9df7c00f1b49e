"""Static instruction counts of Triton kernels for sm_90 (the router's, the routing maps',
batchwise_mask's), without a GPU: each kernel
compiled ahead of time as a GPU launch specialises it (16-byte aligned pointers, sizes divisible
by 16, the unit stride a compile-time 1, k a compile-time constant), then the SASS of its hot path
(up to the last EXIT: the out-of-line slow paths of the IEEE division after it are left out)
counted in the listing triton.tools.disasm gives (Triton's own cuobjdump). The router forward's loops
over the k picks count as many times as they run (hot_path's `trips`: before, each counted once,
which left Qwen3-MoE's forward at 274 a row where it ran 512); the other kernels' loops
(grid-stride loops over tiles, a binary search) count once.

A program's hot path runs once per program (BLOCK_T rows), every warp of it issuing each
instruction: `per row` is the hot path times num_warps over BLOCK_T, the warp instructions a row
costs. An instruction count is not a time (latency, memory, the MUFU and shuffle rates): it
compares kernel versions here, and the GPU benchmarks (bench/gpu_bench.py) time them.

    python bench/triton_sass.py [--cases qwen3 ...] [--maps 8 256] [--batchwise bf16 fp32]

batchwise_mask: warp instructions a score (a list slot for gather_candidates_kernel, its binary
search's loop counted once), each program's tile as launched.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass

from moe_kernels.triton import batchwise_mask, batchwise_sampled, capacity_positions, topk_router, topk_router_backward

# name: (logits dtype, E, k, topk_router keyword options) as bench/gpu_bench.py's router cases.
ROUTERS = {
    "mixtral": ("bf16", 8, 2, {}),
    "e64-k2": ("bf16", 64, 2, {}),
    "qwen3": ("bf16", 128, 8, {}),
    "qwen3-fp32": ("fp32", 128, 8, {}),
    "deepseek-v3": ("bf16", 256, 8, dict(sigmoid=True, bias=True, groups=8, topk_groups=4)),
}
_ALIGNED = [["tt.divisibility", 16]]


def _as_launched(entry, E: int, k: int, unit_strides: tuple[str, ...]):
    """An AOT_KERNELS entry (kernel, signature, constexprs, options) respecialised as a launch on
    dense rows sees it: the unit strides compile-time constants, the other strides i32, the
    pointers and T 16-byte aligned, E and the row stride (E) too where E is divisible by 16; k a
    compile-time constant (a launch passes it at run time, and LLVM then unrolls the loops over
    the picks by a factor with a remainder loop, which a static count cannot follow; with k known
    each loop left is one pick a trip).
    Returns (kernel, signature, constexprs, aligned argument indices, num_warps)."""
    kernel, signature, constexprs, options = entry
    signature, constexprs = dict(signature), dict(constexprs)
    for name, kind in signature.items():
        if name.startswith("stride") and kind == "i64":
            signature[name] = "i32"
    constexprs.update(dict.fromkeys(unit_strides, 1), K=k, BLOCK_K=triton.next_power_of_2(k))
    constexprs = {n: v for n, v in constexprs.items() if n in signature}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    names = list(signature)
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr") or n == "T"]
    if E % 16 == 0:
        aligned += [names.index("E"), names.index("stride_t")]
    return kernel, signature, constexprs, tuple(aligned), options["num_warps"]


def forward(dt: str, E: int, k: int, opts: dict):
    groups = opts.get("groups", 1)
    entry = topk_router._aot(
        dt, E, sigmoid=opts.get("sigmoid", False), bias=opts.get("bias", False), groups=groups,
        topk_groups=opts.get("topk_groups", groups),
    )  # fmt: skip
    kernel, signature, constexprs, aligned, num_warps = _as_launched(entry, E, k, ("stride_e",))
    if "ranks_in_keys" in opts:
        constexprs["RANKS_IN_KEYS"] = opts["ranks_in_keys"]
    else:
        constexprs["RANKS_IN_KEYS"] = topk_router.uses_ranks_in_keys(constexprs["BLOCK_E"], k, constexprs["ROW_VECTOR"])
    # The rounds' loop: from the second pick where the first is taken before it (the logits rank
    # the experts: no bias, no group limit), else all k.
    ranks_logits = not opts.get("bias", False) and opts.get("topk_groups", groups) == groups
    trips = k - 1 if ranks_logits else k
    return kernel, signature, constexprs, aligned, num_warps, constexprs["BLOCK_T"], trips


def backward(dt: str, E: int, k: int, opts: dict):
    """The backward as autograd launches it (the forward's experts: distinct)."""
    entry = topk_router_backward._aot(dt, E, sigmoid=opts.get("sigmoid", False), k=k)
    kernel, signature, constexprs, aligned, num_warps = _as_launched(entry, E, k, ("stride_e", "stride_gk"))
    # No loop over the choices: they are a [k, rows] tile.
    return kernel, signature, constexprs, aligned, num_warps, constexprs["BLOCK_T"], 1


def maps(E: int):
    """capacity_positions' two O(T k) kernels in the default fill order at k = 8, as ranks()
    launches them for E experts (the packed scan below SORTED_FROM, else sorted blocks):
    [(name, kernel, signature, constexprs, aligned, num_warps, choices a program)]."""
    packed = E < capacity_positions.SORTED_FROM
    if packed:
        kernels = (capacity_positions.packed_counts_kernel, capacity_positions.packed_positions_kernel)
    else:
        kernels = (capacity_positions.block_counts_kernel, capacity_positions.block_positions_kernel)
    out = []
    for kernel in kernels:
        if packed:
            entry = capacity_positions._aot_packed(kernel, capacity_positions.S_MAJOR, E, k=8)
        else:
            entry = capacity_positions._aot_blocks(kernel, capacity_positions.S_MAJOR, E)
        kernel, signature, constexprs, options = entry
        signature = {n: v for n, v in signature.items() if v != "constexpr"}
        choices = constexprs["ROWS"] * constexprs["SEG"] if packed else constexprs["BLOCK_N"]
        out.append((kernel.fn.__name__, kernel, signature, constexprs, (0, 1, 2, 3), options["num_warps"], choices))
    return out


def batchwise(dt: str):
    """batchwise_mask's Triton kernels on `dt` scores as a launch on row-major [T, E] scores with E
    divisible by 16 specialises them (the unit stride_e a constant; pointers, sizes and the row
    stride aligned): [(name, kernel, signature, constexprs, aligned, num_warps, unit, per
    program)], `per program` the scores (list slots for the gather) one program covers."""
    out = []
    entries = batchwise_sampled.AOT_KERNELS + batchwise_mask.AOT_KERNELS
    entries = [e for e in entries if e[1].get("scores_ptr") == f"*{dt}"]  # the score kernels
    for kernel, signature, constexprs, options in entries:
        name = kernel.fn.__name__
        if name == "sample_keys_kernel":
            continue
        signature = {n: ("i32" if n.startswith("stride") else v) for n, v in signature.items() if v != "constexpr"}
        del signature["stride_e"]
        constexprs = dict(constexprs, stride_e=1)
        names = list(signature)
        aligned = tuple(i for i, n in enumerate(names) if n.endswith("_ptr") or n in ("T", "E", "W", "stride_t", "C"))
        if name == "gather_candidates_kernel":
            unit, per_program = "slot", constexprs["BLOCK_C"]
        else:
            unit, per_program = "score", constexprs["BLOCK_T"] * constexprs["GROUP"]
        out.append((name, kernel, signature, constexprs, aligned, options["num_warps"], unit, per_program))
    return out


def sass(kernel, signature, constexprs, aligned, num_warps) -> str:
    """The SASS listing (triton.tools.disasm's form) of `kernel` compiled for sm_90."""
    signature = dict(signature)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    attrs = {(i,): _ALIGNED for i in aligned}
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    listing = get_sass(compiled.asm["cubin"])
    if not listing:
        raise RuntimeError(f"no SASS listing for {kernel.fn.__name__}: is Triton's cuobjdump there?")
    return listing


def _immediate(text: str) -> int | None:
    """An integer immediate operand of SASS (0x7, -0x7fffffef, 15), else None."""
    text = text.strip()
    try:
        return int(text, 0)
    except ValueError:
        return None


def _loop_iterations(ops: list[tuple[str, str, str]], start: int, end: int) -> int | None:
    """How many times the counted loop ops[start:end + 1] (its back branch last) runs, read from
    the listing: the branch's predicate set by `ISETP.NE ... P, PT, R, bound` in the body, R's step
    there (`VIADD R, R, step` or `IADD3 R, R, step`), and R's value before the loop (`MOV` or
    `IMAD.MOV.U32 R, RZ, RZ, init`, or `CS2R R, SRZ`). The compiler unrolls a loop of k picks by a
    factor of its own (at k = 16 it peeled two and ran 7 a trip twice), so a loop trip is not a
    pick. None where any of these is not found (a bound or step in a register: a loop over a
    run-time size)."""
    guard, _, _ = ops[end]
    pred = re.match(r"@(P\d)$", guard)
    if not pred:
        return None
    compare = next(
        (
            i
            for i in range(end - 1, start - 1, -1)
            if ops[i][1].startswith("ISETP") and ops[i][2].split(",")[0].strip() == pred.group(1)
        ),
        None,
    )
    if compare is None or ".NE." not in ops[compare][1] + ".":
        return None
    operands = [o.strip() for o in ops[compare][2].rstrip(";").split(",")]
    if len(operands) < 4:
        return None
    reg, bound = operands[2], _immediate(operands[3])
    if bound is None or not re.fullmatch(r"R\d+", reg):
        return None
    step = None
    for i in range(start, end):
        guard_i, op, args = ops[i]
        parts = [a.strip() for a in args.rstrip(";").split(",")]
        if (
            not guard_i
            and op in ("VIADD", "IADD3")
            and len(parts) >= 3
            and parts[0] == reg
            and parts[1].split(".")[0] == reg
        ):
            step, step_at = _immediate(parts[2]), i
    if not step:
        return None
    init = None
    for i in range(start - 1, -1, -1):
        guard_i, op, args = ops[i]
        parts = [a.strip() for a in args.rstrip(";").split(",")]
        if parts[0] != reg:
            continue
        if guard_i:
            return None
        if op == "MOV" and len(parts) == 2:
            init = _immediate(parts[1])
        elif op == "IMAD.MOV.U32" and len(parts) == 4 and parts[1] == parts[2] == "RZ":
            init = _immediate(parts[3])
        elif op == "CS2R" and parts[1] == "SRZ":
            init = 0
        break
    if init is None:
        return None
    # The compare reads R after the step (the exit when it reaches the bound), or before it.
    span = (bound - init) % (1 << 32) if step > 0 else (init - bound) % (1 << 32)
    if span % abs(step):
        return None
    return span // abs(step) + (0 if step_at < compare else 1)


def hot_path(listing: str, trips: int = 1) -> collections.Counter:
    """Opcode counts (without modifiers) of the instructions up to the last EXIT, each loop's body
    counted as many times as it runs. A listing line is `control<TAB>[@P] OPCODE operands;`, a
    label line `name:` (no tab); a loop is a branch back to a label above it, its body the label
    to the branch. With trips > 1 (the router's rounds over the picks), a loop runs as often as
    its counter says (_loop_iterations: the compiler may run several picks a trip), else `trips`
    times; with trips = 1 loops count once (the other kernels' grid-stride loops over tiles, a
    binary search: their body is the cost of a tile)."""
    ops, labels, loops = [], {}, []
    for line in listing.splitlines():
        label = re.match(r"([.\w$]+):\s*$", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        m = re.match(r"\S+\t(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            opcode = m.group(2)
            if opcode.split(".")[0] == "BRA":
                target = re.search(r"([.\w$]+)\s*;", m.group(3))
                if target and target.group(1) in labels:
                    loops.append((labels[target.group(1)], len(ops)))
            ops.append(((m.group(1) or "").strip(), opcode, m.group(3)))
    last = max((i for i, op in enumerate(ops) if op[1] == "EXIT"), default=len(ops) - 1)
    weight = [1] * (last + 1)
    for start, end in loops:
        runs = trips
        if trips > 1:
            runs = _loop_iterations(ops, start, end) or trips
        for i in range(start, min(end, last) + 1):
            weight[i] *= runs
    counts = collections.Counter()
    for (_, opcode, _), w in zip(ops, weight):
        counts[opcode.split(".")[0]] += w
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", choices=sorted(ROUTERS), help="router shapes (default: all)")
    parser.add_argument("--maps", nargs="*", type=int, default=[8, 32, 256], help="capacity_positions at these E")
    parser.add_argument(
        "--batchwise", nargs="*", choices=["bf16", "fp16", "fp32"], default=["bf16", "fp32"],
        help="batchwise_mask's kernels on these score dtypes",
    )  # fmt: skip
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90, hot-path SASS instructions (router loops x their trips)\n")
    print("| kernel | case | per program | warps | rows | per row | SHFL | REDUX | BAR | MUFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases or ROUTERS:
        for label, spec in (("forward", forward), ("backward", backward)):
            kernel, signature, constexprs, aligned, num_warps, block_t, trips = spec(*ROUTERS[name])
            counts = hot_path(sass(kernel, signature, constexprs, aligned, num_warps), trips)
            total = sum(counts.values())
            print(
                f"| {label} | {name} | {total} | {num_warps} | {block_t} | {total * num_warps / block_t:.0f} | "
                f"{counts['SHFL']} | {counts['REDUX']} | {counts['BAR']} | {counts['MUFU']} |",
                flush=True,
            )
    if args.maps:
        print("\n| kernel | E | per program | warps | choices | per choice |")
        print("|---|---|---|---|---|---|")
    for E in args.maps:
        for name, kernel, signature, constexprs, aligned, num_warps, choices in maps(E):
            total = sum(hot_path(sass(kernel, signature, constexprs, aligned, num_warps)).values())
            print(
                f"| {name} | {E} | {total} | {num_warps} | {choices} | {total * num_warps / choices:.1f} |", flush=True
            )
    if args.batchwise:
        print("\n| kernel | scores | per program | warps | per | per unit |")
        print("|---|---|---|---|---|---|")
    for dt in args.batchwise:
        for name, kernel, signature, constexprs, aligned, num_warps, unit, per_program in batchwise(dt):
            total = sum(hot_path(sass(kernel, signature, constexprs, aligned, num_warps)).values())
            per_unit = total * num_warps / per_program
            print(f"| {name} | {dt} | {total} | {num_warps} | {unit} | {per_unit:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
