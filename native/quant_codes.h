// Reading block-wise int8 and int4 codes (infinity.torch.quantize's format): one code at a time,
// or 16 at a time as int8. Shared by the dequantization and the quantized matrix products.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace infinity {

// Code j of an int4 row: element 2k in the low nibble of byte k, 2k + 1 in the high one, each
// stored as code + 8.
inline int int4_code(const uint8_t* row, size_t j) {
  return static_cast<int>((row[j >> 1] >> ((j & 1u) * 4u)) & 15u) - 8;
}

// 16 int4 codes from 8 bytes, in element order, as int8 (-8 .. 7).
__attribute__((target("avx2"))) inline __m128i unpack16(const uint8_t* bytes) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(raw, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  return _mm_sub_epi8(_mm_unpacklo_epi8(low, high), _mm_set1_epi8(8));
}

}  // namespace infinity
