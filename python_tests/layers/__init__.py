"""The layers (moe_kernels.layers): MoE and HierarchicalMoE (test_moe.py), MultiGateMoE and DSelect-k
inside MoE (test_multigate.py)."""
