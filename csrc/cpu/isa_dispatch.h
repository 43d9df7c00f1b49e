// Whether this build compiles every x86 variant of the CPU kernels that come in one per
// instruction set (target_clones, or one function per target pragma) and picks one at load time
// or at the first call: GCC on x86-64 glibc, unless MOE_KERNELS_NO_CLONES asks for only the
// variant the compiler's own flags allow (python_tests/builds/test_isa_variants.py builds each
// instruction set that way, since a machine runs only the variant it supports).
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) && \
    !defined(MOE_KERNELS_NO_CLONES)
#define MK_ISA_DISPATCH 1
#endif
