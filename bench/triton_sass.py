"""Static instruction counts of Triton kernels for sm_90 (the router's, the routing maps',
batchwise_mask's), without a GPU: each kernel
compiled ahead of time as a GPU launch specialises it (16-byte aligned pointers, sizes divisible
by 16, the unit stride a compile-time 1, k a compile-time constant), then the SASS of its hot path
(up to the last EXIT: the out-of-line slow paths of the IEEE division after it are left out)
counted in the listing triton.tools.disasm gives (Triton's own cuobjdump). The router forward's loops
over the k picks count as many times as they run, read from the loop's counter (the compiler may
run several picks a trip; else one pick a trip); the other kernels' loops (grid-stride loops over
tiles, a binary search) count once.

A program's hot path runs once per program (BLOCK_T rows), every warp of it issuing each
instruction: `per row` is the hot path times num_warps over BLOCK_T, the warp instructions a row
costs. An instruction count is not a time (latency, memory, the MUFU and shuffle rates): it
compares kernel versions here, and the GPU benchmarks (bench/gpu_bench.py) time them.

    python bench/triton_sass.py [--cases qwen3 ...] [--maps 8 256] [--batchwise bf16 fp32]

batchwise_mask: warp instructions a score (a word of a column for gather_candidates_kernel, its
rounds over the words' set bits counted once), each program's tile as launched.
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
    "e64-k8": ("bf16", 64, 8, {}),  # OLMoE's shape: 16 rows a program (topk_router.choice_rows)
    "qwen3-fp32": ("fp32", 128, 8, {}),
    "deepseek-v3": ("bf16", 256, 8, dict(sigmoid=True, bias=True, groups=8, topk_groups=4)),
    # DeepSeek-V3 without its group limit, and without its bias too (its logits then rank the
    # experts, and only the picks' scores are computed): what each part of its count costs.
    "deepseek-v3-no-groups": ("bf16", 256, 8, dict(sigmoid=True, bias=True)),
    "sigmoid-256": ("bf16", 256, 8, dict(sigmoid=True)),
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
    if "sorted_runs" in opts:
        constexprs["SORTED_RUNS"] = opts["sorted_runs"]
    else:
        constexprs["SORTED_RUNS"] = topk_router.uses_sorted_runs(constexprs["BLOCK_E"], k, constexprs["ROW_VECTOR"])
    constexprs["CHOICE_ROWS"] = topk_router.choice_rows(constexprs["BLOCK_T"], constexprs["BLOCK_K"])
    # The path of a program without near ties: retire_value_keys's exact second pass, which runs
    # only where a row's k + 1 best keys come within 2^INDEX_BITS key steps, left out.
    constexprs["NEAR_TIES"] = False
    # The rounds' loop: from the second pick where the first is taken before it (the logits rank
    # the experts: no bias, no group limit; the packed rounds over value keys), else all k.
    ranks_logits = not opts.get("bias", False) and opts.get("topk_groups", groups) == groups
    trips = k - 1 if ranks_logits or constexprs["SORTED_RUNS"] else k
    return kernel, signature, constexprs, aligned, num_warps, constexprs["BLOCK_T"], trips


def backward(dt: str, E: int, k: int, opts: dict):
    """The backward as autograd launches it (the forward's experts: distinct)."""
    entry = topk_router_backward._aot(dt, E, sigmoid=opts.get("sigmoid", False), k=k)
    kernel, signature, constexprs, aligned, num_warps = _as_launched(entry, E, k, ("stride_e", "stride_gk"))
    # No loop over the choices: they are a [k, rows] tile ([rows, k] where CHOICE_ROWS).
    constexprs["CHOICE_ROWS"] = topk_router_backward.backward_choice_rows(constexprs["BLOCK_T"], constexprs["BLOCK_K"])
    constexprs["VECTOR_STORES"] = topk_router_backward.vector_stores(E, constexprs["ROW_VECTOR"])
    constexprs["STORE_TRANSPOSED"] = topk_router_backward.store_transposed(
        constexprs["BLOCK_T"], constexprs["BLOCK_K"], num_warps
    )
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
            unit, per_program = "word", constexprs["BLOCK_W"]
        elif name == "chosen_words_kernel":
            unit, per_program = "score", 32 * constexprs["WORDS"] * constexprs["COLS"]
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
    """An integer immediate operand of SASS (0x7, -0x7fffffef, 15; RZ is 0) as a signed 32-bit
    value (0xfffffff9 is -7), else None."""
    text = text.strip()
    if text == "RZ":
        return 0
    try:
        value = int(text, 0)
    except ValueError:
        return None
    return (value + (1 << 31)) % (1 << 32) - (1 << 31)


def _operands(args: str) -> list[str]:
    """An instruction's operands without the .reuse flags: ' R17, R17.reuse, 0x7;' -> [R17, R17, 0x7]."""
    return [a.strip().removesuffix(".reuse") for a in args.strip().rstrip(";").split(",")]


def _writes(op: str, operands: list[str], reg: str) -> bool:
    """Whether the instruction writes register `reg`: its first operand, or the high half of a
    64-bit destination that starts one register below (CS2R, .64 and .WIDE forms)."""
    if not operands or not re.fullmatch(r"R\d+", reg):
        return False
    if operands[0] == reg:
        return True
    pair = op.startswith("CS2R") or ".64" in op or ".WIDE" in op
    return pair and operands[0] == f"R{int(reg[1:]) - 1}"


def _exit_compare(ops, start: int, end: int) -> tuple[str, int, int] | None:
    """(counter register, bound, index) of the compare that decides the back branch ops[end]:
    `@P BRA` after `ISETP.NE ... P, PT, R, bound, PT`, or `@!P BRA` after ISETP.EQ; None else."""
    guard = re.fullmatch(r"@(!?)(P\d)", ops[end][0])
    if not guard:
        return None
    negated, pred = guard.groups()
    for i in range(end - 1, start - 1, -1):
        op, operands = ops[i][1], _operands(ops[i][2])
        if operands[0] != pred:
            continue
        wanted = ".EQ." if negated else ".NE."
        if not op.startswith("ISETP") or wanted not in op + "." or len(operands) != 5:
            return None
        if operands[1] != "PT" or operands[4] != "PT":  # the exit would depend on another predicate
            return None
        bound = _immediate(operands[3])
        if bound is None or not re.fullmatch(r"R\d+", operands[2]):
            return None
        return operands[2], bound, i
    return None


def _step(ops, start: int, end: int, reg: str) -> tuple[int, int] | None:
    """(the counter's step a trip, the index of its last step) when every write to `reg` in the
    body is an unguarded `VIADD reg, reg, imm` or `IADD3 reg, reg, imm, RZ`; None else."""
    step, last = 0, None
    for i in range(start, end):
        guard, op, args = ops[i]
        operands = _operands(args)
        if not _writes(op, operands, reg):
            continue
        by = _immediate(operands[2]) if len(operands) >= 3 and operands[1] == reg else None
        rest_zero = all(o == "RZ" for o in operands[3:])
        if guard or op not in ("VIADD", "IADD3") or by is None or not rest_zero:
            return None
        step, last = step + by, i
    return (step, last) if step else None


def _init(ops, start: int, reg: str, label_at: set[int]) -> int | None:
    """The counter's value when the loop starts: its last write before ops[start] in straight-line
    code (`MOV`, `IMAD.MOV.U32 reg, RZ, RZ, imm`, `CS2R` of zero into either half of its pair);
    None where a label or branch comes first (another path into the loop) or the write is another
    kind (a 64-bit result over the pair, a computed value)."""
    for i in range(start - 1, -1, -1):
        if i + 1 in label_at and i + 1 != start:
            return None
        guard, op, args = ops[i]
        if op.split(".")[0] == "BRA":
            return None
        operands = _operands(args)
        if not _writes(op, operands, reg):
            continue
        if guard:
            return None
        if op == "CS2R" and operands[1:] == ["SRZ"]:  # both halves of its pair
            return 0
        if operands[0] != reg:
            return None
        if op == "MOV" and len(operands) == 2:
            return _immediate(operands[1])
        if op == "IMAD.MOV.U32" and len(operands) == 4 and operands[1] == operands[2] == "RZ":
            return _immediate(operands[3])
        return None
    return None


def _loop_iterations(ops, start: int, end: int, label_at: set[int]) -> int | None:
    """How many times the counted loop ops[start:end + 1] (its back branch last) runs, read from
    the listing: the counter the exit compares with a constant bound, its step in the body and its
    value before the loop. The compiler unrolls a loop over the k picks by a factor of its own (at
    k = 16 it peeled two and ran 7 a trip twice), so a trip is not a pick. None where it cannot
    be read (a bound in a register: a loop over a run-time size)."""
    compare = _exit_compare(ops, start, end)
    if compare is None:
        return None
    reg, bound, compare_at = compare
    step = _step(ops, start, end, reg)
    init = _init(ops, start, reg, label_at)
    if step is None or init is None:
        return None
    (by, step_at), span = step, (bound - init) % (1 << 32)
    if by < 0:
        span, by = (init - bound) % (1 << 32), -by
    if span % by:
        return None
    # The compare reads the counter after its step (the exit when it reaches the bound), or before.
    return span // by + (0 if step_at < compare_at else 1)


def hot_path(listing: str, trips: int = 1) -> collections.Counter:
    """Opcode counts (without modifiers) of the instructions up to the last EXIT, each loop's body
    counted as many times as it runs. A listing line is `control<TAB>[@P] OPCODE operands;`, a
    label line `name:` (no tab); a loop is a branch back to a label above it, its body the label
    to the branch. With trips > 1 (the router's k picks), a loop runs as often as its counter
    says (_loop_iterations: the compiler may run several picks a trip) where that is 1 to `trips`
    times, else `trips` times, with a note on stderr; with trips = 1 loops count once (the other
    kernels' grid-stride loops over tiles, a binary search: their body is the cost of a tile)."""
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
    last = max((i for i, op in enumerate(ops) if op[1].split(".")[0] == "EXIT"), default=len(ops) - 1)
    weight = [1] * (last + 1)
    label_at = set(labels.values())
    for start, end in loops:
        runs = trips
        if trips > 1 and start <= last:
            read = _loop_iterations(ops, start, end, label_at)
            if read is not None and 1 <= read <= trips:
                runs = read
            else:
                print(f"note: a loop's trips not read from its counter; counted {trips} times", file=sys.stderr)
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
    print(f"triton {triton.__version__}, sm_90, hot-path SASS instructions (router loops x the times they run)\n")
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
        print("\n| kernel | E | per program | warps | choices | per choice | BAR |")
        print("|---|---|---|---|---|---|---|")
    for E in args.maps:
        for name, kernel, signature, constexprs, aligned, num_warps, choices in maps(E):
            counts = hot_path(sass(kernel, signature, constexprs, aligned, num_warps))
            total = sum(counts.values())
            per_choice = total * num_warps / choices
            print(
                f"| {name} | {E} | {total} | {num_warps} | {choices} | {per_choice:.1f} | {counts['BAR']} |", flush=True
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
