"""moe_kernels.integrations: transformers models patched by apply_moe_kernels (tiny models from their
configs, support/hf_tiny.py) and our experts forward against transformers' own."""
