"""The Triton router's two pick recordings timed against each other on a GPU (issue 33).

moe_kernels/triton/topk_router.py records the forward's picks in a [rows, k] tile or by rounds over
sorted runs (each pick's expert stored in its round), chosen by `uses_sorted_runs` (from the H200's
times of this script where it ran, from static sm_90 instruction counts, bench/triton_sass.py,
elsewhere). This runs the forward with that rule forced each way at fifteen shapes, in one process:
each row the kernel time of one call (CUDA-graph replay, the median of rounds), the op's
bytes-moved model over it, and that as a share of copy_ of the same bytes measured in the same run;
before them the launcher's recording at one, two and four row tiles a program (MULTI_TILES) and
at three launch tiles (more rows a thread: TILES) at the goals' shapes; then each shape's fwd+bwd
with the launcher's choice. Every variant must give the same
experts: a shape where one does not is listed under the tables (and the exit status is 1), its
timings kept. Each line is printed as it comes, so a call stopped at its limit keeps its rows.

    python3 bench/gpu_router_variants.py [--tokens 262144] [--out FILE.md]
    python3 bench/gpu_router_variants.py --smoke   # tiny CPU tensors under TRITON_INTERPRET=1, untimed
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants  # noqa: E402
from common import time_gpu  # noqa: E402
from variants import Lines, copy_seconds  # noqa: E402

import moe_kernels  # noqa: E402
from moe_kernels import ops as K  # noqa: E402
from moe_kernels.triton import topk_router as _router  # noqa: E402
from moe_kernels.triton import topk_router_backward as _backward  # noqa: E402
from moe_kernels.triton.common import row_tile_config  # noqa: E402

GROUPED = dict(scoring="sigmoid", num_groups=8, topk_groups=4, renormalize=True, scaling_factor=2.5)
# (name, E, k, dtype, keywords, bias): the shapes where the counts chose, and their neighbours.
SHAPES = [
    ("qwen3", 128, 8, torch.bfloat16, dict(renormalize=True), False),
    ("qwen3", 128, 8, torch.float32, dict(renormalize=True), False),
    ("e64-k8", 64, 8, torch.bfloat16, dict(renormalize=True), False),
    ("e128-k6", 128, 6, torch.bfloat16, dict(renormalize=True), False),
    ("e128-k4", 128, 4, torch.bfloat16, dict(renormalize=True), False),
    ("grouped-e128", 128, 8, torch.bfloat16, GROUPED, True),
    ("deepseek-v3", 256, 8, torch.bfloat16, GROUPED, True),
    # k a quarter of the row or more, and k = 5 at 8 entries a thread: the runs by counts that
    # follow a partly unrolled loop; Qwen3-Next's E = 512, k = 10.
    ("e32-k8", 32, 8, torch.bfloat16, dict(renormalize=True), False),
    ("e16-k4", 16, 4, torch.bfloat16, dict(renormalize=True), False),
    ("e256-k5", 256, 5, torch.bfloat16, dict(renormalize=True), False),
    ("e512-k10", 512, 10, torch.bfloat16, dict(renormalize=True), False),
    # k = 2 and 3, where the counts of the sorted runs chose: the runs with 4 entries a thread
    # from E = 32 at k = 2 and everywhere at k = 3, the tile with 8 at k = 2.
    ("e64-k2", 64, 2, torch.bfloat16, dict(renormalize=True), False),
    ("e128-k3", 128, 3, torch.float32, dict(renormalize=True), False),
    ("e256-k2", 256, 2, torch.bfloat16, dict(renormalize=True), False),
    ("e256-k3", 256, 3, torch.bfloat16, dict(renormalize=True), False),
]


def run(tokens: int, device: str, timed: bool) -> tuple[list[str], bool]:
    """The report's lines, and whether the two recordings agreed at every shape."""
    device_name = torch.cuda.get_device_name() if timed else "smoke"
    lines = Lines()
    lines.append(f"Triton topk_router forward variants, T = {tokens} ({device_name}), {len(SHAPES)} shapes")
    original = _router.uses_sorted_runs
    gen = torch.Generator(device=device).manual_seed(0)
    disagreements: list[str] = []
    try:
        # What no GPU has timed yet first, so that a call cut at its limit has timed them.
        multi_tile_rows(lines, tokens, device, gen, timed, disagreements)
        tile_rows(lines, tokens, device, gen, timed, disagreements)
        lines += [
            "",
            "| shape | dtype | recording | launcher's | ms | GB/s | of copy_ |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, E, k, dtype, kw, has_bias in SHAPES:
            logits = torch.randn(tokens, E, device=device, generator=gen).to(dtype)
            bias = 0.1 * torch.randn(E, device=device, generator=gen) if has_bias else None
            size = logits.element_size()
            moved = tokens * E * size + tokens * k * 12  # read the logits, write weights and experts
            copy = copy_seconds(moved, device) if timed else 0.0
            _, _, block_e, _ = _router.launch_config(tokens, E)
            chosen = original(block_e, k, _router.row_vector(block_e, size))
            results = {}
            for value in (False, True):
                _router.uses_sorted_runs = lambda *shape, value=value: value

                def call(value=value):
                    return K.topk_router(logits, k, bias=bias, **kw)

                with moe_kernels.use_backend("triton"):
                    results[value] = call()
                    seconds = time_gpu(call)[0] if timed else 0.0
                label = "sorted runs" if value else "[rows, k] tile"
                ms, gbps, share = "-", "-", "-"
                if timed:
                    ms, gbps, share = f"{seconds * 1e3:.4f}", f"{moved / seconds / 1e9:.1f}", f"{copy / seconds:.0%}"
                mark = "yes" if value == chosen else ""
                lines.append(f"| {name} | {str(dtype)[6:]} | {label} | {mark} | {ms} | {gbps} | {share} |")
            # A disagreement is a finding of the run, written beside its timings (which a raise here
            # would lose with the rest of the device call's tables); main() then returns 1.
            difference = _difference(results[False], results[True])
            if difference:
                disagreements.append(f"- {name} {str(dtype)[6:]}: {difference}")
        _router.uses_sorted_runs = original
        lines += ["", "| shape | dtype | fwd+bwd ms |", "|---|---|---|"]
        for name, E, k, dtype, kw, has_bias in SHAPES:
            logits = torch.randn(tokens, E, device=device, generator=gen).to(dtype).requires_grad_()
            bias = 0.1 * torch.randn(E, device=device, generator=gen) if has_bias else None

            # The weights' gradient made once, outside the timed calls (as gpu_bench's _grad_of).
            ones = torch.ones(tokens, k, device=device)

            def step(logits=logits, bias=bias, k=k, kw=kw, ones=ones):
                w, _ = K.topk_router(logits, k, bias=bias, **kw)
                return torch.autograd.grad(w, logits, ones)

            with moe_kernels.use_backend("triton"):
                step()
                seconds = time_gpu(step)[0] if timed else 0.0
            lines.append(f"| {name} | {str(dtype)[6:]} | {f'{seconds * 1e3:.4f}' if timed else '-'} |")
    finally:
        _router.uses_sorted_runs = original
    if disagreements:
        lines += ["", "## Variants that disagree", "", *disagreements]
    return lines, not disagreements


# The forward's launch tile (row_tile_config's values a program and values a thread), the
# launcher's first: more rows a thread give each warp more independent rounds to interleave, where
# at full occupancy (21-32 registers) the rounds' dependent reductions may be what the forward
# waits on (docs/routers.md). The shapes: those of issue 33's goals and E = 128, k = 4.
TILES = ((_router._TILE, _router._PER_THREAD), (2048, 16), (4096, 32))
TILE_SHAPES = ("qwen3", "deepseek-v3", "e64-k2", "e128-k4")
# Row tiles a program (topk_router.multi_tile), the launcher's first: each tile's logits loaded
# during the rounds of the one before, where a program of one tile waits for its logits before any
# round (more registers a thread: 32 -> 40 at Qwen3-MoE, fewer programs an SM).
MULTI_TILES = (1, 2, 4)


def tile_rows(lines: list[str], tokens: int, device: str, gen, timed: bool, disagreements: list[str]) -> None:
    """The launcher's recording at each of TILES, at TILE_SHAPES: the table, added to `lines`."""

    def launch_tile(tile: int, per_thread: int):
        def config(T, E):
            return row_tile_config(T, E, tile, per_thread)

        def cells(E: int) -> str:
            _, rows, _, warps = config(tokens, E)
            return f"{rows} | {warps}"

        return {(_router, "launch_config"): config}, cells

    settings = [launch_tile(tile, per_thread) for tile, per_thread in TILES]
    heading = ["| shape | dtype | rows a program | warps | ms | of copy_ |", "|---|---|---|---|---|---|"]
    setting_rows(lines, heading, settings, tokens, device, gen, timed, disagreements)


def multi_tile_rows(lines: list[str], tokens: int, device: str, gen, timed: bool, disagreements: list[str]) -> None:
    """The launcher's recording at each of MULTI_TILES, at TILE_SHAPES: the forward's table, then
    fwd+bwd's with the forward at one tile a program and the backward at each, added to `lines`."""
    settings = [({(_router, "multi_tile"): lambda n, t=t: t}, lambda E, t=t: str(t)) for t in MULTI_TILES]
    heading = ["| shape | dtype | tiles a program | ms | of copy_ |", "|---|---|---|---|---|"]
    setting_rows(lines, heading, settings, tokens, device, gen, timed, disagreements)
    settings = [({(_backward, "backward_multi_tile"): lambda n, t=t: t}, lambda E, t=t: str(t)) for t in MULTI_TILES]
    heading = ["| shape | dtype | backward's tiles a program | fwd+bwd ms | of copy_ |", "|---|---|---|---|---|"]
    setting_rows(lines, heading, settings, tokens, device, gen, timed, disagreements, backward=True)


def setting_rows(
    lines, heading, settings, tokens: int, device: str, gen, timed: bool, disagreements, backward: bool = False
) -> None:
    """The launcher's recording at TILE_SHAPES under each of `settings`, each ({(module,
    attribute): replacement}, a function of E giving the row's cells that name the setting), the
    launcher's own first: `heading`, then a row each, added to `lines`; a setting whose picks (and
    gradients, with `backward`: each row then times the forward and autograd's backward) differ
    from the first's is added to `disagreements`."""
    lines += ["", *heading]
    originals = {key: getattr(*key) for patches, _ in settings for key in patches}
    try:
        for name, E, k, dtype, kw, has_bias in (s for s in SHAPES if s[0] in TILE_SHAPES):
            logits = torch.randn(tokens, E, device=device, generator=gen).to(dtype).requires_grad_(backward)
            bias = 0.1 * torch.randn(E, device=device, generator=gen) if has_bias else None
            size = logits.element_size()
            # The forward reads the logits and writes the picks; the backward reads them, the
            # logits again and the weights' gradient, and writes the logits' gradient.
            moved = tokens * E * size + tokens * k * 12 + (tokens * (2 * E * size + k * 16) if backward else 0)
            copy = copy_seconds(moved, device) if timed else 0.0
            ones = torch.ones(tokens, k, device=device)  # the weights' gradient, made once
            first = None
            for patches, cells in settings:
                for (module, attribute), value in {**originals, **patches}.items():
                    setattr(module, attribute, value)

                def call(logits=logits, bias=bias, k=k, kw=kw, ones=ones):
                    w, e = K.topk_router(logits, k, bias=bias, **kw)
                    return (w, e, *torch.autograd.grad(w, logits, ones)) if backward else (w, e)

                with moe_kernels.use_backend("triton"):
                    result = call()
                    seconds = time_gpu(call)[0] if timed else 0.0
                if first is None:
                    first = result
                elif difference := _difference(first, result, ("the launcher's", "this setting")):
                    disagreements.append(
                        f"- {name} {str(dtype)[6:]}, {heading[0].split('|')[3].strip()} {cells(E)}: {difference}"
                    )
                ms, share = (f"{seconds * 1e3:.4f}", f"{copy / seconds:.0%}") if timed else ("-", "-")
                lines.append(f"| {name} | {str(dtype)[6:]} | {cells(E)} | {ms} | {share} |")
    finally:
        for (module, attribute), value in originals.items():
            setattr(module, attribute, value)


def _difference(tile: tuple, runs: tuple, names: tuple[str, str] = ("the tile", "the runs")) -> str:
    """'' where two variants' (weights, experts[, gradient]) agree (the experts equal, the weights
    to float32 rounding, the gradients bit for bit), else what differs: the rows with other
    experts, the largest weight gap, or the gradients'. `names`: how the rows name the two."""
    (w_tile, e_tile, *g_tile), (w_runs, e_runs, *g_runs) = tile, runs
    rows = (e_tile != e_runs).any(dim=1)
    if bool(rows.any()):
        first = int(rows.nonzero()[0, 0])
        return (
            f"{int(rows.sum())} rows pick other experts (row {first}: "
            f"{e_tile[first].tolist()} by {names[0]}, {e_runs[first].tolist()} by {names[1]})"
        )
    if not torch.allclose(w_tile, w_runs, rtol=1e-6, atol=1e-7):
        return f"same experts, weights apart by up to {float((w_tile - w_runs).abs().max()):.3g}"
    for a, b in zip(g_tile, g_runs, strict=True):
        if not torch.equal(a.nan_to_num(), b.nan_to_num()):
            return f"same picks, gradients apart by up to {float((a.float() - b.float()).abs().max()):.3g}"
    return ""


def main(argv=None) -> int:
    return variants.main(
        argv,
        __doc__,
        "gpu_router_variants",
        "T = 16 on CPU tensors (TRITON_INTERPRET=1), untimed",
        smoke=lambda args: run(16, "cpu", timed=False),
        timed=lambda args: run(args.tokens, "cuda", timed=True),
        options=((("--tokens",), dict(type=int, default=262144)),),
    )


if __name__ == "__main__":
    sys.exit(main())
