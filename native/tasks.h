// The kinds of work the task pool runs: copy, CRC32C per block, fill. Each
// validates its arguments when made (std::invalid_argument, or
// AlignmentViolation for a misaligned checksum array) and splits itself into
// chunks for the pool's threads. An optimizer step is added the same way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "adam.h"
#include "task_pool.h"

namespace infinity {

// How many pieces to cut `nbytes` into for `threads` threads when the caller
// leaves it to us: one per thread, but none under `min_piece` bytes.
size_t auto_pieces(size_t nbytes, size_t min_piece, int threads) noexcept;

// Copies nbytes from src to dst (disjoint) in `pieces` parts on 4 KiB
// boundaries, with the streaming stores of copy_range.
class CopyTask final : public Task {
 public:
  CopyTask(uint64_t dst, uint64_t src, int64_t nbytes, size_t pieces);
  size_t chunks() const noexcept override { return chunks_; }
  int run_chunk(size_t index, std::string* message) override;

 private:
  char* dst_;
  const char* src_;
  size_t n_;
  size_t piece_;
  size_t chunks_;
};

// Sets nbytes at dst to `value`, in `pieces` parts on 4 KiB boundaries.
class FillTask final : public Task {
 public:
  FillTask(uint64_t dst, int64_t nbytes, int value, size_t pieces);
  size_t chunks() const noexcept override { return chunks_; }
  int run_chunk(size_t index, std::string* message) override;

 private:
  char* dst_;
  size_t n_;
  unsigned char value_;
  size_t piece_;
  size_t chunks_;
};

// The CRC32C of each block_bytes block of nbytes at data (the last block may
// be short), into uint32[ceil(nbytes / block_bytes)] at crc_addr, as the
// engine's crc_addr/crc_block_bytes do. verify: compare with the values
// already there instead, and fail with EBADMSG naming the first block that
// differs (crc_addr is then only read).
class Crc32cTask final : public Task {
 public:
  Crc32cTask(uint64_t data, int64_t nbytes, uint64_t crc_addr, int64_t block_bytes, bool verify, size_t pieces);
  size_t chunks() const noexcept override { return chunks_; }
  int run_chunk(size_t index, std::string* message) override;
  size_t blocks() const noexcept { return blocks_; }

 private:
  const char* data_;
  size_t n_;
  uint32_t* crcs_;
  size_t block_;
  size_t blocks_;
  bool verify_;
  size_t blocks_per_chunk_;
  size_t chunks_;
};

// One Adam / AdamW step (adam.h) over numel elements, in chunks of chunk_elements elements
// (whole vectors). The buffers were checked by adam_check when it was made.
class AdamTask final : public Task {
 public:
  AdamTask(const AdamBuffers& buffers, const AdamHyper& hyper, int64_t numel, int64_t chunk_elements);
  size_t chunks() const noexcept override { return chunks_; }
  int run_chunk(size_t index, std::string* message) override;

 private:
  AdamBuffers buffers_;
  AdamHyper hyper_;
  size_t n_;
  size_t chunk_;
  size_t chunks_;
};

}  // namespace infinity
