"""Triton kernels, one module per op (moe_kernels/triton/<op>.py): kernel, launcher, custom op.

Every kernel here is run by the tests under TRITON_INTERPRET=1 on CPU tensors and compiled ahead
of time for sm_80 / sm_90 (python_tests/builds/test_triton_aot.py), which needs `AOT_KERNELS` below.
"""
