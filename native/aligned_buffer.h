// Page-aligned, zero-filled host memory for O_DIRECT transfers.
#pragma once

#include <cstddef>

namespace infinity {

class AlignedBuffer {
 public:
  // alignment: a power of two. lock: mlock the pages (throws SysError with a
  // message about RLIMIT_MEMLOCK when the kernel refuses).
  AlignedBuffer(size_t nbytes, size_t alignment = 4096, bool lock = false);
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;

  void* data() const noexcept { return ptr_; }
  size_t nbytes() const noexcept { return nbytes_; }
  size_t alignment() const noexcept { return alignment_; }
  bool locked() const noexcept { return locked_; }

 private:
  void release() noexcept;

  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  size_t alignment_ = 0;
  size_t mapped_ = 0;  // bytes mapped with mmap; 0 when posix_memalign was used
  bool locked_ = false;
};

}  // namespace infinity
