"""Build checks, without a GPU: setup.py's configuration (test_config.py), every CUDA kernel through
nvcc and every Triton kernel compiled ahead of time (test_cuda_compile.py, test_triton_aot.py), the
CPU code built per instruction set (test_isa_variants.py; isa/: its C++ checks), and the built
extension's loading (test_extension_loading.py). Not named build/: .gitignore, ruff and pytest all
skip folders of that name."""
