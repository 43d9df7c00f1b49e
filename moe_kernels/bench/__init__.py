"""The op benchmarks, shipped with the package: `python -m moe_kernels.bench` (or `moe-kernels-bench`)
runs them from an installed moe_kernels; the repository's bench/bench_<op>.py scripts and `make bench`
call the same code.

    timing.py      the device, the warm allocator, timing (median and quantiles), result rows
    output.py      the CSV and markdown each benchmark writes into a folder the caller names
    plot.py        a results CSV as a PNG (needs matplotlib)
    <bench>.py     one benchmark each (BENCHES below): `run(args)`, `QUICK` (what --quick measures),
                   `add_arguments(parser)` for its own flags where it has some
    __main__.py    the command line

This file imports nothing heavy: a benchmark's module (and what it needs: scipy, transformers,
torch.distributed) is imported only when it runs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    """One benchmark: moe_kernels.bench.<name>, what it times, the modules it needs beyond torch,
    and the devices it runs on (a CPU-only one: its baseline or its processes are CPU code)."""

    name: str
    summary: str
    needs: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu", "cuda")


BENCHES = (
    Bench("topk_softmax", "topk_softmax vs softmax -> topk -> renormalise, eager and compiled, fwd and fwd+bwd"),
    Bench("routers", "topk_router vs the router code of Mixtral, Qwen3-MoE, DeepSeek-V3 (eager and compiled)"),
    Bench("dispatch", "capacity routing step fwd+bwd vs einsum (GShard) and torch index ops (eager and compiled)"),
    Bench("batchwise", "batchwise_mask vs torch.topk(dim=0) + scatter (eager and compiled)"),
    Bench("dselect", "dselect_k vs its plain-PyTorch reference (eager and compiled)"),
    Bench("noisy_topk", "the noisy top-k gate fwd+bwd vs the same math in plain PyTorch (eager and compiled)"),
    Bench("assignment", "balanced_assignment vs scipy's linear_sum_assignment, greedy, Sinkhorn", ("scipy",), ("cpu",)),
    Bench(
        "expert_parallel",
        "expert-parallel MoE step with 1, 2, 4 processes (CPU/gloo proxy)",
        ("torch.distributed",),
        ("cpu",),
    ),
    Bench(
        "transformers", "transformers MoE blocks patched vs transformers' experts implementations", ("transformers",)
    ),
    Bench("decode", "transformers models patched vs unpatched at a few tokens (decode, prefill)", ("transformers",)),
)
BY_NAME = {b.name: b for b in BENCHES}


def unavailable(bench: Bench, device: str) -> str | None:
    """Why `bench` cannot run here on `device` (a missing module, a CPU-only benchmark), or None."""
    if device not in bench.devices:
        return f"runs on {' / '.join(bench.devices)} only (asked: --device {device})"
    for module in bench.needs:
        if module == "torch.distributed":
            import torch.distributed

            if not torch.distributed.is_available():
                return "needs torch.distributed (this torch build has none)"
        elif importlib.util.find_spec(module) is None:
            return f"needs {module} (pip install {module})"
    return None
