"""Whole MoE blocks of transformers families on CPU: patched by apply_moe_kernels (our router on
topk_router, our experts implementation) vs each of transformers' own experts implementations
(eager, grouped_mm = transformers' default, batched_mm) with the family's own router.

One block (router + experts + shared experts where the family has them) built from the family's
config with random weights, T tokens of width d, E experts, k per token, expert width d_ff.
batched_mm is skipped where the expert weights it gathers per token would exceed 2 GiB
(T k 3 d_ff d float32: 12 GiB at T=4096, k=2, d=1024, d_ff=256).
Forward, and forward+backward (gradients of the hidden states and every parameter).

    .venv/bin/python bench/bench_transformers.py [--quick]
    python -m moe_kernels.bench --op transformers [--quick]    (needs transformers)
"""

import importlib

import torch

from moe_kernels.bench.output import report
from moe_kernels.bench.timing import generator, measure
from moe_kernels.integrations import transformers_experts
from moe_kernels.integrations.transformers import apply_moe_kernels

# family -> (modeling module, block class, config overrides naming E, k, d, d_ff)
BLOCKS = {
    "mixtral": ("mixtral", "MixtralSparseMoeBlock", "num_local_experts", "intermediate_size"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "num_experts", "moe_intermediate_size"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3MoE", "n_routed_experts", "moe_intermediate_size"),
    "gpt_oss": ("gpt_oss", "GptOssMLP", "num_local_experts", "intermediate_size"),
}
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
QUICK = "small blocks (smoke test)"


def block(family, d, E, k, d_ff, implementation):
    from transformers import AutoConfig

    module_name, class_name, experts_key, ff_key = BLOCKS[family]
    config = AutoConfig.for_model(family)
    config.hidden_size = d
    setattr(config, experts_key, E)
    setattr(config, ff_key, d_ff)
    config.num_experts_per_tok = k
    if family == "deepseek_v3":
        config.n_group, config.topk_group, config.n_shared_experts = 8, 4, 1
    config._experts_implementation = implementation
    torch.manual_seed(0)
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    moe = getattr(modeling, class_name)(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe, config


def run(args):
    """args: quick, out (the results folder), command (for the table). The baselines are
    transformers' own experts implementations (no torch.compile row)."""
    T, d, E, d_ff = (256, 64, 16, 32) if args.quick else (4096, 1024, 64, 256)
    ks = (2,) if args.quick else (2, 8)
    families = ("mixtral", "deepseek_v3") if args.quick else tuple(BLOCKS)
    transformers_experts.register()
    rows = []
    for family in families:
        for k in ks:
            x = torch.randn(T, d, generator=generator(1))
            config_row = {"family": family, "T": T, "d": d, "E": E, "k": k, "d_ff": d_ff}
            providers = {}
            for implementation in IMPLEMENTATIONS:
                # batched_mm gathers every selected expert's weights per token: T k (3 d_ff) d floats.
                if implementation == "batched_mm" and T * k * 3 * d_ff * d * 4 > 2**31:
                    continue
                providers[implementation] = block(family, d, E, k, d_ff, implementation)[0]
            patched, _ = block(family, d, E, k, d_ff, "moe_kernels")
            apply_moe_kernels(patched)  # the router (the experts implementation is set above)
            providers["moe_kernels"] = patched

            def output(moe, h):
                out = moe(h.unsqueeze(0))
                return out[0] if isinstance(out, tuple) else out

            for name, moe in providers.items():
                with torch.no_grad():
                    rows.append(measure("moe_block", name, lambda m=moe: output(m, x), config=config_row, reps=5))
            for name, moe in providers.items():
                xg = x.clone().requires_grad_()

                def step(m=moe):
                    m.zero_grad(set_to_none=True)
                    xg.grad = None
                    output(m, xg).square().mean().backward()

                rows.append(measure("moe_block", name, step, config=config_row, mode="fwd+bwd", reps=5))
    report(
        "transformers" + ("_quick" if args.quick else ""),
        rows,
        out=args.out,
        baseline="grouped_mm",
        providers=["moe_kernels", "grouped_mm", "eager", "batched_mm"],
        command=args.command or "make bench (or .venv/bin/python bench/bench_transformers.py)",
    )
