#include "cpu.h"

namespace infinity {

const char* simd_level() {
#if defined(__x86_64__) || defined(__i386__)
  // libgcc's detection also checks XCR0, so a kernel that does not save the
  // AVX-512 state makes avx512f read as absent here.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
  if (__builtin_cpu_supports("sse4.2")) return "sse4.2";
#endif
  return "scalar";
}

bool has_f16c() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

}  // namespace infinity
