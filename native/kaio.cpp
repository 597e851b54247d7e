#include "kaio.h"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <memory>

#include "errors.h"

namespace infinity {
namespace {

std::string setup_failure_reason(int err, unsigned max_events) {
  std::string r = "io_setup(" + std::to_string(max_events) + ") failed: " + errno_name(err);
  switch (err) {
    case ENOSYS:
      return r + " (the kernel was built without CONFIG_AIO); use backend threads";
    case EAGAIN:
      return r + " (the system-wide limit /proc/sys/fs/aio-max-nr is used up; see /proc/sys/fs/aio-nr); "
                 "raise it with `sysctl fs.aio-max-nr=1048576`, lower io.queue_depth, or use backend threads";
    case EPERM:
      return r + " (blocked by a seccomp filter); allow io_setup in the container's profile or use "
                 "backend threads";
    default:
      return r + " (" + errno_text(err) + "); use backend threads";
  }
}

}  // namespace

AioContext::AioContext(unsigned max_events) {
  if (syscall(__NR_io_setup, max_events, &ctx_) != 0) {
    int err = errno;
    throw SysError(err, setup_failure_reason(err, max_events));
  }
}

AioContext::~AioContext() {
  // io_destroy waits for outstanding requests; the engine never has any
  // left by now, and a failure here has no one to report to.
  if (ctx_) (void)syscall(__NR_io_destroy, ctx_);
}

int AioContext::submit(long n, iocb** iocbs) {
  long r = syscall(__NR_io_submit, ctx_, n, iocbs);
  return r < 0 ? -errno : static_cast<int>(r);
}

int AioContext::getevents(long min_nr, long max_nr, io_event* events, const struct timespec* timeout) {
  long r = syscall(__NR_io_getevents, ctx_, min_nr, max_nr, events, timeout);
  return r < 0 ? -errno : static_cast<int>(r);
}

std::pair<bool, std::string> probe_aio() {
  std::unique_ptr<AioContext> ctx;
  try {
    ctx.reset(new AioContext(1));
  } catch (const SysError& e) {
    return {false, e.what()};
  }
  // A seccomp filter could allow io_setup yet block io_getevents; a
  // zero-timeout poll exercises it without needing a file.
  io_event ev;
  struct timespec zero = {0, 0};
  int r = ctx->getevents(0, 1, &ev, &zero);
  if (r < 0)
    return {false, "io_getevents failed: " + errno_text(-r) + "; use backend threads"};
  return {true, "kernel AIO works: io_setup and io_getevents succeeded"};
}

}  // namespace infinity
