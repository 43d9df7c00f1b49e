"""Tiny transformers MoE models from their configs (random weights; nothing is downloaded)."""

import torch

# model_type -> config overrides beyond the shared shrinking (each says why it is needed).
FAMILIES = {
    "mixtral": {},
    "qwen2_moe": {"norm_topk_prob": True, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {"norm_topk_prob": False},
    "qwen3_next": {"norm_topk_prob": True, "shared_expert_intermediate_size": 32},
    "olmoe": {},
    # Multi-head latent attention (deepseek_v2 / v3, mistral4, longcat_flash, axk2, mistral_large4): as
    # many key / value heads as query heads. Fewer make transformers' attention with a mask (a padded
    # batch) repeat the keys to twice the query heads (a size mismatch, unpatched too).
    "deepseek_v2": {
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.0,
        "num_key_value_heads": 4,
    },
    "deepseek_v3": {
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_key_value_heads": 4,
    },
    "glm4_moe": {"n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.5},
    "dots1": {"n_group": 2, "topk_group": 1},
    "minimax_m2": {},
    "ernie4_5_moe": {},
    "gpt_oss": {},
    "granitemoe": {},
    "jamba": {},
    "llama4_text": {},
    "dbrx": {},
    "lfm2_moe": {},
    "aria_text": {},
    "cohere2_moe": {"num_shared_experts": 1},
    "flint": {"mlp_only_layers": [], "shared_expert_intermediate_size": 32},
    "hunyuan_v1_moe": {},
    "laguna": {
        "mlp_layer_types": ["sparse", "sparse"],
        "num_attention_heads_per_layer": [4, 4],
        "shared_expert_intermediate_size": 32,
        "moe_router_logit_softcapping": 2.0,
    },
    "minimax_m3_vl_text": {"shared_intermediate_size": 32, "dense_intermediate_size": 64},
    "beam": {"mlp_layer_types": ["sparse", "sparse"], "n_group": 2, "topk_group": 1},
    "mistral4": {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5, "num_key_value_heads": 4},
    "axk2": {
        "mlp_layer_types": ["sparse", "sparse"],
        "n_group": 4,
        "topk_group": 2,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "num_key_value_heads": 4,
    },
    "inkling_text": {"swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16},
    # unpadded_vocab_size: the rows of its lm_head in 5.24 (200,058 by default); 5.23 cuts its logits to it.
    "inkling2_text": {
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "unpadded_vocab_size": 128,
    },
    "openai_privacy_filter": {"pad_token_id": 0},
    "zaya": {"router_hidden_size": 32},
    "jetmoe": {},
    "longcat_flash": {
        "num_layers": 2,
        "zero_expert_num": 2,
        "num_key_value_heads": 4,
        "qk_head_dim": 16,
        "head_dim": 8,
    },  # a token classifier (MODEL_CLASSES): logits per token, no generation
    # multimodal (MULTIMODAL below): overrides of the text config
    "mistral_large4": {
        "mlp_layer_types": ["sparse", "sparse"],
        "num_key_value_heads": 4,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 4,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
    },
    "step3p7": {
        "mlp_layer_types": ["sparse", "sparse"],
        "layer_types": ["full_attention", "sliding_attention"],
        "sliding_window": 8,
        "share_expert_dim": 32,
    },
    "muse_spark": {"moe_hidden_size": 32},
    "gemma4_text": {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32},
}

# Multimodal models whose MoE is in the language model: the class built and its top-level
# overrides. Their vision (and audio) parts only have to build: the tests give text only.
MULTIMODAL = {
    "mistral_large4": ("MistralLarge4ForConditionalGeneration", {}),
    "step3p7": ("Step3p7ForConditionalGeneration", {}),
    "muse_spark": (
        "MuseSparkForConditionalGeneration",
        {
            "audio_config": {"hidden_sizes": [8, 8, 8, 8], "depths": [1, 1, 1, 1], "out_hidden_size": 64},
            "out_hidden_size": 64,
            "projector_hidden_size": 32,
        },
    ),
}
VISION = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16}

SHRINK = {
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 64,
    "intermediate_size_mlp": 64,
    "moe_intermediate_size": 32,
    "ffn_hidden_size": 32,
    "num_hidden_layers": 2,
    "n_layers": 2,
    "num_attention_heads": 4,
    "n_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "num_local_experts": 8,
    "num_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "moe_k": 2,
    "first_k_dense_replace": 0,
    "moe_layer_start_index": 0,
    "num_dense_layers": 0,
    "max_position_embeddings": 256,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_shared_experts": 1,
}


def shrink_to(layers: int) -> dict:
    """SHRINK with `layers` decoder layers."""
    return SHRINK | {"num_hidden_layers": layers, "n_layers": layers}


def _multimodal_config(model_type: str, layers: int):
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    # Sub-configs passed as dicts, so that their __post_init__ derives what depends on the sizes.
    text = {k: v for k, v in shrink_to(layers).items() if hasattr(default.text_config, k)} | FAMILIES[model_type]
    vision = {k: v for k, v in VISION.items() if hasattr(default.vision_config, k)}
    return AutoConfig.for_model(model_type, text_config=text, vision_config=vision, **MULTIMODAL[model_type][1])


def tiny_config(model_type: str, layers: int = SHRINK["num_hidden_layers"]):
    """A config of `model_type` at SHRINK's sizes with `layers` decoder layers."""
    from transformers import AutoConfig

    if model_type in MULTIMODAL:
        return _multimodal_config(model_type, layers)
    shrink = shrink_to(layers)
    config = AutoConfig.for_model(model_type)
    if model_type == "gemma4_text":  # per-layer attributes (head_dim, ...): shrink them globally
        config.allow_global_per_layer_attribute_access = True
    sub = getattr(config, "ffn_config", None)
    for target in (config, sub):
        if target is None:
            continue
        default_layers = getattr(target, "num_hidden_layers", None)
        for key, value in list(vars(target).items()):  # per-layer lists follow the shrunk layer count
            if isinstance(value, list) and default_layers and len(value) == default_layers > layers:
                setattr(target, key, value[:layers])
        for key, value in shrink.items():
            if hasattr(target, key):
                setattr(target, key, value)
        for key, value in FAMILIES[model_type].items():
            if hasattr(target, key) or target is config:
                setattr(target, key, value)
    if model_type == "jamba":
        config.attn_layer_period, config.attn_layer_offset = 2, 1
        config.expert_layer_period, config.expert_layer_offset = 1, 0
        config.mamba_d_state, config.mamba_expand, config.mamba_dt_rank = 8, 2, 8
    if model_type == "lfm2_moe":
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        config.num_dense_layers = 0
    if model_type == "qwen3_next":  # one linear-attention and one full-attention layer
        config.layer_types = ["linear_attention", "full_attention"]
    if model_type == "gpt_oss":
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    if model_type.startswith("deepseek"):  # rope on qk_rope_head_dim
        config.head_dim = config.qk_rope_head_dim
    if model_type in ("mistral4", "axk2"):  # multi-head latent attention: derived in __post_init__
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        if model_type == "axk2":  # rope on qk_rope_head_dim (mistral4: partial_rotary_factor)
            config.head_dim = config.qk_rope_head_dim
    if model_type == "llama4_text":
        config.interleave_moe_layer_step = 1
        config.moe_layers = list(range(config.num_hidden_layers))
        config.no_rope_layers = [1] * config.num_hidden_layers
    if model_type == "dbrx":
        config.ffn_config.moe_num_experts, config.ffn_config.moe_top_k = 8, 2
        config.ffn_config.ffn_hidden_size = 32
        if not hasattr(config.attn_config, "rope_theta"):
            config.attn_config.rope_theta = 10000.0
        config.attn_config.clip_qkv = 8.0  # None crashes in transformers 5.23 and 5.24 (clamp with no bound)
    return config


# Models that AutoModelForCausalLM does not map in transformers 5.23 and 5.24.
MODEL_CLASSES = {
    "mistral4": "Mistral4ForCausalLM",
    "openai_privacy_filter": "OpenAIPrivacyFilterForTokenClassification",
}
GENERATES = [family for family in FAMILIES if family != "openai_privacy_filter"]
# Routers per model where it is not one per num_hidden_layers: JetMoE routes its attention heads
# and its MLP; a LongCat-Flash layer (num_layers of them) is two of its num_hidden_layers.
ROUTER_COUNT = {"jetmoe": ("num_hidden_layers", 2), "longcat_flash": ("num_layers", 1)}


def num_routers(model, model_type: str) -> int:
    attribute, per_layer = ROUTER_COUNT.get(model_type, ("num_hidden_layers", 1))
    return per_layer * getattr(model.config.get_text_config(), attribute)


def keep_fp32_strict(model):
    """What from_pretrained keeps in float32 (from_config and .to(dtype) do not), back in float32."""
    strict = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if any(pattern in name for pattern in strict):
            t.data = t.data.float()
    return model


def tiny_model(model_type: str, dtype=torch.float32, seed: int = 0, layers: int = SHRINK["num_hidden_layers"]):
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(model_type, layers)
    name = MULTIMODAL[model_type][0] if model_type in MULTIMODAL else MODEL_CLASSES.get(model_type)
    if name is not None:
        model = getattr(transformers, name)(config).to(dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if dtype != torch.float32:
        keep_fp32_strict(model)
    # Random, not zero, routers (several families zero-initialise theirs: every token would tie).
    with torch.no_grad():
        for name, p in model.named_parameters():
            router = "router" in name or "gate" in name.split(".")[-2:][0] or ".gate." in name  # HunYuan: gate.wg
            if p.dim() >= 1 and (router or "bias" in name):
                p.normal_(0, 0.5)
        if model_type == "zaya":  # its router is an MLP: unit-gain layers keep the logits O(1)
            for name, p in model.named_parameters():
                if ".gate." in name and p.dim() == 2:
                    p.normal_(0, (3 if "out_proj" in name else 1) * p.shape[1] ** -0.5)
                elif ".gate." in name and "norm" in name:
                    p.fill_(1.0)
        for name, b in model.named_buffers():
            if "correction_bias" in name or "expert_bias" in name or "balancing_biases" in name:
                b.copy_(0.05 * torch.randn_like(b))
            if "balancing_biases" in name:  # Zaya's last class is its skip expert: make tokens pick it
                b[-1] = 0.2
    return model.eval()
