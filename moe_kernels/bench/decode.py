"""Patched vs unpatched transformers models at a few tokens: one decode step with a KV cache
(B = 1 and 8 sequences, one new token each, after a 64-token context), a 512-token prefill, and
the router and experts modules alone at T = 1, 8 and 64 tokens.

Four families at their real router shapes (Mixtral E=8 k=2; Qwen3-MoE E=128 k=8; DeepSeek-V3
E=256 k=8 with 8 groups, top-4 groups and a correction bias; GPT-OSS E=32 k=4), with a narrow
model so that it runs on a CPU: 2 layers, hidden 512, expert width 128, 8 heads, vocab 1024.
Patched = apply_moe_kernels (our router and experts); unpatched = transformers 5.23 as configured
(its default experts implementation, grouped_mm). Timings interleaved (common.measure_interleaved):
each round times both, so a slow spell of the machine falls on both alike.

    .venv/bin/python bench/bench_decode.py [--quick]
    python -m moe_kernels.bench --op decode [--quick]    (needs transformers)
"""

import copy

import torch

from moe_kernels.bench.output import report
from moe_kernels.bench.timing import generator, measure_interleaved
from moe_kernels.integrations.transformers import apply_moe_kernels

# family -> config overrides: the router's real shape
FAMILIES = {
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128},
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 128, "norm_topk_prob": True},
    "deepseek_v3": {
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "moe_intermediate_size": 128,
        "first_k_dense_replace": 0,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": None,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "num_key_value_heads": 8,
    },
    "gpt_oss": {"num_local_experts": 32, "num_experts_per_tok": 4, "intermediate_size": 128, "layer_types": None},
}
SHARED = {
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
}


def build(family: str):
    """(unpatched model, patched model): the same random weights; the router biases random."""
    import transformers

    config = transformers.AutoConfig.for_model(family)
    for key, value in {**SHARED, **FAMILIES[family]}.items():
        setattr(config, key, value)
    if family == "gpt_oss":
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    if family == "deepseek_v3":
        config.head_dim = config.qk_rope_head_dim
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name.split(".")[-2] or "router" in name:
                p.normal_(0, 0.5 * p.shape[-1] ** -0.5 if p.dim() == 2 else 0.5)
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.copy_(0.05 * torch.randn_like(b))
    patched = copy.deepcopy(model)
    report = apply_moe_kernels(patched)
    assert report["patched"] and not report["skipped"], report
    return model, patched


def routers_and_experts(model):
    """(first router module, first experts module) of a model."""
    router = next(m for m in model.modules() if "_moe_kernels_code" in vars(m) or type(m).__name__.endswith("Router"))
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    return router, experts


def decode_step(model, batch: int, context: int):
    """A function that runs one decode step (one new token per sequence) on a cache of `context`
    tokens, then crops the cache back: every call sees the same cache."""
    gen = generator(batch)
    ids = torch.randint(0, SHARED["vocab_size"], (batch, context), generator=gen)
    new = torch.randint(0, SHARED["vocab_size"], (batch, 1), generator=gen)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values

    def step():
        with torch.no_grad():
            out = model(new, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # the new token out again
        return out.logits

    return step


QUICK = "two families, fewer rounds (smoke test)"


def run(args):
    """args: quick, out (the results folder), command (for the table). The baseline is the
    unpatched model (no torch.compile row)."""
    families = ("mixtral", "deepseek_v3") if args.quick else tuple(FAMILIES)
    timing = {"rounds": 3, "reps": 6, "min_time": 0.03} if args.quick else {"rounds": 15, "reps": 30, "min_time": 0.6}
    rows = []
    for family in families:
        model, patched = build(family)
        models = {"moe_kernels": patched, "transformers": model}
        for batch in (1, 8):
            step = {name: decode_step(m, batch, 64) for name, m in models.items()}
            torch.testing.assert_close(step["moe_kernels"](), step["transformers"](), rtol=1e-4, atol=1e-4)
            rows += measure_interleaved(
                "decode", step, config={"family": family, "B": batch, "context": 64}, mode="decode step", **timing
            )
        ids = torch.randint(0, SHARED["vocab_size"], (1, 128 if args.quick else 512))

        def prefill(m, ids=ids):
            with torch.no_grad():
                return m(ids, use_cache=False).logits

        rows += measure_interleaved(
            "decode",
            {name: (lambda m=m: prefill(m)) for name, m in models.items()},
            config={"family": family, "T": ids.shape[1]},
            mode="prefill",
            **timing,
        )
        router_p, experts_p = routers_and_experts(patched)
        router_u, experts_u = routers_and_experts(model)
        d = SHARED["hidden_size"]
        for T in (1, 8, 64):
            h = torch.randn(T, d, generator=generator(T))

            def call_router(r, h=h):
                with torch.no_grad():
                    return r(h)

            rows += measure_interleaved(
                "decode",
                {"moe_kernels": lambda: call_router(router_p), "transformers": lambda: call_router(router_u)},
                config={"family": family, "T": T},
                mode="router",
                **timing,
            )
            with torch.no_grad():
                _, weights, index = router_u(h)

            def call_experts(e, h=h, index=index, weights=weights):
                with torch.no_grad():
                    return e(h, index, weights)

            rows += measure_interleaved(
                "decode",
                {"moe_kernels": lambda: call_experts(experts_p), "transformers": lambda: call_experts(experts_u)},
                config={"family": family, "T": T},
                mode="experts",
                **timing,
            )
    report(
        "decode" + ("_quick" if args.quick else ""),
        rows,
        out=args.out,
        baseline="transformers",
        providers=["moe_kernels", "transformers"],
        command=args.command or "make bench (or .venv/bin/python bench/bench_decode.py)",
        notes="Ratios above 1: the patched model is faster. One decode step = one new token per sequence.",
    )
