#include "aligned_buffer.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "errors.h"

namespace infinity {
namespace {

size_t page_size() {
  long v = sysconf(_SC_PAGESIZE);
  return v > 0 ? static_cast<size_t>(v) : 4096;
}

std::string memlock_limit_text() {
  struct rlimit lim;
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return "unknown";
  if (lim.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(static_cast<unsigned long long>(lim.rlim_cur)) + " bytes";
}

}  // namespace

AlignedBuffer::AlignedBuffer(size_t nbytes, size_t alignment, bool lock)
    : nbytes_(nbytes), alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw std::invalid_argument("AlignedBuffer: alignment " + std::to_string(alignment) +
                                " is not a power of two; use 4096");
  // A zero-byte buffer still gets a real page so its address is valid.
  const size_t want = nbytes ? nbytes : 1;
  const size_t page = page_size();
  if (alignment <= page) {
    // Anonymous pages arrive zeroed and page-aligned, without touching them.
    const size_t len = (want + page - 1) / page * page;
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      throw SysError(err, "mmap of " + std::to_string(len) + " bytes for an aligned buffer failed: " +
                              errno_text(err) + "; free memory or allocate a smaller buffer");
    }
    ptr_ = p;
    mapped_ = len;
    // Large buffers take fewer page faults and TLB misses on huge pages; a
    // kernel without THP just says no, which is fine.
    if (len >= (2u << 20)) (void)madvise(p, len, MADV_HUGEPAGE);
  } else {
    void* p = nullptr;
    int err = posix_memalign(&p, alignment, want);
    if (err != 0)
      throw SysError(err, "posix_memalign of " + std::to_string(want) + " bytes aligned to " +
                              std::to_string(alignment) + " failed: " + errno_text(err) +
                              "; free memory or allocate a smaller buffer");
    std::memset(p, 0, want);
    ptr_ = p;
  }
  if (lock) {
    if (mlock(ptr_, want) != 0) {
      int err = errno;
      release();
      throw SysError(err, "mlock of " + std::to_string(want) + " bytes failed: " + errno_text(err) +
                              ": the locked-memory limit RLIMIT_MEMLOCK (now " + memlock_limit_text() +
                              ") is too low; raise it with `ulimit -l unlimited` (LimitMEMLOCK=infinity "
                              "in a systemd unit, --ulimit memlock=-1 for docker) or allocate with "
                              "lock=False");
    }
    locked_ = true;
  }
}

AlignedBuffer::~AlignedBuffer() { release(); }

void AlignedBuffer::release() noexcept {
  if (!ptr_) return;
  // munmap and free drop any mlock with the pages.
  if (mapped_)
    (void)munmap(ptr_, mapped_);
  else
    std::free(ptr_);
  ptr_ = nullptr;
  mapped_ = 0;
  locked_ = false;
}

}  // namespace infinity
