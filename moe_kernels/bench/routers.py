"""topk_router on CPU vs the routing code of the transformers families it replaces.

The baselines are the families' router code after the router's linear layer (the linear is the
same matmul either way and would hide the routing), transcribed from transformers 5.23:
  - mixtral:      models/mixtral/modeling_mixtral.py, MixtralTopKRouter.forward
                  (softmax in float32, topk, renormalise);
  - qwen3_moe:    models/qwen3_moe/modeling_qwen3_moe.py, Qwen3MoeTopKRouter.forward with
                  norm_topk_prob=False (softmax, topk, cast);
  - deepseek_v3:  models/deepseek_v3/modeling_deepseek_v3.py, DeepseekV3TopkRouter.forward
                  (sigmoid, correction bias, top-2-sum group scores, top groups, masked topk,
                  gather, renormalise, scale).
Forward and forward+backward (the gradient of the weights with respect to the logits), with a
read pass of the logits (`x.amax(1)`, the forward's limit) and "forward + write" (our forward,
then a fresh [T, E] tensor allocated and filled: the limit of forward + backward).

    .venv/bin/python bench/bench_routers.py [--quick]
    python -m moe_kernels.bench --op routers [--quick]
"""

import torch

import moe_kernels
from moe_kernels.bench.output import compile_notes, report
from moe_kernels.bench.timing import compile_sequence, generator, measure_interleaved
from moe_kernels.ops import topk_router

QUICK = "two small configurations (smoke test)"


def mixtral(logits, k, bias, G, topk_group):
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    top_value, indices = torch.topk(probs, k, dim=-1)
    top_value = top_value / top_value.sum(dim=-1, keepdim=True)  # in place in transformers
    return top_value, indices


def qwen3_moe(logits, k, bias, G, topk_group):
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top_value, indices = torch.topk(probs, k, dim=-1)
    return top_value.to(logits.dtype), indices


def deepseek_v3(logits, k, bias, G, topk_group, scaling=2.5):
    E = logits.shape[-1]
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


FAMILIES = {
    "mixtral": (mixtral, dict(renormalize=True)),
    "qwen3_moe": (qwen3_moe, dict()),
    "deepseek_v3": (deepseek_v3, dict(scoring="sigmoid", renormalize=True, scaling_factor=2.5)),
}


def ours(family):
    kwargs = FAMILIES[family][1]

    def run(logits, k, bias, G, topk_group):
        if family == "deepseek_v3":
            return topk_router(logits, k, bias=bias, num_groups=G, topk_groups=topk_group, **kwargs)
        return topk_router(logits, k, **kwargs)

    return run


def grid(quick):
    if quick:
        return [("mixtral", 4096, 64, 2, 1, 1), ("deepseek_v3", 4096, 256, 8, 8, 4)]
    rows = []
    for T in (4096, 65536):
        for E in (64, 256):
            rows += [("mixtral", T, E, 2, 1, 1), ("mixtral", T, E, 8, 1, 1), ("qwen3_moe", T, E, 8, 1, 1)]
        rows.append(("deepseek_v3", T, 256, 8, 8, 4))
    return rows


def run(args):
    """args: quick, out (the results folder), compile (the torch.compile baseline), command (for the table)."""
    print(f"backend: {moe_kernels.backends()['topk_router']}")
    rows, notes = [], []
    for family, T, E, k, G, topk_group in grid(args.quick):
        gen = generator(T + E)
        x = torch.randn(T, E, generator=gen)
        bias = 0.01 * torch.randn(E, generator=gen)
        config = {"family": family, "T": T, "E": E, "k": k} | ({"groups": f"{topk_group}/{G}"} if G > 1 else {})
        providers = {"moe_kernels": ours(family), "transformers": FAMILIES[family][0]}
        if args.compile:
            compiled, seconds = compile_sequence(FAMILIES[family][0], x, k, bias, G, topk_group)
            cfg = " ".join(f"{a}={b}" for a, b in config.items())
            notes.append(f"| torch.compile transformers | {cfg} | {seconds:.1f} |")
        # Each mode's providers timed in alternating rounds (measure_interleaved), so that the
        # ratios compare the same stretches of this shared machine's time.
        forward = {name: (lambda fn=fn: fn(x, k, bias, G, topk_group)) for name, fn in providers.items()}
        if args.compile:
            forward["torch.compile transformers"] = lambda: compiled(x, k, bias, G, topk_group)
        forward["read pass"] = lambda: x.amax(1)
        moved = dict.fromkeys(forward, x.numel() * 4 + T * k * 12) | {"read pass": x.numel() * 4}
        rows += measure_interleaved("topk_router", forward, config=config, bytes_moved=moved, memory=list(providers))
        backward = {}
        for name, fn in providers.items():
            xg = x.clone().requires_grad_()
            g = torch.randn(T, k, generator=gen)

            def step(fn=fn, xg=xg, g=g):
                xg.grad = None
                fn(xg, k, bias, G, topk_group)[0].backward(g)

            backward[name] = step

        def forward_and_write(fn=providers["moe_kernels"]):
            # Our forward, then a fresh [T, E] tensor allocated and filled, as the backward's
            # gradient is: the limit of forward + backward that issue 16 measures against.
            fn(x, k, bias, G, topk_group)
            return torch.empty(T, E).fill_(0.0)

        backward["forward + write"] = forward_and_write
        rows += measure_interleaved("topk_router", backward, config=config, mode="fwd+bwd")
    report(
        "routers" + ("_quick" if args.quick else ""),
        rows,
        out=args.out,
        baseline="transformers",
        providers=["moe_kernels", "transformers", "torch.compile transformers", "read pass", "forward + write"],
        command=args.command or "make bench (or .venv/bin/python bench/bench_routers.py)",
        notes="Each configuration's providers are timed in 15 alternating rounds per mode (forward, fwd+bwd), "
        "so every ratio compares the same stretches of the machine's time.\n\n" + compile_notes(notes),
    )
