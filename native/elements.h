// Elements of float32, bfloat16 and float16 buffers as float: loaded one at a time, 8 (AVX2,
// F16C) or 16 (AVX-512) at a time, and stored back rounded to nearest, ties to even, as torch
// rounds (NaN stored as torch's quiet NaN). Shared by the Adam step and the dequantization.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "adam.h"  // ElementType

namespace infinity {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7FC0;  // torch's quiet NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE half precision in software: the scalar path must run on CPUs without F16C.
inline float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf, NaN (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    uint32_t e = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((mant & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));  // NaN
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to inf, or is inf
  if (abs < 0x38800000u) {  // a half subnormal (or zero): round the shifted mantissa, ties to even
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - exp;  // 14 .. 24
    const uint32_t half_mant = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1u);
    const uint32_t up = (rest > halfway || (rest == halfway && (half_mant & 1u))) ? 1u : 0u;
    return static_cast<uint16_t>(sign | (half_mant + up));
  }
  // Normal: rebias the exponent and round 13 mantissa bits away, ties to even (a carry into
  // the exponent is the right result, up to inf).
  const uint32_t rebased = abs - 0x38000000u;
  const uint32_t up = 0xFFFu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rebased + up) >> 13));
}

inline float load_element(const void* grad, ElementType type, size_t i) {
  switch (type) {
    case ElementType::kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
    case ElementType::kFloat16: return f16_to_float(static_cast<const uint16_t*>(grad)[i]);
    default: return static_cast<const float*>(grad)[i];
  }
}

inline void store_element(void* low, ElementType type, size_t i, float value) {
  if (type == ElementType::kBFloat16)
    static_cast<uint16_t*>(low)[i] = float_to_bf16(value);
  else if (type == ElementType::kFloat16)
    static_cast<uint16_t*>(low)[i] = float_to_f16(value);
  else if (type == ElementType::kFloat32)
    static_cast<float*>(low)[i] = value;
}

// --- AVX-512: 16 elements at a time ---

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_elements16(const void* grad,
                                                                                ElementType type,
                                                                                size_t i) {
  if (type == ElementType::kBFloat16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  if (type == ElementType::kFloat16) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm512_cvtph_ps(raw);
  }
  return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void store_elements16(void* low, ElementType type,
                                                                             size_t i, __m512 p) {
  if (type == ElementType::kBFloat16) {
    const __m512i bits = _mm512_castps_si512(p);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(low) + i), _mm512_cvtepi32_epi16(rounded));
  } else if (type == ElementType::kFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(low) + i),
                        _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if (type == ElementType::kFloat32) {
    _mm512_storeu_ps(static_cast<float*>(low) + i, p);
  }
}

// --- AVX2 (+F16C): 8 elements at a time ---

__attribute__((target("avx2,fma,f16c"))) inline __m256 load_elements8(const void* grad, ElementType type, size_t i) {
  if (type == ElementType::kBFloat16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  if (type == ElementType::kFloat16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_cvtph_ps(raw);
  }
  return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
}

__attribute__((target("avx2,fma,f16c"))) inline void store_elements8(void* low, ElementType type, size_t i, __m256 p) {
  if (type == ElementType::kBFloat16) {
    const __m256i bits = _mm256_castps_si256(p);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
    // Each 32-bit lane holds a value below 0x10000, so the unsigned-saturating pack keeps it.
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(low) + i), packed);
  } else if (type == ElementType::kFloat16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(low) + i),
                     _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if (type == ElementType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(low) + i, p);
  }
}

}  // namespace infinity
