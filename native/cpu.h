// What the CPU offers, decided at run time so one build runs on any x86-64.
#pragma once

namespace infinity {

// "avx512" | "avx2" | "sse4.2" | "scalar": the widest vector level that both
// the CPU and the kernel (saved register state) support.
const char* simd_level();

}  // namespace infinity
