"""The gates (moe_kernels.gates): a file per gate, named after its module (test_<module>.py), and
gates inside MoE (test_batchwise_moe.py, test_masks.py)."""
