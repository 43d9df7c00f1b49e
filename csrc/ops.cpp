// The extension module moe_kernels._C. Importing it runs the static registrations of every
// csrc/cpu/<op>.cpp (and, in CUDA builds, csrc/cuda_ops.cpp): each op file declares its own schema
// with TORCH_LIBRARY_FRAGMENT(moe_kernels, m) next to its CPU kernel, so adding an op touches
// no shared C++ file. This file owns the library itself.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(moe_kernels, m) {}

extern "C" {
// A module with no methods: the ops are reached through torch.ops.moe_kernels.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
