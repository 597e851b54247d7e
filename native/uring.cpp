#include "uring.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "errors.h"

// Old libc headers may lack the numbers; they are the same on every arch
// since the unified syscall table (5.1).
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif

namespace infinity {
namespace {

int sys_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

std::string read_small_file(const char* path) {
  FILE* f = std::fopen(path, "r");
  if (!f) return "";
  char buf[64] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

std::string setup_failure_reason(int err) {
  std::string r = "io_uring_setup failed: " + errno_name(err);
  switch (err) {
    case ENOSYS:
      return r + " (the kernel has no io_uring: older than 5.1 or built without CONFIG_IO_URING); "
                 "use backend aio";
    case EPERM: {
      std::string disabled = read_small_file("/proc/sys/kernel/io_uring_disabled");
      return r + " (disabled by /proc/sys/kernel/io_uring_disabled=" + (disabled.empty() ? "?" : disabled) +
             " or a seccomp filter, e.g. Docker's default profile); set kernel.io_uring_disabled=0, "
             "allow io_uring in the container's seccomp profile, or use backend aio";
    }
    case ENOMEM:
      return r + " (kernels before 5.12 charge the ring to RLIMIT_MEMLOCK); raise `ulimit -l` "
                 "or use backend aio";
    default:
      return r + " (" + errno_text(err) + "); use backend aio";
  }
}

}  // namespace

UringRing::UringRing(unsigned entries) {
  io_uring_params p;
  // SUBMIT_ALL keeps submitting past an SQE that fails early (it gets an
  // error CQE instead); COOP_TASKRUN avoids interrupting the worker for
  // completions it will collect in io_uring_enter anyway. Kernels before
  // 5.19 reject the flags, so retry bare.
  const unsigned flag_sets[] = {IORING_SETUP_CLAMP | IORING_SETUP_SUBMIT_ALL | IORING_SETUP_COOP_TASKRUN,
                                IORING_SETUP_CLAMP, 0};
  int fd = -1, err = 0;
  for (unsigned flags : flag_sets) {
    std::memset(&p, 0, sizeof(p));
    p.flags = flags;
    fd = sys_setup(entries, &p);
    if (fd >= 0) break;
    err = errno;
    if (err != EINVAL) break;
  }
  if (fd < 0) throw SysError(err, setup_failure_reason(err));
  fd_ = fd;
  sq_entries_ = p.sq_entries;

  sq_ring_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  cq_ring_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
  if (single) sq_ring_len_ = cq_ring_len_ = std::max(sq_ring_len_, cq_ring_len_);

  auto map = [&](size_t len, off_t what, const char* name) -> void* {
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, what);
    if (m == MAP_FAILED) {
      int e = errno;
      unmap();
      throw SysError(e, std::string("mmap of the io_uring ") + name + " (fd " + std::to_string(fd_) +
                            ", " + std::to_string(len) + " bytes) failed: " + errno_text(e) +
                            "; use backend aio");
    }
    return m;
  };
  sq_ring_ = map(sq_ring_len_, IORING_OFF_SQ_RING, "submission ring");
  if (single) {
    cq_ring_ = sq_ring_;
  } else {
    cq_ring_ = map(cq_ring_len_, IORING_OFF_CQ_RING, "completion ring");
  }
  sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
  sqes_ = static_cast<io_uring_sqe*>(map(sqes_len_, IORING_OFF_SQES, "SQE array"));

