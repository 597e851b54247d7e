#include "shared_memory.h"

#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "errors.h"

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older headers do not name it
#endif

namespace infinity {
namespace {

constexpr size_t kHugePageBytes = 2u << 20;

// An address range reserved (no access, no memory) and given back on every way out.
class Reservation {
 public:
  explicit Reservation(size_t nbytes) : nbytes_(nbytes) {
    void* p = mmap(nullptr, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      throw SysError(err, "reserving " + std::to_string(nbytes) +
                              " bytes of address space to map shared memory failed: " +
                              errno_text(err));
    }
    base_ = static_cast<char*>(p);
  }
  ~Reservation() { (void)munmap(base_, nbytes_); }  // also drops what was mapped over it
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  char* base() const noexcept { return base_; }

 private:
  char* base_ = nullptr;
  size_t nbytes_ = 0;
};

}  // namespace

int collapse_shared_memory(int fd, size_t nbytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    throw SysError(err, "fstat of shared memory (fd " + std::to_string(fd) +
                            ") to give it huge pages failed: " + errno_text(err));
  }
  // Not past the file's end: a huge page there would be memory the file cannot hand out.
  const size_t size = st.st_size > 0 ? static_cast<size_t>(st.st_size) : 0;
  const size_t huge = (nbytes < size ? nbytes : size) / kHugePageBytes * kHugePageBytes;
  if (huge == 0) return 0;  // nothing a huge page could hold
  Reservation space(huge + kHugePageBytes);
  const uintptr_t start = reinterpret_cast<uintptr_t>(space.base());
  char* aligned = reinterpret_cast<char*>((start + kHugePageBytes - 1) & ~(kHugePageBytes - 1));
  // Over the reservation, so the range is ours: nothing else can be mapped there meanwhile.
  void* p = mmap(aligned, huge, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw SysError(err, "mapping " + std::to_string(huge) + " bytes of shared memory (fd " +
                            std::to_string(fd) + ") to give it huge pages failed: " +
                            errno_text(err));
  }
  if (madvise(aligned, huge, MADV_COLLAPSE) != 0) return errno;
  return 0;
}

}  // namespace infinity
