// A minimal io_uring ring over the raw system calls (no liburing).
#pragma once

#include <linux/io_uring.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace infinity {

class UringRing {
 public:
  // Throws SysError naming io_uring_setup or mmap when the kernel refuses.
  explicit UringRing(unsigned entries);
  ~UringRing();
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;

  unsigned sq_entries() const noexcept { return sq_entries_; }

  // Queues a read or write; false when the submission ring is full.
  bool queue_rw(bool is_write, int fd, void* addr, uint32_t len, uint64_t offset, uint64_t user_data);
  bool queue_nop(uint64_t user_data);

  // IORING_REGISTER_PROBE: which opcodes this kernel implements. -errno on failure.
  int probe_ops(io_uring_probe* probe, unsigned nr_ops);

  // One io_uring_enter: submits everything queued and, with wait_nr > 0,
  // sleeps in the kernel until that many completions are ready. Returns the
  // number submitted or -errno.
  int submit_and_wait(unsigned wait_nr);

  // Number of queued SQEs the kernel has not consumed yet.
  unsigned unsubmitted() const noexcept;

  // Takes back the SQEs the kernel has not consumed (after a failed enter),
  // calling fn(user_data) for each.
  template <class Fn>
  void drop_unsubmitted(Fn&& fn) {
    unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    for (unsigned i = head; i != sqe_tail_; ++i) fn(sqes_[i & sq_mask_].user_data);
    sqe_tail_ = head;
    __atomic_store_n(sq_tail_, sqe_tail_, __ATOMIC_RELEASE);
  }

  // Calls fn(user_data, res) for every completion ready now; returns how many.
  template <class Fn>
  unsigned reap(Fn&& fn) {
    unsigned head = *cq_head_;  // only this thread writes the head
    // Acquire pairs with the kernel's release of the tail: the CQE contents
    // (and the data the I/O brought in) are visible once the tail is.
    unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    unsigned n = 0;
    for (; head != tail; ++head, ++n) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      fn(cqe.user_data, cqe.res);
    }
    // Release: the kernel may reuse the slots only after we have read them.
    if (n) __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    return n;
  }

 private:
  io_uring_sqe* next_sqe();
  void unmap() noexcept;

  int fd_ = -1;
  unsigned sq_entries_ = 0;
  unsigned sqe_tail_ = 0;  // our shadow of the SQ tail, published at submit
  void* sq_ring_ = nullptr;
  size_t sq_ring_len_ = 0;
  void* cq_ring_ = nullptr;  // same mapping as sq_ring_ with IORING_FEAT_SINGLE_MMAP
  size_t cq_ring_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  size_t sqes_len_ = 0;
  unsigned* sq_head_ = nullptr;
  unsigned* sq_tail_ = nullptr;
  unsigned sq_mask_ = 0;
  unsigned* sq_array_ = nullptr;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

// (usable, reason in words a user can act on).
std::pair<bool, std::string> probe_io_uring();

}  // namespace infinity
