"""The ops (moe_kernels.ops, with moe_kernels.reference and the kernels behind them).

A file per op, named after it (test_<op>.py; test_<op>_reference.py and test_<op>_cuda_emulation.py
beside it where the op has them), then the sweeps over every op: fuzzing against the reference,
bad arguments, non-finite inputs, float64, raw-op and Triton index safety, no host sync, the
references' ranking. emulate/: the C++ drivers the CUDA emulations build with g++.
"""
