// What the CPU offers, decided at run time so one build runs on any x86-64.
#pragma once

#include <cstring>

namespace infinity {

// "avx512" | "avx2" | "sse4.2" | "scalar": the widest vector level that both
// the CPU and the kernel (saved register state) support.
const char* simd_level();

// Whether the CPU converts half precision in hardware (the AVX2 kernels' float16 loads and stores).
bool has_f16c();

// The kernel for this CPU: `avx512` at level avx512, `avx2` at level avx2 with F16C, else
// `otherwise` (what the element kernels of elements.h need at each width).
template <typename Fn>
Fn by_simd_level(Fn avx512, Fn avx2, Fn otherwise) {
  const char* level = simd_level();
  if (std::strcmp(level, "avx512") == 0) return avx512;
  if (std::strcmp(level, "avx2") == 0 && has_f16c()) return avx2;
  return otherwise;
}

}  // namespace infinity
