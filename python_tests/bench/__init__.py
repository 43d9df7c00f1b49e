"""The scripts of bench/: their measurement helpers (common.py: interleaved timing, allocator
settings), the plots, and `make gpu-check` in its smoke form (test_gpu_check.py)."""