  char* sq = static_cast<char*>(sq_ring_);
  char* cq = static_cast<char*>(cq_ring_);
  sq_head_ = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
  sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
  sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
  sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
  cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
  cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
  cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
  cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
  // The indirection array never changes: slot i of the ring is SQE i.
  for (unsigned i = 0; i < p.sq_entries; ++i) sq_array_[i] = i;
  sqe_tail_ = *sq_tail_;
}

UringRing::~UringRing() { unmap(); }

void UringRing::unmap() noexcept {
  // Failures here cannot be acted on (the arguments came from the kernel);
  // the ring goes away with its fd in any case.
  if (sqes_) (void)munmap(sqes_, sqes_len_);
  if (cq_ring_ && cq_ring_ != sq_ring_) (void)munmap(cq_ring_, cq_ring_len_);
  if (sq_ring_) (void)munmap(sq_ring_, sq_ring_len_);
  sqes_ = nullptr;
  cq_ring_ = sq_ring_ = nullptr;
  if (fd_ >= 0) (void)::close(fd_);
  fd_ = -1;
}

io_uring_sqe* UringRing::next_sqe() {
  unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
  if (sqe_tail_ - head >= sq_entries_) return nullptr;
  io_uring_sqe* sqe = &sqes_[sqe_tail_ & sq_mask_];
  ++sqe_tail_;
  std::memset(sqe, 0, sizeof(*sqe));
  return sqe;
}

bool UringRing::queue_rw(bool is_write, int fd, void* addr, uint32_t len, uint64_t offset, uint64_t user_data) {
  io_uring_sqe* sqe = next_sqe();
  if (!sqe) return false;
  sqe->opcode = is_write ? IORING_OP_WRITE : IORING_OP_READ;
  sqe->fd = fd;
  sqe->off = offset;
  sqe->addr = reinterpret_cast<uint64_t>(addr);
  sqe->len = len;
  sqe->user_data = user_data;
  return true;
}

bool UringRing::queue_nop(uint64_t user_data) {
  io_uring_sqe* sqe = next_sqe();
  if (!sqe) return false;
  sqe->opcode = IORING_OP_NOP;
  sqe->user_data = user_data;
  return true;
}

unsigned UringRing::unsubmitted() const noexcept {
  return sqe_tail_ - __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
}

int UringRing::submit_and_wait(unsigned wait_nr) {
  // Release: the SQE contents must be visible before the kernel sees the tail.
  __atomic_store_n(sq_tail_, sqe_tail_, __ATOMIC_RELEASE);
  unsigned flags = wait_nr ? IORING_ENTER_GETEVENTS : 0;
  int r = sys_enter(fd_, unsubmitted(), wait_nr, flags);
  return r < 0 ? -errno : r;
}

int UringRing::probe_ops(io_uring_probe* probe, unsigned nr_ops) {
  int r = static_cast<int>(syscall(__NR_io_uring_register, fd_, IORING_REGISTER_PROBE, probe, nr_ops));
  return r < 0 ? -errno : r;
}

std::pair<bool, std::string> probe_io_uring() {
  std::unique_ptr<UringRing> ring;
  try {
    ring.reset(new UringRing(4));
  } catch (const SysError& e) {
    return {false, e.what()};
  }
  // A ring alone is not enough: the READ/WRITE opcodes arrived in 5.6, and a
  // seccomp filter may allow setup but not enter. Ask the kernel which
  // opcodes it has, then push a NOP through.
  const unsigned nr_ops = 256;
  std::unique_ptr<unsigned char[]> mem(new unsigned char[sizeof(io_uring_probe) + nr_ops * sizeof(io_uring_probe_op)]());
  auto* probe = reinterpret_cast<io_uring_probe*>(mem.get());
  int r = ring->probe_ops(probe, nr_ops);
  if (r < 0)
    return {false, "io_uring_register(IORING_REGISTER_PROBE) failed: " + errno_name(-r) +
                       " (the kernel is older than 5.6 and lacks the read/write opcodes); use backend aio"};
  auto supported = [&](unsigned op) {
    return op <= probe->last_op && (probe->ops[op].flags & IO_URING_OP_SUPPORTED);
  };
  if (!supported(IORING_OP_READ) || !supported(IORING_OP_WRITE))
    return {false, "io_uring lacks IORING_OP_READ/IORING_OP_WRITE (kernel older than 5.6); use backend aio"};
  if (!ring->queue_nop(1)) return {false, "io_uring submission ring is full right after setup"};
  for (;;) {
    r = ring->submit_and_wait(1);
    if (r != -EINTR) break;
  }
  if (r < 0)
    return {false, "io_uring_enter failed: " + errno_name(-r) + " (" + errno_text(-r) +
                       "; a seccomp filter may block it); use backend aio"};
  int res = 1;
  unsigned got = ring->reap([&](uint64_t, int rv) { res = rv; });
  if (got != 1 || res != 0)
    return {false, "io_uring did not complete a NOP (got " + std::to_string(got) + " completions, result " +
                       std::to_string(res) + "); use backend aio"};
  return {true, "io_uring works: setup, opcode probe and a NOP round trip succeeded"};
}

}  // namespace infinity
