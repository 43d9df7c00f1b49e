"""moe_kernels.compat against transcriptions of the libraries' own routing (test_deepspeed.py,
test_megatron.py, test_torchtitan.py, each at the commit it names) and its earlier, simplified
readings deepspeed_gating / megatron_routing (test_legacy.py)."""
