// Copying large buffers into memory another process will read: the store's put path.
#pragma once

#include <cstddef>

namespace infinity {

// Copies n bytes from src to dst (which must not overlap). Large copies use
// non-temporal stores where the CPU has AVX2 or AVX-512: the destination is a
// shared slice this process will not read back, so loading its old contents
// into the cache (what ordinary stores do first) only halves the bandwidth.
// num_threads > 1 splits copies of 16 MiB and more into that many pieces, run
// by this thread and the process-wide task pool (shared_task_pool()).
void copy_bytes(void* dst, const void* src, size_t n, int num_threads);

// One thread's share of a copy: streaming stores from 1 MiB up where the CPU
// has them, memcpy below. What the task pool's copy tasks run per chunk.
void copy_range(void* dst, const void* src, size_t n) noexcept;

// "avx512-stream" | "avx2-stream" | "memcpy": what copy_bytes uses for large copies here.
const char* copy_implementation();

}  // namespace infinity
