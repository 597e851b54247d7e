#include "copy.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "cpu.h"
#include "task_pool.h"
#include "tasks.h"

namespace infinity {
namespace {

// Below this, streaming stores lose: the data would still be in cache for the reader.
constexpr size_t kStreamMinBytes = 1u << 20;
constexpr size_t kSplitMinBytes = 16u << 20;

__attribute__((target("avx512f"))) void stream_avx512(char* d, const char* s, size_t n) {
  // Streaming stores need an aligned destination: copy the head plainly first.
  const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 256 <= n; i += 256) {
    const __m512i a = _mm512_loadu_si512(s + i);
    const __m512i b = _mm512_loadu_si512(s + i + 64);
    const __m512i c = _mm512_loadu_si512(s + i + 128);
    const __m512i e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
  _mm_sfence();  // streaming stores are weakly ordered: publish them before we return
  std::memcpy(d + i, s + i, n - i);
}

__attribute__((target("avx2"))) void stream_avx2(char* d, const char* s, size_t n) {
  const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
  std::memcpy(d, s, head);
  size_t i = head;
  for (; i + 128 <= n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  _mm_sfence();
  std::memcpy(d + i, s + i, n - i);
}

using CopyFn = void (*)(char*, const char*, size_t);

CopyFn pick() {
  const std::string level = simd_level();
  if (level == "avx512") return stream_avx512;
  if (level == "avx2") return stream_avx2;
  return nullptr;
}

const CopyFn kStream = pick();

void copy_one(char* d, const char* s, size_t n) {
  if (kStream != nullptr && n >= kStreamMinBytes)
    kStream(d, s, n);
  else
    std::memcpy(d, s, n);
}

}  // namespace

void copy_range(void* dst, const void* src, size_t n) noexcept {
  copy_one(static_cast<char*>(dst), static_cast<const char*>(src), n);
}

void copy_bytes(void* dst, const void* src, size_t n, int num_threads) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (num_threads <= 1 || n < kSplitMinBytes) {
    copy_one(d, s, n);
    return;
  }
  // The process's pool and this thread share the pieces: no thread is made per call.
  TaskPool* pool = shared_task_pool();
  if (pool == nullptr) {  // no threads to be had: copy on this one
    copy_one(d, s, n);
    return;
  }
  CopyTask task(reinterpret_cast<uint64_t>(dst), reinterpret_cast<uint64_t>(src), static_cast<int64_t>(n),
                static_cast<size_t>(num_threads));
  (void)pool->run(task);  // a copy has no way to fail once its arguments passed
}

const char* copy_implementation() {
  if (kStream == stream_avx512) return "avx512-stream";
  if (kStream == stream_avx2) return "avx2-stream";
  return "memcpy";
}

}  // namespace infinity
