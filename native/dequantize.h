// Dequantizing block-wise int8 and int4 codes (infinity.torch.quantize's format) into float32,
// bfloat16 or float16: out = code * scale, computed in float (exact for scales of 16 bits) and
// rounded once to the output's type, as torch's element-wise multiply computes it. One pass:
// each code is read once and each output element written once.
#pragma once

#include <cstddef>
#include <string>

#include "adam.h"  // ElementType

namespace infinity {

enum class QuantForm : int { kInt8 = 0, kInt4 = 1 };

struct DequantBuffers {
  const void* codes = nullptr;   // int8 (rows, n), or uint8 (rows, ceil(n / 2)) for int4
  const void* scales = nullptr;  // type (rows, ceil(n / block))
  void* out = nullptr;           // type (rows, n)
  QuantForm form = QuantForm::kInt8;
  ElementType type = ElementType::kBFloat16;  // of scales and out
  size_t rows = 0, n = 0, block = 0;
};

// Empty, or a sentence saying what is wrong with the call (a null buffer, block 0, int4 with an
// odd block, no element type).
std::string dequantize_check(const DequantBuffers& b);
// One thread's share: rows [begin, end).
void dequantize_rows(const DequantBuffers& b, size_t begin, size_t end);
// Every row, split into pieces run by this thread and the process's task pool
// (shared_task_pool()) where num_threads > 1 and there is enough work.
void dequantize(const DequantBuffers& b, int num_threads);
// "avx512" | "avx2" | "scalar"
const char* dequantize_implementation();

}  // namespace infinity
