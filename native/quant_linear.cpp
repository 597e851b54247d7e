#include "quant_linear.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu.h"
#include "elements.h"
#include "quant_codes.h"
#include "task_pool.h"

namespace infinity {
namespace {

// Rows of x that one pass over a weight row serves: each row keeps its own accumulators in
// registers (AVX2 has 16: 4 rows take 12), and more rows go round again, reading the weight
// row from the L1 cache. Decode has 1 row a sequence, so batches of up to 4 take one pass.
constexpr size_t kMaxRows = 4;
// Below this many weight elements a split costs more than it saves (as the dequantization's).
constexpr size_t kSplitMinElements = 1u << 18;

struct Plan {
  const QuantLinearBuffers* b;
  const float* x;    // rows x n, float32
  size_t row_codes;  // bytes of a weight row's codes
  size_t blocks;     // scales of a weight row
};

template <QuantForm F>
inline float code_at(const uint8_t* codes, size_t j) {
  if constexpr (F == QuantForm::kInt8) return static_cast<float>(static_cast<int8_t>(codes[j]));
  return static_cast<float>(int4_code(codes, j));
}

// part[r] += sum of code * x[r] over elements [j, stop) of one block, one at a time.
template <QuantForm F, size_t R>
inline void partial(const uint8_t* codes, size_t j, size_t stop, const float* x, size_t n, float* part) {
  for (; j < stop; ++j) {
    const float c = code_at<F>(codes, j);
    for (size_t r = 0; r < R; ++r) part[r] += c * x[r * n + j];
  }
}

struct Scalar {
  static void convert(const void* src, ElementType type, float* dst, size_t count) {
    for (size_t i = 0; i < count; ++i) dst[i] = load_element(src, type, i);
  }

  template <QuantForm F, size_t R>
  static void dot(const Plan& p, const uint8_t* codes, size_t scale_at, const float* x, float* sums) {
    const QuantLinearBuffers& b = *p.b;
    float total[R] = {};
    for (size_t k = 0; k < p.blocks; ++k) {
      const size_t start = k * b.block, stop = std::min(b.n, start + b.block);
      float part[R] = {};
      partial<F, R>(codes, start, stop, x, b.n, part);
      const float s = load_element(b.scales, b.type, scale_at + k);
      for (size_t r = 0; r < R; ++r) total[r] += s * part[r];
    }
    for (size_t r = 0; r < R; ++r) sums[r] = total[r];
  }
};

struct Avx512 {
  __attribute__((target("avx512f,avx512bw,avx512vl"))) static void convert(const void* src, ElementType type,
                                                                           float* dst, size_t count) {
    size_t i = 0;
    for (; i + 16 <= count; i += 16) _mm512_storeu_ps(dst + i, load_elements16(src, type, i));
    for (; i < count; ++i) dst[i] = load_element(src, type, i);
  }

  template <QuantForm F>
  __attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m512 weights16(const uint8_t* codes,
                                                                                      size_t j) {
    __m128i c;
    if constexpr (F == QuantForm::kInt8)
      c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
    else
      c = unpack16(codes + j / 2);  // j is even: a block starts on a byte, and steps by 16
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c));
  }

  // Two accumulators a row within a block (32 elements a step), so that consecutive
  // multiply-adds of one row do not wait on each other.
  template <QuantForm F, size_t R>
  __attribute__((target("avx512f,avx512bw,avx512vl"))) static void dot(const Plan& p, const uint8_t* codes,
                                                                       size_t scale_at, const float* x,
                                                                       float* sums) {
    const QuantLinearBuffers& b = *p.b;
    const size_t n = b.n;
    __m512 total[R];
    float tail[R] = {};
    for (size_t r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (size_t k = 0; k < p.blocks; ++k) {
      const size_t start = k * b.block, stop = std::min(n, start + b.block);
      __m512 a0[R], a1[R];
      for (size_t r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
      size_t j = start;
      for (; j + 32 <= stop; j += 32) {
        const __m512 w0 = weights16<F>(codes, j), w1 = weights16<F>(codes, j + 16);
        for (size_t r = 0; r < R; ++r) {
          a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * n + j), a0[r]);
          a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * n + j + 16), a1[r]);
        }
      }
      if (j + 16 <= stop) {
        const __m512 w0 = weights16<F>(codes, j);
        for (size_t r = 0; r < R; ++r) a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * n + j), a0[r]);
        j += 16;
      }
      const float s = load_element(b.scales, b.type, scale_at + k);
      const __m512 scale = _mm512_set1_ps(s);
      for (size_t r = 0; r < R; ++r) total[r] = _mm512_fmadd_ps(_mm512_add_ps(a0[r], a1[r]), scale, total[r]);
      if (j < stop) {
        float part[R] = {};
        partial<F, R>(codes, j, stop, x, n, part);
        for (size_t r = 0; r < R; ++r) tail[r] += s * part[r];
      }
    }
    for (size_t r = 0; r < R; ++r) sums[r] = _mm512_reduce_add_ps(total[r]) + tail[r];
  }
};

