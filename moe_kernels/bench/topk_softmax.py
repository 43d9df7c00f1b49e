"""topk_softmax on CPU: the C++ kernel vs the reference vs the plain PyTorch sequence
(softmax -> topk -> renormalise), eager and under torch.compile (dynamic=False, compile time
excluded from the timings and listed under the table), forward, and forward+backward. The
"read pass" row (`x.amax(1)`, one read of the logits) is the memory-bandwidth limit of the forward;
the "forward + write" row (our forward, then a fresh [T, E] tensor allocated and filled, as the
backward's gradient is) is the limit of forward+backward that issue 16 measures against.
Rows with `full` in the config are renormalize=False (the Switch / GShard convention: the
full-softmax probabilities of the selected experts), against the same sequence without the renormalisation.

    .venv/bin/python bench/bench_topk_softmax.py [--quick]
    python -m moe_kernels.bench --op topk_softmax [--quick]
"""

import torch

import moe_kernels
from moe_kernels import reference
from moe_kernels.bench.output import report
from moe_kernels.bench.timing import compile_sequence, measure_interleaved
from moe_kernels.ops import topk_softmax

QUICK = "one small configuration (smoke test)"


def torch_sequence(logits, k, renormalize=True):
    """What MoE code usually writes (Mixtral / HF): softmax, topk, renormalise (Switch: no renormalise)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


PROVIDERS = {
    "moe_kernels": topk_softmax,
    "reference": reference.topk_softmax,
    "torch sequence": torch_sequence,
}


def run(args):
    """args: quick, out (the results folder), compile (the torch.compile baseline), command (for the table)."""
    grid = (
        [(4096, 8, 2, True), (4096, 8, 2, False)]
        if args.quick
        else [(T, E, k, True) for T in (4096, 65536) for E in (8, 64, 256) for k in (1, 2, 8) if k <= E]
        + [(65536, E, k, False) for E in (8, 64, 256) for k in (1, 2, 8) if k <= E]
    )
    print(f"backend: {moe_kernels.backends()['topk_router']}")
    rows, compile_notes = [], []
    for T, E, k, renormalize in grid:
        x = torch.randn(T, E)
        config = {"T": T, "E": E, "k": k} | ({} if renormalize else {"full": 1})
        if args.compile:
            compiled, seconds = compile_sequence(torch_sequence, x, k, renormalize)
            compile_notes.append(f"| {' '.join(f'{a}={b}' for a, b in config.items())} | {seconds:.1f} |")
        # Each mode's providers timed in alternating rounds (measure_interleaved), so that the
        # ratios compare the same stretches of this shared machine's time.
        forward = {name: (lambda fn=fn: fn(x, k, renormalize)) for name, fn in PROVIDERS.items()}
        if args.compile:
            forward["torch.compile sequence"] = lambda: compiled(x, k, renormalize)
        forward["read pass"] = lambda: x.amax(1)
        moved = dict.fromkeys(forward, x.numel() * 4 + T * k * 12) | {"read pass": x.numel() * 4}
        rows += measure_interleaved("topk_softmax", forward, config=config, bytes_moved=moved)
        backward = {}
        for name, fn in PROVIDERS.items():
            xg = x.clone().requires_grad_()
            g = torch.randn(T, k)

            def step(fn=fn, xg=xg, g=g):
                xg.grad = None
                fn(xg, k, renormalize)[0].backward(g)

            backward[name] = step

        def forward_and_write():
            topk_softmax(x, k, renormalize)
            return torch.empty(T, E).fill_(0.0)

        backward["forward + write"] = forward_and_write
        rows += measure_interleaved("topk_softmax", backward, config=config, mode="fwd+bwd")
    report(
        "topk_softmax" + ("_quick" if args.quick else ""),
        rows,
        out=args.out,
        baseline="torch sequence",
        providers=[*PROVIDERS, "torch.compile sequence", "read pass", "forward + write"],
        command=args.command or "make bench (or .venv/bin/python bench/bench_topk_softmax.py)",
        notes="Each configuration's providers are timed in 15 alternating rounds per mode (forward, fwd+bwd), "
        "so every ratio compares the same stretches of the machine's time.\n\n"
        + (
            "torch.compile (dynamic=False) of the torch sequence, first-call compile time:\n\n"
            "| config | compile s |\n|---|---|\n" + "\n".join(compile_notes)
            if compile_notes
            else ""
        ),
    )
