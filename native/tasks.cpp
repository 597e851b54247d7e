#include "tasks.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "copy.h"
#include "crc32c.h"
#include "errors.h"

namespace infinity {
namespace {

constexpr size_t kPage = 4096;

size_t checked_size(int64_t nbytes, const char* what) {
  if (nbytes < 0) throw std::invalid_argument(std::string(what) + " is " + std::to_string(nbytes) + "; it must be >= 0");
  return static_cast<size_t>(nbytes);
}

void check_address(uint64_t addr, size_t n, const char* what) {
  if (n > 0 && addr == 0) throw std::invalid_argument(std::string(what) + " is 0 (a null pointer)");
  if (n > 0 && addr + n < addr)
    throw std::invalid_argument(std::string(what) + " " + hex(addr) + " plus " + std::to_string(n) +
                                " bytes runs past the end of the address space");
}

size_t checked_pieces(size_t pieces) {
  if (pieces == 0 || pieces > 65536)
    throw std::invalid_argument("pieces is " + std::to_string(pieces) + "; it must be 1 to 65536");
  return pieces;
}

// Piece length for n bytes in `pieces` parts: whole pages, so no two threads write one cache line.
size_t piece_bytes(size_t n, size_t pieces) {
  const size_t piece = ((n / pieces) + kPage - 1) & ~(kPage - 1);
  return piece == 0 ? kPage : piece;
}

size_t chunk_count(size_t n, size_t piece) { return n == 0 ? 1 : (n + piece - 1) / piece; }

}  // namespace

size_t auto_pieces(size_t nbytes, size_t min_piece, int threads) noexcept {
  const size_t most = threads < 1 ? 1 : static_cast<size_t>(threads);
  const size_t by_size = min_piece == 0 ? most : nbytes / min_piece;
  return std::max<size_t>(1, std::min(most, by_size));
}

CopyTask::CopyTask(uint64_t dst, uint64_t src, int64_t nbytes, size_t pieces) {
  n_ = checked_size(nbytes, "nbytes");
  check_address(dst, n_, "destination address");
  check_address(src, n_, "source address");
  if (n_ > 0 && dst < src + n_ && src < dst + n_)
    throw std::invalid_argument("source and destination overlap; a copy needs disjoint buffers");
  dst_ = reinterpret_cast<char*>(dst);
  src_ = reinterpret_cast<const char*>(src);
  piece_ = piece_bytes(n_, checked_pieces(pieces));
  chunks_ = chunk_count(n_, piece_);
}

int CopyTask::run_chunk(size_t index, std::string*) {
  const size_t off = index * piece_;
  if (off < n_) copy_range(dst_ + off, src_ + off, std::min(piece_, n_ - off));
  return 0;
}

FillTask::FillTask(uint64_t dst, int64_t nbytes, int value, size_t pieces) {
  n_ = checked_size(nbytes, "nbytes");
  check_address(dst, n_, "destination address");
  if (value < 0 || value > 255)
    throw std::invalid_argument("fill value is " + std::to_string(value) + "; it must be a byte, 0 to 255");
  dst_ = reinterpret_cast<char*>(dst);
  value_ = static_cast<unsigned char>(value);
  piece_ = piece_bytes(n_, checked_pieces(pieces));
  chunks_ = chunk_count(n_, piece_);
}

int FillTask::run_chunk(size_t index, std::string*) {
  const size_t off = index * piece_;
  if (off < n_) std::memset(dst_ + off, value_, std::min(piece_, n_ - off));
  return 0;
}

Crc32cTask::Crc32cTask(uint64_t data, int64_t nbytes, uint64_t crc_addr, int64_t block_bytes, bool verify,
                       size_t pieces)
    : verify_(verify) {
  n_ = checked_size(nbytes, "nbytes");
  check_address(data, n_, "data address");
  if (block_bytes <= 0)
    throw std::invalid_argument("crc_block_bytes is " + std::to_string(block_bytes) + "; it must be > 0");
  block_ = static_cast<size_t>(block_bytes);
  blocks_ = n_ / block_ + (n_ % block_ != 0 ? 1 : 0);
  if (blocks_ > 0 && crc_addr == 0) throw std::invalid_argument("crc_addr is 0 (a null pointer)");
  check_address(crc_addr, blocks_ * sizeof(uint32_t), "crc_addr");
  if (crc_addr % alignof(uint32_t) != 0)
    throw AlignmentViolation("crc_addr " + hex(crc_addr) +
                             " is not 4-byte aligned; the checksums are an array of uint32");
  data_ = reinterpret_cast<const char*>(data);
  crcs_ = reinterpret_cast<uint32_t*>(crc_addr);
  const size_t parts = std::min(checked_pieces(pieces), std::max<size_t>(1, blocks_));
  blocks_per_chunk_ = std::max<size_t>(1, (blocks_ + parts - 1) / parts);
  chunks_ = blocks_ == 0 ? 1 : (blocks_ + blocks_per_chunk_ - 1) / blocks_per_chunk_;
}

int Crc32cTask::run_chunk(size_t index, std::string* message) {
  const size_t first = index * blocks_per_chunk_;
  const size_t last = std::min(blocks_, first + blocks_per_chunk_);
  for (size_t k = first; k < last; ++k) {
    const size_t off = k * block_;
    const size_t len = std::min(block_, n_ - off);
    const uint32_t crc = crc32c(data_ + off, len, 0);
    if (!verify_) {
      crcs_[k] = crc;
    } else if (crcs_[k] != crc) {
      char text[160];
      snprintf(text, sizeof(text), "CRC32C mismatch in block %zu (bytes %zu to %zu): expected 0x%08x, computed 0x%08x",
               k, off, off + len, crcs_[k], crc);
      *message = text;
      return EBADMSG;
    }
  }
  return 0;
}

AdamTask::AdamTask(const AdamBuffers& buffers, const AdamHyper& hyper, int64_t numel, int64_t chunk_elements)
    : buffers_(buffers), hyper_(hyper) {
  if (numel < 0) throw std::invalid_argument("numel is " + std::to_string(numel) + "; it must be >= 0");
  if (chunk_elements <= 0)
    throw std::invalid_argument("chunk_elements is " + std::to_string(chunk_elements) + "; it must be > 0");
  const std::string problem = adam_check(buffers, hyper);
  if (!problem.empty()) throw std::invalid_argument(problem);
  n_ = static_cast<size_t>(numel);
  // Whole 64-byte vectors per chunk, so no two threads write one cache line of a buffer.
  chunk_ = (static_cast<size_t>(chunk_elements) + 15) / 16 * 16;
  chunks_ = n_ == 0 ? 1 : (n_ + chunk_ - 1) / chunk_;
}

int AdamTask::run_chunk(size_t index, std::string*) {
  const size_t begin = index * chunk_;
  const size_t end = begin + chunk_ < n_ ? begin + chunk_ : n_;
  adam_step_range(buffers_, hyper_, begin, end);
  return 0;
}

}  // namespace infinity