struct Avx2 {
  __attribute__((target("avx2,fma,f16c"))) static void convert(const void* src, ElementType type, float* dst,
                                                               size_t count) {
    size_t i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, load_elements8(src, type, i));
    for (; i < count; ++i) dst[i] = load_element(src, type, i);
  }

  __attribute__((target("avx2,fma,f16c"))) static inline float sum8(__m256 v) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
  }

  // 16 elements a step: the low 8 codes into one accumulator a row, the high 8 into another.
  template <QuantForm F, size_t R>
  __attribute__((target("avx2,fma,f16c"))) static void dot(const Plan& p, const uint8_t* codes, size_t scale_at,
                                                            const float* x, float* sums) {
    const QuantLinearBuffers& b = *p.b;
    const size_t n = b.n;
    __m256 total[R];
    float tail[R] = {};
    for (size_t r = 0; r < R; ++r) total[r] = _mm256_setzero_ps();
    for (size_t k = 0; k < p.blocks; ++k) {
      const size_t start = k * b.block, stop = std::min(n, start + b.block);
      __m256 a0[R], a1[R];
      for (size_t r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
      size_t j = start;
      for (; j + 16 <= stop; j += 16) {
        __m128i c;
        if constexpr (F == QuantForm::kInt8)
          c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
        else
          c = unpack16(codes + j / 2);
        const __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c));
        const __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
        for (size_t r = 0; r < R; ++r) {
          a0[r] = _mm256_fmadd_ps(low, _mm256_loadu_ps(x + r * n + j), a0[r]);
          a1[r] = _mm256_fmadd_ps(high, _mm256_loadu_ps(x + r * n + j + 8), a1[r]);
        }
      }
      const float s = load_element(b.scales, b.type, scale_at + k);
      const __m256 scale = _mm256_set1_ps(s);
      for (size_t r = 0; r < R; ++r) total[r] = _mm256_fmadd_ps(_mm256_add_ps(a0[r], a1[r]), scale, total[r]);
      if (j < stop) {
        float part[R] = {};
        partial<F, R>(codes, j, stop, x, n, part);
        for (size_t r = 0; r < R; ++r) tail[r] += s * part[r];
      }
    }
    for (size_t r = 0; r < R; ++r) sums[r] = sum8(total[r]) + tail[r];
  }
};

// The sums of `count` (1 .. kMaxRows) rows of x against one weight row.
template <class Kernel, QuantForm F>
void dot_rows(size_t count, const Plan& p, const uint8_t* codes, size_t scale_at, const float* x, float* sums) {
  switch (count) {
    case 1: Kernel::template dot<F, 1>(p, codes, scale_at, x, sums); break;
    case 2: Kernel::template dot<F, 2>(p, codes, scale_at, x, sums); break;
    case 3: Kernel::template dot<F, 3>(p, codes, scale_at, x, sums); break;
    default: Kernel::template dot<F, kMaxRows>(p, codes, scale_at, x, sums); break;
  }
}

