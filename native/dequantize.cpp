#include "dequantize.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu.h"
#include "elements.h"
#include "quant_codes.h"
#include "task_pool.h"

namespace infinity {
namespace {

constexpr size_t kSplitMinElements = 1u << 18;  // below this a split costs more than it saves
// From this many output bytes on, aligned 16-element groups go out by streaming stores: the
// buffer is larger than the caches, so loading its old lines first (what ordinary stores do)
// would only add to the memory traffic (measured: the dequantization of a layer of the 1B Llama
// took half the time with them).
constexpr size_t kStreamMinBytes = 1u << 20;

size_t element_size(ElementType t) { return t == ElementType::kFloat32 ? 4 : 2; }

// 16 converted elements (32 or 64 bytes) from an aligned tile to dst, bypassing the caches.
__attribute__((target("avx2"))) inline void stream_tile(char* dst, const uint8_t* tile, size_t bytes) {
  for (size_t k = 0; k < bytes; k += 32)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + k),
                        _mm256_load_si256(reinterpret_cast<const __m256i*>(tile + k)));
}

// Elements [begin, end) of one row, all in one block (scale s), one at a time.
void row_scalar(const DequantBuffers& b, const uint8_t* codes, void* out, size_t begin, size_t end,
                float s) {
  for (size_t j = begin; j < end; ++j) {
    const int code = b.form == QuantForm::kInt8 ? static_cast<int>(reinterpret_cast<const int8_t*>(codes)[j])
                                                : int4_code(codes, j);
    store_element(out, b.type, j, static_cast<float>(code) * s);
  }
}

// Whether the 16-element groups of a block starting at j stream: a large output, and a group's
// first byte on a 32-byte line (then every group's is: a group is 32 or 64 bytes).
inline bool streams(const DequantBuffers& b, const void* out, size_t j) {
  const size_t size = element_size(b.type);
  return b.rows * b.n * size >= kStreamMinBytes &&
         (reinterpret_cast<uintptr_t>(static_cast<const char*>(out) + j * size) & 31) == 0;
}

// Where a block's 16-element groups are written: into the output, or into an aligned tile that
// then streams to it (see `streams`).
struct Groups {
  Groups(const DequantBuffers& b, void* out, size_t j)
      : out(static_cast<char*>(out)), size(element_size(b.type)), stream(streams(b, out, j)) {}
  void* to() { return stream ? static_cast<void*>(tile) : static_cast<void*>(out); }
  size_t at(size_t j) const { return stream ? 0 : j; }
  char* out;
  size_t size;
  bool stream;
  alignas(64) uint8_t tile[64];
};

// The 16 codes of elements j .. j + 15 as int8.
__attribute__((target("avx2"))) inline __m128i codes16(const DequantBuffers& b, const uint8_t* codes, size_t j) {
  return b.form == QuantForm::kInt8 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j))
                                    : unpack16(codes + j / 2);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) size_t block_avx512(const DequantBuffers& b,
                                                                          const uint8_t* codes, void* out,
                                                                          size_t j, size_t end, float s) {
  const __m512 scale = _mm512_set1_ps(s);
  Groups g(b, out, j);
  for (; j + 16 <= end; j += 16) {
    store_elements16(g.to(), b.type, g.at(j),
                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes16(b, codes, j))), scale));
    if (g.stream) stream_tile(g.out + j * g.size, g.tile, 16 * g.size);
  }
  return j;
}

__attribute__((target("avx2,fma,f16c"))) size_t block_avx2(const DequantBuffers& b, const uint8_t* codes,
                                                            void* out, size_t j, size_t end, float s) {
  const __m256 scale = _mm256_set1_ps(s);
  Groups g(b, out, j);
  for (; j + 16 <= end; j += 16) {
    const __m128i c = codes16(b, codes, j);
    store_elements8(g.to(), b.type, g.at(j), _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), scale));
    store_elements8(g.to(), b.type, g.at(j) + 8,
                    _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8))), scale));
    if (g.stream) stream_tile(g.out + j * g.size, g.tile, 16 * g.size);
  }
  return j;
}

// The vector loop of one block: elements from j while 16 fit before end (int4: j even, so its
// 16 codes start on a byte); returns where it stopped.
using BlockFn = size_t (*)(const DequantBuffers&, const uint8_t*, void*, size_t, size_t, float);

const BlockFn kBlock = by_simd_level<BlockFn>(block_avx512, block_avx2, nullptr);

class DequantTask final : public Task {
 public:
  DequantTask(const DequantBuffers& b, size_t pieces)
      : b_(b), per_(std::max<size_t>(1, (b.rows + pieces - 1) / pieces)), chunks_((b.rows + per_ - 1) / per_) {}
  size_t chunks() const noexcept override { return std::max<size_t>(1, chunks_); }
  int run_chunk(size_t index, std::string*) override {
    const size_t begin = index * per_;
    if (begin < b_.rows) dequantize_rows(b_, begin, std::min(b_.rows, begin + per_));
    return 0;
  }

 private:
  DequantBuffers b_;
  size_t per_;
  size_t chunks_;
};

}  // namespace

std::string dequantize_check(const DequantBuffers& b) {
  if (b.type == ElementType::kNone) return "the output's type must be float32, bfloat16 or float16";
  if (b.block == 0) return "block is 0; it must be a positive number of elements";
  if (b.form == QuantForm::kInt4 && b.block % 2 != 0)
    return "block is " + std::to_string(b.block) + "; int4 blocks must be even (a block starts on a byte)";
  if (b.rows > 0 && b.n > 0 && (b.codes == nullptr || b.scales == nullptr || b.out == nullptr))
    return "an address is 0 (a null pointer)";
  return "";
}

void dequantize_rows(const DequantBuffers& b, size_t begin, size_t end) {
  const size_t row_codes = b.form == QuantForm::kInt8 ? b.n : (b.n + 1) / 2;
  const size_t blocks = (b.n + b.block - 1) / b.block;
  const size_t out_row = b.n * element_size(b.type);
  for (size_t r = begin; r < end; ++r) {
    const uint8_t* codes = static_cast<const uint8_t*>(b.codes) + r * row_codes;
    void* out = static_cast<char*>(b.out) + r * out_row;
    for (size_t k = 0; k < blocks; ++k) {
      const float s = load_element(b.scales, b.type, r * blocks + k);
      const size_t start = k * b.block, stop = std::min(b.n, start + b.block);
      const size_t j = kBlock != nullptr ? kBlock(b, codes, out, start, stop, s) : start;
      row_scalar(b, codes, out, j, stop, s);
    }
  }
  if (kBlock != nullptr) _mm_sfence();  // streaming stores are weakly ordered: publish them
}

void dequantize(const DequantBuffers& b, int num_threads) {
  TaskPool* pool = num_threads > 1 && b.rows > 1 && b.rows * b.n >= kSplitMinElements ? shared_task_pool()
                                                                                    : nullptr;
  if (pool == nullptr) {
    dequantize_rows(b, 0, b.rows);
    return;
  }
  DequantTask task(b, static_cast<size_t>(num_threads) * 4);
  (void)pool->run(task);  // a chunk cannot fail once the call was checked
}

const char* dequantize_implementation() {
  if (kBlock == block_avx512) return "avx512";
  if (kBlock == block_avx2) return "avx2";
  return "scalar";
}

}  // namespace infinity
