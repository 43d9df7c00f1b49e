"""Static instruction counts of the router's Triton kernels for sm_90, without a GPU: each kernel
compiled ahead of time as a GPU launch specialises it (16-byte aligned pointers, sizes divisible
by 16, the unit stride a compile-time 1), k fixed so the selection rounds unroll, then the SASS
of its hot path (up to the last EXIT: the out-of-line slow paths of the IEEE division after it
are left out) counted in the listing triton.tools.disasm gives (Triton's own cuobjdump).

A program's hot path runs once per program (BLOCK_T rows), every warp of it issuing each
instruction: `per row` is the hot path times num_warps over BLOCK_T, the warp instructions a row
costs. An instruction count is not a time (latency, memory, the MUFU and shuffle rates): it
compares kernel versions here, and the GPU benchmarks (bench/gpu_bench.py) time them.

    python bench/triton_sass.py [--cases qwen3 ...]
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

from moe_kernels.triton import capacity_positions, topk_router, topk_router_backward
from moe_kernels.triton.common import row_tile_config

# name: (logits dtype, E, k, topk_router keyword options) as bench/gpu_bench.py's router cases.
ROUTERS = {
    "mixtral": ("bf16", 8, 2, {}),
    "e64-k2": ("bf16", 64, 2, {}),
    "qwen3": ("bf16", 128, 8, {}),
    "qwen3-fp32": ("fp32", 128, 8, {}),
    "deepseek-v3": ("bf16", 256, 8, dict(sigmoid=True, bias=True, groups=8, topk_groups=4)),
}
_ALIGNED = [["tt.divisibility", 16]]


def forward(dt: str, E: int, k: int, opts: dict):
    _, block_t, block_e, num_warps = topk_router.launch_config(1 << 20, E)
    groups = opts.get("groups", 1)
    signature = {
        "logits_ptr": f"*{dt}",
        "bias_ptr": "*fp32",
        "weights_ptr": "*fp32",
        "experts_ptr": "*i64",
        "T": "i32",
        "E": "i32",
        "stride_t": "i32",
        "stride_e": "constexpr",
        "K": "constexpr",
        "scaling": "fp32",
    }
    constexprs = {
        "stride_e": 1,
        "K": k,
        "SIGMOID": opts.get("sigmoid", False),
        "HAS_BIAS": opts.get("bias", False),
        "NUM_GROUPS": groups,
        "TOPK_GROUPS": opts.get("topk_groups", groups),
        "GROUP_MAX": False,
        "GROUPS_RESHAPED": E == block_e,
        "RENORMALIZE": True,
        "BLOCK_T": block_t,
        "BLOCK_E": block_e,
        "BLOCK_G": triton.next_power_of_2(groups),
        "BLOCK_K": triton.next_power_of_2(k),
        "ROW_VECTOR": topk_router.row_vector(block_e, 4 if dt == "fp32" else 2),
        "ALIGNED_ROWS": True,  # dense rows: stride_t = E, a multiple of ROW_VECTOR at these E
    }
    # The pointers and T; E and the row stride (E, dense rows) where a launch sees them divisible by 16.
    aligned = (0, 1, 2, 3, 4) + ((5, 6) if E % 16 == 0 else ())
    return topk_router.topk_router_kernel, signature, constexprs, aligned, num_warps, block_t


def backward(dt: str, E: int, k: int, opts: dict):
    _, block_t, block_e, num_warps = row_tile_config(
        1 << 20, E, topk_router_backward._TILE, topk_router_backward._PER_THREAD
    )
    signature = {
        "grad_weights_ptr": "*fp32",
        "logits_ptr": f"*{dt}",
        "experts_ptr": "*i64",
        "grad_ptr": f"*{dt}",
        "T": "i32",
        "E": "i32",
        "stride_t": "i32",
        "stride_e": "constexpr",
        "stride_gt": "i32",
        "stride_gk": "constexpr",
        "K": "constexpr",
        "scaling": "fp32",
    }
    constexprs = {
        "stride_e": 1,
        "stride_gk": 1,
        "K": k,
        "SIGMOID": opts.get("sigmoid", False),
        "RENORMALIZE": True,
        "BLOCK_T": block_t,
        "BLOCK_E": block_e,
        "ROW_VECTOR": topk_router.row_vector(block_e, 4 if dt == "fp32" else 2),
        "ALIGNED_ROWS": True,
    }
    aligned = (0, 1, 2, 3, 4) + ((5, 6) if E % 16 == 0 else ())
    return topk_router_backward.topk_router_backward_kernel, signature, constexprs, aligned, num_warps, block_t


def maps(E: int):
    """capacity_positions' two O(T k) kernels in the default fill order, as ranks() launches them
    for E experts: [(name, kernel, signature, constexprs, aligned, num_warps, choices a program)]."""
    out = []
    for kernel in (capacity_positions.block_counts_kernel, capacity_positions.block_positions_kernel):
        kernel, signature, constexprs, options = capacity_positions._aot_blocks(kernel, capacity_positions.S_MAJOR, E)
        signature = {n: v for n, v in signature.items() if v != "constexpr"}
        out.append(
            (
                kernel.fn.__name__,
                kernel,
                signature,
                constexprs,
                (0, 1, 2, 3),
                options["num_warps"],
                constexprs["BLOCK_N"],
            )
        )
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
    return get_sass(compiled.asm["cubin"])


def hot_path(listing: str) -> collections.Counter:
    """Opcode counts (without modifiers) of the instructions up to the last EXIT. A listing line
    is `control<TAB>[@P] OPCODE operands;` (labels and the function's name have no tab)."""
    ops = []
    for line in listing.splitlines():
        m = re.match(r"[^\t\s]+\t(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops.append(m.group(1))
    last = max((i for i, op in enumerate(ops) if op == "EXIT"), default=len(ops) - 1)
    return collections.Counter(ops[: last + 1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="*", choices=sorted(ROUTERS), help="router shapes (default: all)")
    parser.add_argument("--maps", nargs="*", type=int, default=[8, 256], help="capacity_positions at these E")
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90, hot-path SASS instructions (k unrolled)\n")
    print("| kernel | case | per program | warps | rows | per row | SHFL | REDUX | BAR | MUFU |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.cases or ROUTERS:
        for label, spec in (("forward", forward), ("backward", backward)):
            kernel, signature, constexprs, aligned, num_warps, block_t = spec(*ROUTERS[name])
            counts = hot_path(sass(kernel, signature, constexprs, aligned, num_warps))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