// Outputs [begin, end) of every row of y: weight row by weight row, so each is read once.
template <class Kernel>
void outputs(const Plan& p, size_t begin, size_t end) {
  const QuantLinearBuffers& b = *p.b;
  for (size_t o = begin; o < end; ++o) {
    const uint8_t* codes = static_cast<const uint8_t*>(b.codes) + o * p.row_codes;
    const float bias = b.bias != nullptr ? load_element(b.bias, b.type, o) : 0.0f;
    for (size_t r = 0; r < b.rows; r += kMaxRows) {
      const size_t count = std::min(kMaxRows, b.rows - r);
      float sums[kMaxRows];
      if (b.form == QuantForm::kInt8)
        dot_rows<Kernel, QuantForm::kInt8>(count, p, codes, o * p.blocks, p.x + r * b.n, sums);
      else
        dot_rows<Kernel, QuantForm::kInt4>(count, p, codes, o * p.blocks, p.x + r * b.n, sums);
      for (size_t i = 0; i < count; ++i) store_element(b.y, b.type, (r + i) * b.out + o, sums[i] + bias);
    }
  }
}

struct Implementation {
  const char* name;
  void (*convert)(const void*, ElementType, float*, size_t);
  void (*outputs)(const Plan&, size_t, size_t);
};

constexpr Implementation kScalar{"scalar", Scalar::convert, outputs<Scalar>};
constexpr Implementation kAvx2{"avx2", Avx2::convert, outputs<Avx2>};
constexpr Implementation kAvx512{"avx512", Avx512::convert, outputs<Avx512>};

const Implementation* const kAuto = by_simd_level<const Implementation*>(&kAvx512, &kAvx2, &kScalar);

// The implementation named, or null where this CPU cannot run it.
const Implementation* named(const char* name) {
  if (std::strcmp(name, "auto") == 0) return kAuto;
  if (std::strcmp(name, "scalar") == 0) return &kScalar;
  const Implementation* widest = kAuto;
  if (std::strcmp(name, "avx512") == 0) return widest == &kAvx512 ? &kAvx512 : nullptr;
  if (std::strcmp(name, "avx2") == 0) return widest != &kScalar ? &kAvx2 : nullptr;
  return nullptr;
}

class QuantLinearTask final : public Task {
 public:
  QuantLinearTask(const Plan& p, const Implementation& impl, size_t pieces)
      : p_(p), impl_(impl), per_(std::max<size_t>(1, (p.b->out + pieces - 1) / pieces)),
        chunks_((p.b->out + per_ - 1) / per_) {}
  size_t chunks() const noexcept override { return std::max<size_t>(1, chunks_); }
  int run_chunk(size_t index, std::string*) override {
    const size_t begin = index * per_;
    if (begin < p_.b->out) impl_.outputs(p_, begin, std::min(p_.b->out, begin + per_));
    return 0;
  }

 private:
  Plan p_;
  const Implementation& impl_;
  size_t per_;
  size_t chunks_;
};

}  // namespace

std::string quant_linear_check(const QuantLinearBuffers& b) {
  if (b.type == ElementType::kNone) return "the type must be float32, bfloat16 or float16";
  if (b.block == 0) return "block is 0; it must be a positive number of elements";
  if (b.form == QuantForm::kInt4 && b.block % 2 != 0)
    return "block is " + std::to_string(b.block) + "; int4 blocks must be even (a block starts on a byte)";
  if (b.rows > 0 && b.out > 0 && (b.y == nullptr || (b.n > 0 && (b.x == nullptr || b.codes == nullptr ||
                                                                 b.scales == nullptr))))
    return "an address is 0 (a null pointer)";
  return "";
}

bool quant_linear(const QuantLinearBuffers& b, int num_threads, const char* implementation) {
  const Implementation* impl = named(implementation);
  if (impl == nullptr) return false;
  if (b.rows == 0 || b.out == 0) return true;
  std::vector<float> x(b.rows * b.n);  // converted once, read by every weight row
  impl->convert(b.x, b.type, x.data(), x.size());
  const Plan p{&b, x.data(), b.form == QuantForm::kInt8 ? b.n : (b.n + 1) / 2, (b.n + b.block - 1) / b.block};
  TaskPool* pool = num_threads > 1 && b.out > 1 && b.out * b.n >= kSplitMinElements ? shared_task_pool() : nullptr;
  if (pool == nullptr) {
    impl->outputs(p, 0, b.out);
    return true;
  }
  QuantLinearTask task(p, *impl, static_cast<size_t>(num_threads) * 4);
  (void)pool->run(task);  // a chunk cannot fail once the call was checked
  return true;
}

const char* quant_linear_implementation() { return kAuto->name; }

}  // namespace infinity
