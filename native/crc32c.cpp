// The crc32 instruction has a latency of 3 cycles but a throughput of one per
// cycle, so a single dependency chain runs at a third of the possible speed.
// The hardware path therefore runs three independent streams over adjacent
// thirds of a stretch and joins them with "shift by N zero bytes" tables:
// the CRC register is linear over GF(2), so crc(A || B) equals crc(A)
// advanced over |B| zero bytes, xor crc(B) started from zero.
#include "crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define INFINITY_X86 1
#endif

namespace infinity {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, bit-reflected
// Stream lengths: the long one amortises the join, the short one catches
// 1 MiB tails without falling back to a single chain for long.
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;

struct Tables {
  uint32_t slice[8][256];
  uint32_t shift_long[4][256];
  uint32_t shift_short[4][256];
};

// Advances a raw CRC register over `nbytes` zero bytes (nbytes % 8 == 0).
uint32_t advance_zeros(const Tables& t, uint32_t crc, size_t nbytes) {
  for (size_t i = 0; i < nbytes; i += 8) {
    crc = t.slice[7][crc & 0xff] ^ t.slice[6][(crc >> 8) & 0xff] ^ t.slice[5][(crc >> 16) & 0xff] ^
          t.slice[4][crc >> 24];
  }
  return crc;
}

void build_shift(const Tables& t, size_t nbytes, uint32_t out[4][256]) {
  uint32_t basis[32];
  for (int bit = 0; bit < 32; ++bit) basis[bit] = advance_zeros(t, 1u << bit, nbytes);
  for (int k = 0; k < 4; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t v = 0;
      for (int bit = 0; bit < 8; ++bit)
        if (b & (1u << bit)) v ^= basis[8 * k + bit];
      out[k][b] = v;
    }
  }
}

Tables build_tables() {
  Tables t;
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
    t.slice[0][i] = c;
  }
  for (int s = 1; s < 8; ++s)
    for (uint32_t i = 0; i < 256; ++i)
      t.slice[s][i] = (t.slice[s - 1][i] >> 8) ^ t.slice[0][t.slice[s - 1][i] & 0xff];
  build_shift(t, kLong, t.shift_long);
  build_shift(t, kShort, t.shift_short);
  return t;
}

const Tables& tables() {
  static const Tables t = build_tables();
  return t;
}

inline uint32_t shift(const uint32_t table[4][256], uint32_t crc) {
  return table[0][crc & 0xff] ^ table[1][(crc >> 8) & 0xff] ^ table[2][(crc >> 16) & 0xff] ^
         table[3][crc >> 24];
}

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

uint32_t raw_table(uint32_t crc, const unsigned char* p, size_t n) {
  const Tables& t = tables();
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
    --n;
  }
  while (n >= 8) {
    uint64_t v = load64(p) ^ crc;  // little-endian: the low word meets the register
    crc = t.slice[7][v & 0xff] ^ t.slice[6][(v >> 8) & 0xff] ^ t.slice[5][(v >> 16) & 0xff] ^
          t.slice[4][(v >> 24) & 0xff] ^ t.slice[3][(v >> 32) & 0xff] ^ t.slice[2][(v >> 40) & 0xff] ^
          t.slice[1][(v >> 48) & 0xff] ^ t.slice[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t.slice[0][(crc ^ *p++) & 0xff];
  return crc;
}

#ifdef INFINITY_X86
__attribute__((target("sse4.2"))) uint32_t raw_sse42(uint32_t crc32, const unsigned char* p, size_t n) {
  const Tables& t = tables();
  uint64_t crc = crc32;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(static_cast<uint32_t>(crc), *p++);
    --n;
  }
  while (n >= 3 * kLong) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char* end = p + kLong;
    do {
      crc = _mm_crc32_u64(crc, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + kLong));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * kLong));
      p += 8;
    } while (p < end);
    crc = shift(t.shift_long, static_cast<uint32_t>(crc)) ^ c1;
    crc = shift(t.shift_long, static_cast<uint32_t>(crc)) ^ c2;
    p += 2 * kLong;
    n -= 3 * kLong;
  }
  while (n >= 3 * kShort) {
    uint64_t c1 = 0, c2 = 0;
    const unsigned char* end = p + kShort;
    do {
      crc = _mm_crc32_u64(crc, load64(p));
      c1 = _mm_crc32_u64(c1, load64(p + kShort));
      c2 = _mm_crc32_u64(c2, load64(p + 2 * kShort));
      p += 8;
    } while (p < end);
    crc = shift(t.shift_short, static_cast<uint32_t>(crc)) ^ c1;
    crc = shift(t.shift_short, static_cast<uint32_t>(crc)) ^ c2;
    p += 2 * kShort;
    n -= 3 * kShort;
  }
  while (n >= 8) {
    crc = _mm_crc32_u64(crc, load64(p));
    p += 8;
    n -= 8;
  }
  while (n--) crc = _mm_crc32_u8(static_cast<uint32_t>(crc), *p++);
  return static_cast<uint32_t>(crc);
}
#endif

using RawFn = uint32_t (*)(uint32_t, const unsigned char*, size_t);

RawFn choose() {
#ifdef INFINITY_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("sse4.2")) return raw_sse42;
#endif
  return raw_table;
}

RawFn implementation() {
  static const RawFn fn = choose();
  return fn;
}

}  // namespace

uint32_t crc32c(const void* data, size_t nbytes, uint32_t seed) {
  return ~implementation()(~seed, static_cast<const unsigned char*>(data), nbytes);
}

uint32_t crc32c_portable(const void* data, size_t nbytes, uint32_t seed) {
  return ~raw_table(~seed, static_cast<const unsigned char*>(data), nbytes);
}

const char* crc32c_implementation() { return implementation() == raw_table ? "table" : "sse4.2"; }

}  // namespace infinity
