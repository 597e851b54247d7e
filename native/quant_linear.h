// Matrix products from block-wise int8 and int4 codes (infinity.torch.quantize's format) with no
// dequantized copy of the weight: y[r, o] = sum_i x[r, i] * code[o, i] * scale[o, i / block]
// (+ bias[o]), for the few rows of x a decode step has. Each block's products are summed in
// float32 and multiplied by the block's scale once (code * scale exactly, not rounded to the
// weight's type first), the blocks summed in float32, the bias added and the result rounded
// once to the type. Each code is read once per call, whatever the number of rows: the
// weight's bytes, not the arithmetic, bound it, where dequantizing writes and reads the
// weight again in its full width.
#pragma once

#include <cstddef>
#include <string>

#include "adam.h"        // ElementType
#include "dequantize.h"  // QuantForm

namespace infinity {

struct QuantLinearBuffers {
  const void* x = nullptr;       // type (rows, n)
  const void* codes = nullptr;   // int8 (out, n), or uint8 (out, ceil(n / 2)) for int4
  const void* scales = nullptr;  // type (out, ceil(n / block))
  const void* bias = nullptr;    // type (out), or null: none
  void* y = nullptr;             // type (rows, out)
  QuantForm form = QuantForm::kInt8;
  ElementType type = ElementType::kBFloat16;  // of x, scales, bias and y
  size_t rows = 0, n = 0, out = 0, block = 0;
};

// Empty, or a sentence saying what is wrong with the call (a null buffer, block 0, int4 with an
// odd block, no element type).
std::string quant_linear_check(const QuantLinearBuffers& b);
// y for every row, the weight's rows split into pieces run by this thread and the process's
// task pool (shared_task_pool()) where num_threads > 1 and there is enough work.
// implementation: "auto" (the widest this CPU runs), "avx512", "avx2" or "scalar"; false,
// with nothing written, where this CPU cannot run the one named.
bool quant_linear(const QuantLinearBuffers& b, int num_threads, const char* implementation = "auto");
// "avx512" | "avx2" | "scalar": what "auto" runs here.
const char* quant_linear_implementation();

}  // namespace infinity
