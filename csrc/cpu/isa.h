// How the CPU kernels are compiled once per x86-64 instruction set and picked at run time: the
// one place that lists the instruction sets, says whether this build makes variants, and tests
// the CPU. The extension is built without -march, so it runs on any x86-64; a function that gains
// from wider vectors comes in one variant per instruction set, and the CPU's widest runs.
//
// A function gets its variants in one of two ways, by how its body is written:
//  - portable code (GCC vector extensions, loops the compiler vectorises): MK_ISA_CLONES before
//    the definition, and GCC compiles it for each of MK_ISA_CLONES' sets and resolves the call at
//    load time (an ifunc);
//  - intrinsics: the body between MK_ISA_BEGIN(SET) and MK_ISA_END, inside `#if MK_ISA_HAS_SET`,
//    and the caller asks isa::cpu_runs(isa::Set::kSet) before calling it (or picks a function
//    pointer by it once). A body shared by several sets is written once in a header included
//    inside each set's region (GCC compiles a function, template instances included, for the
//    target of the region its definition is parsed in).
//
// MOE_KERNELS_NO_CLONES (and any compiler or platform but GCC on x86-64 glibc) builds a single
// variant: the one the compiler's own flags allow. python_tests/builds/test_isa_variants.py builds the
// per-ISA code that way for each instruction set with -march flags, since a machine runs only the
// variant it supports; every variant must produce the same bits (python_tests/builds/isa/ checks them).
#pragma once

#include "moe_kernels/common.h"  // MK_ALWAYS_INLINE

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__) && \
    !defined(MOE_KERNELS_NO_CLONES)
#define MK_ISA_DISPATCH 1
#endif

// Portable code: the variants GCC compiles (AVX-512 F, AVX2, the x86-64 baseline SSE2). Its
// helpers must be inlined into every variant (MK_ALWAYS_INLINE: GCC will not inline a plain inline
// function across differing optimize attributes, and each element would become a call).
#if defined(MK_ISA_DISPATCH)
#define MK_ISA_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MK_ISA_CLONES
#endif

// Intrinsics: the instruction sets hand-written variants are compiled for, each as GCC's target
// string (the vector extension and the scalar instructions its code uses: popcnt counts mask
// bits, bmi's tzcnt finds the lowest). The CPU must have all of them to run the variant.
#define MK_ISA_TARGET_AVX2 "avx2,popcnt"
#define MK_ISA_TARGET_AVX512 "avx512f,fma,popcnt"
#define MK_ISA_TARGET_AVX512_BW "avx512f,avx512bw,bmi,popcnt"
#define MK_ISA_TARGET_AVX512_VBMI2 "avx512f,avx512bw,avx512vbmi2,popcnt"

// MK_ISA_HAS_<SET>: whether this build compiles SET's variants. Every set in a dispatch build;
// otherwise those the compiler's flags enable (by their vector extension: popcnt and bmi
// instructions are then emulated, as the baseline has neither).
#if defined(MK_ISA_DISPATCH)
#define MK_ISA_HAS_AVX2 1
#define MK_ISA_HAS_AVX512 1
#define MK_ISA_HAS_AVX512_BW 1
#define MK_ISA_HAS_AVX512_VBMI2 1
#else
#if defined(__AVX2__)
#define MK_ISA_HAS_AVX2 1
#else
#define MK_ISA_HAS_AVX2 0
#endif
#if defined(__AVX512F__)
#define MK_ISA_HAS_AVX512 1
#else
#define MK_ISA_HAS_AVX512 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MK_ISA_HAS_AVX512_BW 1
#else
#define MK_ISA_HAS_AVX512_BW 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI2__)
#define MK_ISA_HAS_AVX512_VBMI2 1
#else
#define MK_ISA_HAS_AVX512_VBMI2 0
#endif
#endif

// MK_ISA_BEGIN(SET) ... MK_ISA_END: code compiled for SET (GCC's target pragma in a dispatch
// build; nothing otherwise, where the flags already allow it).
#define MK_ISA_PRAGMA(text) _Pragma(#text)
#define MK_ISA_TARGET_PRAGMA(gcc_target) MK_ISA_PRAGMA(GCC target(gcc_target))
#if defined(MK_ISA_DISPATCH)
#define MK_ISA_BEGIN(set) _Pragma("GCC push_options") MK_ISA_TARGET_PRAGMA(MK_ISA_TARGET_##set)
#define MK_ISA_END _Pragma("GCC pop_options")
#else
#define MK_ISA_BEGIN(set)
#define MK_ISA_END
#endif

// Elementwise float math that must give the same bits in every variant and in scalar code
// (vec_math.h): its ternaries become blends only if the compiler may evaluate both sides (without
// -fno-trapping-math GCC keeps them as branches and does not vectorise), and fp-contract=off
// keeps an AVX-512 or AVX2 variant from fusing a multiply and an add into an FMA, which rounds
// once where torch's separate operations round twice. Scoped to the helpers and the loops that
// call them.
#define MK_VECTORISE __attribute__((optimize("no-trapping-math", "fp-contract=off")))

namespace moe_kernels {
namespace isa {

enum class Set { kAvx2, kAvx512, kAvx512Bw, kAvx512Vbmi2 };

// The sets this CPU runs, one bit per Set (dispatch builds). Out of line and cold: it runs once.
#if defined(MK_ISA_DISPATCH)
inline __attribute__((noinline, cold)) unsigned cpu_sets() {
  __builtin_cpu_init();
  const bool popcnt = __builtin_cpu_supports("popcnt");
  const bool avx512f = __builtin_cpu_supports("avx512f");
  const bool avx512bw = avx512f && __builtin_cpu_supports("avx512bw");
  const bool avx2 = __builtin_cpu_supports("avx2") && popcnt;
  const bool avx512 = avx512f && __builtin_cpu_supports("fma") && popcnt;
  const bool avx512_bw = avx512bw && __builtin_cpu_supports("bmi") && popcnt;
  const bool avx512_vbmi2 = avx512bw && __builtin_cpu_supports("avx512vbmi2") && popcnt;
  return (unsigned)avx2 << (int)Set::kAvx2 | (unsigned)avx512 << (int)Set::kAvx512 |
         (unsigned)avx512_bw << (int)Set::kAvx512Bw | (unsigned)avx512_vbmi2 << (int)Set::kAvx512Vbmi2;
}
#endif

// Whether this build has Set's variants and this CPU runs them (the CPU tested once, at the first
// call; in a single-variant build, whether the compiler's flags enabled Set).
inline bool cpu_runs(Set set) {
#if defined(MK_ISA_DISPATCH)
  static const unsigned sets = cpu_sets();
  return sets >> (int)set & 1;
#else
  switch (set) {
    case Set::kAvx2: return MK_ISA_HAS_AVX2;
    case Set::kAvx512: return MK_ISA_HAS_AVX512;
    case Set::kAvx512Bw: return MK_ISA_HAS_AVX512_BW;
    case Set::kAvx512Vbmi2: return MK_ISA_HAS_AVX512_VBMI2;
  }
  return false;
#endif
}

}  // namespace isa
}  // namespace moe_kernels
