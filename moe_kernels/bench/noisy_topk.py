"""Noisy top-k gating (Shazeer et al. 2017, eqs 3-5 and 8-11) forward + backward on CPU: the
fused path of NoisyTopKGate (moe_kernels.gates.noisy_topk.noisy_topk_routing: one
ops.noisy_topk_gate pass gives the noise, the top k, the weights and Load(X)) against a
plain-PyTorch gate doing the same math the way the authors' tensor2tensor code and FastMoE write
it (topk(k+1), scatter to a dense [T, E] gate matrix, two threshold CDFs and a select).

Both start from the same clean logits x W_g, raw noise logits x W_noise and noise sample [T, E]
(the two matmuls with the input are identical for both and left out), and end with
loss = sum(weights * g) + w_importance CV(Importance)^2 + w_load CV(Load)^2, backpropagated to
both logit tensors.

    .venv/bin/python bench/bench_noisy_topk.py [--quick]
    python -m moe_kernels.bench --op noisy_topk [--quick]
"""

import torch

import moe_kernels
from moe_kernels.bench.output import bandwidth_section, compile_notes, report
from moe_kernels.bench.timing import compile_sequence, copy_pass, generator, measure
from moe_kernels.gates.noisy_topk import noisy_topk_routing
from moe_kernels.ops import load_probabilities, noisy_topk_gate

QUICK = "one small configuration (smoke test)"

# The bytes each forward op must move at least (float32 [T, E] inputs), docs/noisy_topk.md.
BYTES_MODEL = (
    "Bytes moved, the least each forward must move (float32): noisy_topk_gate reads clean, raw and "
    "noise [T, E] and writes weights and experts [T, k]: 12 T E + 12 T k; load_probabilities reads "
    "clean, noisy and stddev [T, E] and writes P [T, E]: 16 T E."
)

W_IMPORTANCE = W_LOAD = 0.1
EPS = 1e-2


def cv_squared(x):
    return x.var(unbiased=False) / (x.mean() ** 2 + 1e-10)


def plain_torch(clean, raw, noise, k):
    """The paper's gate in plain PyTorch (tensor2tensor / FastMoE structure)."""
    T, E = clean.shape
    stddev = torch.nn.functional.softplus(raw) + EPS
    noisy = clean + noise * stddev
    top_values, top_indices = noisy.topk(min(k + 1, E), dim=1)
    weights = torch.softmax(top_values[:, :k], dim=1)
    experts = top_indices[:, :k]
    gates = torch.zeros_like(noisy).scatter(1, experts, weights)
    importance = gates.sum(0)
    # P(x, i): the (k+1)-th value is the threshold of the top k, the k-th that of the others.
    threshold_in = top_values[:, k : k + 1]
    threshold_out = top_values[:, k - 1 : k]
    normal = torch.distributions.Normal(0.0, 1.0)
    is_in = noisy > threshold_in
    prob = torch.where(is_in, normal.cdf((clean - threshold_in) / stddev), normal.cdf((clean - threshold_out) / stddev))
    load = prob.sum(0)
    aux = W_IMPORTANCE * cv_squared(importance) + W_LOAD * cv_squared(load)
    return experts, weights, aux


def fused(clean, raw, noise, k):
    experts, weights, aux, _ = noisy_topk_routing(clean, raw, noise, k, W_IMPORTANCE, W_LOAD, EPS)
    return experts, weights, aux


PROVIDERS = {"moe_kernels": fused, "plain torch": plain_torch}


def run(args):
    """args: quick, out (the results folder), compile (the torch.compile baseline), command (for the
    table)."""
    grid = [(4096, 64, 2)] if args.quick else [(16384, E, k) for E in (16, 64, 256) for k in (2, 4)]
    print(f"backend: {moe_kernels.backends()['load_probabilities']}")
    rows, notes, bandwidth = [], [], []
    for T, E, k in grid:
        g = generator(0)
        clean = torch.randn(T, E, generator=g)
        raw = torch.randn(T, E, generator=g)
        noise = torch.randn(T, E, generator=g)
        upstream = torch.randn(T, k, generator=g)
        config = {"T": T, "E": E, "k": k}
        timed = dict(PROVIDERS)
        if args.compile:
            c0, r0 = clean.clone().requires_grad_(), raw.clone().requires_grad_()
            compiled, seconds = compile_sequence(plain_torch, c0, r0, noise, k)
            notes.append(
                f"| torch.compile plain torch | {' '.join(f'{a}={b}' for a, b in config.items())} | {seconds:.1f} |"
            )
            timed["torch.compile plain torch"] = compiled
        for name, fn in timed.items():
            c = clean.clone().requires_grad_()
            r = raw.clone().requires_grad_()

            def step(fn=fn, c=c, r=r):
                c.grad = r.grad = None
                _, weights, aux = fn(c, r, noise, k)
                ((weights * upstream).sum() + aux).backward()

            mem = name in PROVIDERS
            rows.append(measure("noisy_topk", name, step, config=config, mode="fwd+bwd", memory=mem))
        # One read of the three [T, E] inputs: a loose limit (forward and backward read and write more).
        rows.append(
            measure(
                "noisy_topk",
                "read pass",
                lambda: (clean.amax(1), raw.amax(1), noise.amax(1)),
                config=config,
                mode="fwd+bwd",
                bytes_moved=3 * clean.numel() * 4,
            )
        )
        # The two forward ops alone, in GB/s of their bytes models, next to copy_ of those bytes.
        with torch.no_grad():
            stddev = torch.nn.functional.softplus(raw) + EPS
            noisy = clean + noise * stddev
            for op, fn, nbytes in (
                ("noisy_topk_gate", lambda: noisy_topk_gate(clean, raw, noise, k, EPS), 12 * T * E + 12 * T * k),
                ("load_probabilities", lambda: load_probabilities(clean, noisy, stddev, k), 16 * T * E),
            ):
                row = measure(op, "moe_kernels", fn, config=config, bytes_moved=nbytes)
                bandwidth.append((op, config, nbytes, row, copy_pass(config, nbytes)))
    name = "noisy_topk" + ("_quick" if args.quick else "")
    md = report(
        name,
        rows,
        out=args.out,
        baseline="plain torch",
        providers=[*PROVIDERS, "torch.compile plain torch", "read pass"],
        command=args.command or ".venv/bin/python bench/bench_noisy_topk.py",
        notes=compile_notes(notes)
        + ("\n\n(The backward's compilation falls in the warm-up runs, never in the timings.)" if notes else ""),
    )
    tail = bandwidth_section(BYTES_MODEL, bandwidth)
    print(tail)
    (args.out / f"{name}.md").write_text(md + tail)
