// Kernel AIO (io_setup / io_submit / io_getevents) over raw system calls,
// without libaio.
#pragma once

#include <linux/aio_abi.h>

#include <string>
#include <utility>

namespace infinity {

class AioContext {
 public:
  // Throws SysError naming io_setup when the kernel refuses.
  explicit AioContext(unsigned max_events);
  ~AioContext();
  AioContext(const AioContext&) = delete;
  AioContext& operator=(const AioContext&) = delete;

  // Number submitted, or -errno for the first iocb.
  int submit(long n, iocb** iocbs);
  // Blocks until at least min_nr events are ready; number returned or -errno.
  int getevents(long min_nr, long max_nr, io_event* events, const struct timespec* timeout);

 private:
  aio_context_t ctx_ = 0;
};

// (usable, reason in words a user can act on).
std::pair<bool, std::string> probe_aio();

}  // namespace infinity
