"""dselect_k on CPU (per-example gate, B rows): the fused C++ kernels vs plain PyTorch (the
reference: smooth-step, a [B, k, 2^m, m] where/prod selector, softmax-weighted sum, autograd),
forward and forward+backward. Goal (issue 6): >= 2x at n = 64, k = 4 for forward+backward.

    .venv/bin/python bench/bench_dselect.py [--quick]
    python -m moe_kernels.bench --op dselect [--quick]
"""

import torch

import moe_kernels
from moe_kernels import reference
from moe_kernels.bench.output import bandwidth_section, compile_notes, report
from moe_kernels.bench.timing import copy_pass, measure, measure_compiled
from moe_kernels.ops import dselect_k
from moe_kernels.reference.dselect_k import num_bits

QUICK = "one small configuration (smoke test)"

# The bytes the forward must move at least (float32), docs/dselect_k.md.
BYTES_MODEL = (
    "Bytes moved, the least the forward must move (float32): dselect_k reads alpha [B, k] and z "
    "[B, k, m] and writes the gates [B, n]: 4 B (k + k m + n)."
)

PROVIDERS = {
    "moe_kernels": lambda a, z, n: dselect_k(a, z, n, 1.0),
    "torch (reference)": lambda a, z, n: reference.dselect_k(a, z, n, 1.0),
}


def run(args):
    """args: quick, out (the results folder), compile (the torch.compile baseline), command (for the
    table)."""
    grid = [(512, 16, 2)] if args.quick else [(4096, n, k) for n in (16, 64, 256) for k in (2, 4)]
    print(f"backend: {moe_kernels.backends()['dselect_k']}")
    rows, notes, bandwidth = [], [], []
    for B, n, k in grid:
        m = num_bits(n)
        alpha = torch.randn(B, k)
        z = torch.randn(B, k, m) * 0.3  # inside the fractional region: every selector entry nonzero
        config = {"B": B, "n": n, "k": k}
        for name, fn in PROVIDERS.items():
            rows.append(measure("dselect_k", name, lambda fn=fn: fn(alpha, z, n), config=config, memory=True))
        if args.compile:
            rows.append(
                measure_compiled(
                    "dselect_k",
                    "torch.compile reference",
                    PROVIDERS["torch (reference)"],
                    alpha,
                    z,
                    n,
                    config=config,
                    notes=notes,
                )
            )
        # The inputs are small ([B, k] and [B, k, m]): writing the [B, n] gates once is the limit.
        out = torch.empty(B, n)
        rows.append(measure("dselect_k", "write pass", out.zero_, config=config, bytes_moved=out.numel() * 4))
        nbytes = 4 * B * (k + k * m + n)
        row = measure(
            "dselect_k", "moe_kernels", lambda: dselect_k(alpha, z, n, 1.0), config=config, bytes_moved=nbytes
        )
        bandwidth.append(("dselect_k", config, nbytes, row, copy_pass(config, nbytes)))
        for name, fn in PROVIDERS.items():
            a = alpha.clone().requires_grad_()
            zz = z.clone().requires_grad_()
            g = torch.randn(B, n)

            def step(fn=fn, a=a, zz=zz, g=g):
                a.grad = zz.grad = None
                fn(a, zz, n).backward(g)

            rows.append(measure("dselect_k", name, step, config=config, mode="fwd+bwd"))
    name = "dselect_k" + ("_quick" if args.quick else "")
    md = report(
        name,
        rows,
        out=args.out,
        baseline="torch (reference)",
        providers=[*PROVIDERS, "torch.compile reference", "write pass"],
        command=args.command or ".venv/bin/python bench/bench_dselect.py",
        notes=compile_notes(notes),
    )
    tail = bandwidth_section(BYTES_MODEL, bandwidth)
    print(tail)
    (args.out / f"{name}.md").write_text(md + tail)
