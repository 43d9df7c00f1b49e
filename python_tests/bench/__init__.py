"""The benchmarks: their measurement helpers (moe_kernels/bench/timing.py through bench/common.py:
interleaved timing, allocator settings), the plots, the package's command line
(`python -m moe_kernels.bench`, test_cli.py, which also checks that bench/'s scripts call the
package's code), and `make gpu-check` in its smoke form (test_gpu_check.py)."""
