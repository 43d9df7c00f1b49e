"""Which implementation runs where: the backend registry (moe_kernels.backends, test_registry.py),
`python -m moe_kernels.check`, the device axis of the test matrix itself (support/devices.py,
test_device_axis.py), the GPU-only properties of the kernels (test_gpu.py), arguments on another
device, and Triton launches on their tensors' device."""
