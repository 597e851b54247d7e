// Threading model: submit() validates and queues whole ops; each worker cuts
// chunks of block_size bytes off the front of the queue, up to queue_depth
// of them in flight, so a large op spreads over all workers while a worker
// never allocates per chunk (its slots are fixed at start). A CRC block is
// checksummed once its last chunk has been issued (writes: the buffer is
// already final, so the CRC overlaps the disk) or has arrived (reads), by
// that worker or an idle one. The worker that finishes the last chunk of an
// op retires the op, and the one that retires the last op of a batch
// publishes the batch under done_mu_ and signals the eventfd.
// A staged read (OpSpec::staged) lands in a block of its worker's staging
// area; the worker checks the CRC and copies it to the destination before it
// gives the slot and the block back. A staged write is copied into a block
// before it is issued and goes out from there. A block serves one chunk at a time.
#include "engine.h"

#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "aligned_buffer.h"
#include "copy.h"
#include "crc32c.h"
#include "errors.h"
#include "kaio.h"
#include "uring.h"

namespace infinity {
namespace detail {

struct Op {
  Batch* batch = nullptr;
  size_t index = 0;
  bool is_write = false;
  bool direct = false;
  bool via_threads = false;
  bool staged = false;
  int fd = -1;
  unsigned char* buf = nullptr;
  uint64_t nbytes = 0;
  uint64_t offset = 0;
  uint32_t* crc = nullptr;
  uint64_t crc_block = 0;
  std::atomic<uint64_t>* crc_left = nullptr;  // bytes of each CRC block still to arrive
  // A checksummed write's chunk is finished twice: once by its I/O and once
  // by the CRC job that runs while that I/O is in flight.
  uint32_t finishes_per_chunk = 1;
  std::atomic<uint64_t> chunks_left{0};
  uint64_t next = 0;  // first byte not yet handed out; guarded by its queue's mutex
};

struct Batch {
  uint64_t id = 0;
  std::unique_ptr<Op[]> ops;
  std::unique_ptr<std::atomic<uint64_t>[]> crc_left;
  std::atomic<size_t> ops_left{0};
  std::atomic<bool> failed{false};
  std::mutex err_mu;
  size_t err_index = SIZE_MAX;
  int err = 0;
  std::string message;
  bool done = false;  // guarded by Engine::done_mu_
};

}  // namespace detail

using detail::Batch;
using detail::Chunk;
using detail::Op;
using detail::WorkQueue;

namespace {

constexpr uint64_t kDirectAlign = 4096;
constexpr uintptr_t kHugePage = 2u << 20;
constexpr int kMadvPopulateWrite = 23;  // Linux 5.14; older headers do not name it
// EAGAIN/EINTR on one chunk this many times in a row is treated as an error
// rather than looping forever.
constexpr uint32_t kMaxRetries = 64;

void name_thread(const char* name) { (void)pthread_setname_np(pthread_self(), name); }

void backoff() {
  // Only reached when the kernel reports a transient shortage with nothing
  // of ours to reap; a short sleep beats spinning on a 2-core machine.
  struct timespec ts = {0, 100 * 1000};
  (void)nanosleep(&ts, nullptr);
}

}  // namespace

Engine::Engine(int num_threads, int queue_depth, int64_t block_size_bytes, const std::string& backend,
               int64_t staging_bytes)
    : num_threads_(num_threads),
      queue_depth_(queue_depth),
      block_(static_cast<uint64_t>(block_size_bytes)),
      staging_blocks_(static_cast<size_t>(std::max<int64_t>(
          1, std::min<int64_t>(queue_depth, staging_bytes / std::max<int64_t>(block_size_bytes, 1))))) {
  if (staging_bytes < 0)
    throw std::invalid_argument("staging_bytes is " + std::to_string(staging_bytes) + "; it must be >= 0");
  if (num_threads < 1 || num_threads > 1024)
    throw std::invalid_argument("num_threads is " + std::to_string(num_threads) + "; it must be 1..1024");
  if (queue_depth < 1 || queue_depth > 32768)
    throw std::invalid_argument("queue_depth is " + std::to_string(queue_depth) + "; it must be 1..32768");
  if (block_size_bytes < static_cast<int64_t>(kDirectAlign) || block_size_bytes % kDirectAlign != 0 ||
      block_size_bytes > (int64_t(1) << 30))
    throw std::invalid_argument("block_size_bytes is " + std::to_string(block_size_bytes) +
                                "; it must be a multiple of 4096 between 4096 and 1073741824");

  if (backend == "auto") {
    std::string why = try_uring();
    if (why.empty()) {
      kind_ = Kind::kUring;
    } else {
      backend_note_ = why;
      std::string why_aio = try_aio();
      if (why_aio.empty()) {
        kind_ = Kind::kAio;
      } else {
        backend_note_ += "; " + why_aio;
        kind_ = Kind::kThreads;
      }
    }
  } else if (backend == "io_uring") {
    std::string why = try_uring();
    if (!why.empty())
      throw std::runtime_error("backend io_uring is not usable here: " + why + " (or set io.backend=auto)");
    kind_ = Kind::kUring;
  } else if (backend == "aio") {
    std::string why = try_aio();
    if (!why.empty())
      throw std::runtime_error("backend aio is not usable here: " + why + " (or set io.backend=auto)");
    kind_ = Kind::kAio;
  } else if (backend == "threads") {
    kind_ = Kind::kThreads;
  } else {
    throw std::invalid_argument("backend must be auto, io_uring, aio or threads, not '" + backend + "'");
  }
  backend_ = kind_ == Kind::kUring ? "io_uring" : kind_ == Kind::kAio ? "aio" : "threads";

  // Non-blocking so poll() can drain it without ever sleeping.
  efd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd_ < 0) {
    int err = errno;
    throw SysError(err, "eventfd failed: " + errno_text(err) + "; the process may be out of file descriptors "
                        "(raise `ulimit -n`)");
  }
  try {
    if (kind_ == Kind::kThreads) {
      std::lock_guard<std::mutex> st(state_mu_);
      ensure_sync_pool();
    } else {
      start_async_threads();
    }
  } catch (...) {
    stop_threads();
    (void)::close(efd_);
    throw;
  }
}

Engine::~Engine() { close(); }

std::string Engine::try_uring() {
  auto probe = probe_io_uring();
  if (!probe.first) return probe.second;
  try {
    for (int i = 0; i < num_threads_; ++i) rings_.emplace_back(new UringRing(static_cast<unsigned>(queue_depth_)));
  } catch (const SysError& e) {
    rings_.clear();
    return e.what();
  }
  return "";
}

std::string Engine::try_aio() {
  auto probe = probe_aio();
  if (!probe.first) return probe.second;
  try {
    for (int i = 0; i < num_threads_; ++i) aio_.emplace_back(new AioContext(static_cast<unsigned>(queue_depth_)));
  } catch (const SysError& e) {
    aio_.clear();
    return e.what();
  }
  return "";
}

void Engine::start_async_threads() {
  async_q_.crc_ring.resize(static_cast<size_t>(num_threads_) * static_cast<size_t>(queue_depth_));
  for (int i = 0; i < num_threads_; ++i) {
    size_t index = static_cast<size_t>(i);
    if (kind_ == Kind::kUring)
      async_threads_.emplace_back([this, index] { uring_worker(index); });
    else
      async_threads_.emplace_back([this, index] { aio_worker(index); });
  }
}

// Called with state_mu_ held. The pool starts on the first non-direct op so
// an engine that only does O_DIRECT never carries idle threads.
void Engine::ensure_sync_pool() {
  if (sync_started_) return;
  for (int i = 0; i < num_threads_; ++i) {
    try {
      sync_threads_.emplace_back([this] { sync_worker(); });
    } catch (...) {
      if (sync_threads_.empty()) throw;
      break;  // fewer threads still do the work
    }
  }
  sync_started_ = true;
}

void Engine::stop_threads() noexcept {
  for (WorkQueue* q : {&async_q_, &sync_q_}) {
    {
      std::lock_guard<std::mutex> lk(q->mu);
      q->stopping = true;
    }
    q->cv.notify_all();
  }
  for (auto& t : async_threads_)
    if (t.joinable()) t.join();
  for (auto& t : sync_threads_)
    if (t.joinable()) t.join();
  async_threads_.clear();
  sync_threads_.clear();
}

int Engine::completion_fd() const { return efd_; }

// --- submission ---------------------------------------------------------------

namespace {

void validate(const OpSpec& s, size_t i) {
  const std::string where =
      "op " + std::to_string(i) + " (" + (s.is_write ? "write" : "read") + ", fd " + std::to_string(s.fd) + ")";
  if (s.fd < INT_MIN || s.fd > INT_MAX)
    throw std::invalid_argument(where + ": the fd is out of range for a file descriptor");
  if (s.nbytes < 0)
    throw std::invalid_argument(where + ": nbytes is " + std::to_string(s.nbytes) + "; it must be >= 0");
  if (s.file_offset < 0)
    throw std::invalid_argument(where + ": file offset is " + std::to_string(s.file_offset) +
                                "; it must be >= 0");
  if (s.nbytes > 0 && s.buf_addr == 0)
    throw std::invalid_argument(where + ": the buffer address is 0 (a null pointer)");
  if (s.file_offset > INT64_MAX - s.nbytes)
    throw std::invalid_argument(where + ": file offset + nbytes overflows a 64-bit file position");
  if (s.crc_addr != 0) {
    if (s.crc_block_bytes <= 0)
      throw std::invalid_argument(where + ": crc_block_bytes is " + std::to_string(s.crc_block_bytes) +
                                  "; it must be > 0 when crc_addr is set (the store uses 1048576)");
    if (s.crc_addr % alignof(uint32_t) != 0)
      throw std::invalid_argument(where + ": crc_addr " + hex(s.crc_addr) +
                                  " is not 4-byte aligned; it must point to an array of uint32");
  }
  if (s.staged && !s.direct)
    throw std::invalid_argument(where + ": staged applies to O_DIRECT ops only; pass staged=False");
  if (s.direct) {
    const char* advice =
        " is not a multiple of 4096; O_DIRECT needs the buffer address, nbytes and file offset "
        "4096-aligned: allocate buffers with infinity.io.aligned_empty (capacity rounded up to 4096) "
        "or pass direct=False";
    if (s.buf_addr % kDirectAlign)
      throw AlignmentViolation(where + ": the buffer address " + hex(s.buf_addr) + advice);
    if (s.nbytes % kDirectAlign)
      throw AlignmentViolation(where + ": nbytes " + std::to_string(s.nbytes) + advice);
    if (s.file_offset % kDirectAlign)
      throw AlignmentViolation(where + ": the file offset " + std::to_string(s.file_offset) + advice);
  }
}

}  // namespace

uint64_t Engine::submit(const std::vector<OpSpec>& specs) {
  // One counter per checksum block is allocated below: the total is bounded, so that a sum
  // that wrapped cannot size that array smaller than the ops write into it.
  constexpr uint64_t kMaxCrcBlocks = uint64_t(1) << 32;
  uint64_t total_crc_blocks = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    validate(specs[i], i);
    const OpSpec& s = specs[i];
    if (s.crc_addr) {
      const uint64_t nbytes = static_cast<uint64_t>(s.nbytes);
      const uint64_t cb = static_cast<uint64_t>(s.crc_block_bytes);
      const uint64_t blocks = nbytes / cb + (nbytes % cb != 0);
      if (blocks > kMaxCrcBlocks - total_crc_blocks)
        throw std::invalid_argument("op " + std::to_string(i) + ": the batch would have more than 2**32 "
                                    "checksum blocks; pass a larger crc_block_bytes or split the batch");
      total_crc_blocks += blocks;
    }
  }

  auto batch = std::make_unique<Batch>();
  batch->ops.reset(new Op[specs.size()]);
  if (total_crc_blocks) batch->crc_left.reset(new std::atomic<uint64_t>[total_crc_blocks]);
  size_t active = 0;
  bool need_sync = false, need_async = false;
  uint64_t crc_cursor = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const OpSpec& s = specs[i];
    Op& op = batch->ops[i];
    op.batch = batch.get();
    op.index = i;
    op.is_write = s.is_write;
    op.direct = s.direct;
    op.via_threads = !s.direct || kind_ == Kind::kThreads;
    op.staged = s.staged;
    op.fd = static_cast<int>(s.fd);
    op.buf = reinterpret_cast<unsigned char*>(s.buf_addr);
    op.nbytes = static_cast<uint64_t>(s.nbytes);
    op.offset = static_cast<uint64_t>(s.file_offset);
    if (s.crc_addr && op.nbytes) {
      op.crc = reinterpret_cast<uint32_t*>(s.crc_addr);
      op.crc_block = static_cast<uint64_t>(s.crc_block_bytes);
      op.crc_left = &batch->crc_left[crc_cursor];
      const uint64_t blocks = (op.nbytes + op.crc_block - 1) / op.crc_block;
      for (uint64_t k = 0; k < blocks; ++k)
        op.crc_left[k].store(std::min(op.crc_block, op.nbytes - k * op.crc_block), std::memory_order_relaxed);
      crc_cursor += blocks;
    }
    if (op.nbytes) {
      op.finishes_per_chunk = (op.crc && op.is_write) ? 2 : 1;
      op.chunks_left.store((op.nbytes + block_ - 1) / block_ * op.finishes_per_chunk, std::memory_order_relaxed);
      ++active;
      (op.via_threads ? need_sync : need_async) = true;
    }
  }
  batch->ops_left.store(active, std::memory_order_relaxed);

  std::lock_guard<std::mutex> st(state_mu_);
  if (closed_) throw std::runtime_error("the I/O engine is closed; create a new one");
  if (need_sync) ensure_sync_pool();
  const uint64_t id = next_id_.fetch_add(1, std::memory_order_relaxed);
  batch->id = id;
  Batch* raw = batch.get();
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    batches_.emplace(id, std::move(batch));
  }
  if (active == 0) {
    batch_done(raw);
    return id;
  }
  // The batch cannot complete before its last queue has its ops; after
  // that push nothing here touches the batch again.
  const size_t nops = specs.size();
  Op* ops = raw->ops.get();
  for (WorkQueue* q : {&async_q_, &sync_q_}) {
    const bool sync = q == &sync_q_;
    if (!(sync ? need_sync : need_async)) continue;
    {
      std::lock_guard<std::mutex> lk(q->mu);
      for (size_t i = 0; i < nops; ++i)
        if (ops[i].nbytes && ops[i].via_threads == sync) {
          q->ops.push_back(&ops[i]);
          if (!ops[i].staged) ++q->unstaged_ops;
        }
    }
    q->cv.notify_all();
  }
  return id;
}

// --- completion -----------------------------------------------------------------

std::vector<BatchResult> Engine::poll() {
  std::vector<BatchResult> out;
  std::lock_guard<std::mutex> lk(done_mu_);
  if (efd_ >= 0) {
    // Drain before collecting: a completion racing with us signals again and
    // is picked up by the next poll, never lost.
    uint64_t value;
    if (read(efd_, &value, sizeof(value)) < 0 && errno != EAGAIN) {
      int err = errno;
      throw SysError(err, "read of the completion eventfd " + std::to_string(efd_) + " failed: " + errno_text(err));
    }
  }
  out.reserve(completed_.size());
  for (uint64_t id : completed_) {
    auto it = batches_.find(id);
    if (it == batches_.end()) continue;  // already taken by wait()
    Batch& b = *it->second;
    out.push_back(BatchResult{id, b.err, b.message});
    batches_.erase(it);
  }
  completed_.clear();
  return out;
}

WaitStatus Engine::wait(uint64_t batch_id, double timeout_s, BatchResult* out) {
  if (std::isnan(timeout_s)) throw std::invalid_argument("timeout_s is NaN");
  std::unique_lock<std::mutex> lk(done_mu_);
  if (batches_.find(batch_id) == batches_.end()) return WaitStatus::kUnknown;
  auto ready = [&] {
    auto it = batches_.find(batch_id);
    return it == batches_.end() || it->second->done;
  };
  if (timeout_s < 0 || timeout_s > 1e9) {
    done_cv_.wait(lk, ready);
  } else if (!done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready)) {
    return WaitStatus::kTimeout;
  }
  auto it = batches_.find(batch_id);
  if (it == batches_.end()) return WaitStatus::kUnknown;  // another caller reported it meanwhile
  out->id = batch_id;
  out->err = it->second->err;
  out->message = it->second->message;
  batches_.erase(it);
  // Waits usually target the oldest batches, so the search ends early.
  auto pos = std::find(completed_.begin(), completed_.end(), batch_id);
  if (pos != completed_.end()) completed_.erase(pos);
  return WaitStatus::kDone;
}

void Engine::close() {
  {
    std::unique_lock<std::mutex> st(state_mu_);
    if (closed_) {
      // Another caller is closing: return only once it is done, so that no caller takes the
      // buffers of ops still in flight for free.
      close_cv_.wait(st, [this] { return close_done_; });
      return;
    }
    closed_ = true;
  }
  cancel_queue(async_q_);
  cancel_queue(sync_q_);
  stop_threads();
  rings_.clear();
  aio_.clear();
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    if (efd_ >= 0) (void)::close(efd_);  // nothing useful to do if close() of an eventfd fails
    efd_ = -1;
  }
  {
    std::lock_guard<std::mutex> st(state_mu_);
    close_done_ = true;
  }
  close_cv_.notify_all();
}

void Engine::cancel_queue(WorkQueue& q) {
  std::deque<Op*> left;
  {
    std::lock_guard<std::mutex> lk(q.mu);
    left.swap(q.ops);
    q.unstaged_ops = 0;
    q.stopping = true;
  }
  q.cv.notify_all();
  // Workers can no longer reach these ops, so `next` is ours to read.
  for (Op* op : left) {
    const uint64_t rest_chunks = (op->nbytes - op->next + block_ - 1) / block_ * op->finishes_per_chunk;
    record_error(op, ECANCELED,
                 call_name(op) + " cancelled: fd " + std::to_string(op->fd) + ", offset " +
                     std::to_string(op->offset + op->next) + ", " + std::to_string(op->nbytes - op->next) +
                     " bytes: the engine was closed before this op ran");
    if (op->chunks_left.fetch_sub(rest_chunks, std::memory_order_acq_rel) == rest_chunks) op_done(op);
  }
}

std::string Engine::call_name(const Op* op) const {
  if (op->via_threads) return op->is_write ? "pwrite" : "pread";
  if (kind_ == Kind::kUring) return op->is_write ? "io_uring write" : "io_uring read";
  return op->is_write ? "aio write (io_submit)" : "aio read (io_submit)";
}

std::string Engine::describe(const Chunk& c) const {
  return "fd " + std::to_string(c.op->fd) + ", offset " + std::to_string(c.op->offset + c.pos + c.done) + ", " +
         std::to_string(c.len - c.done) + " bytes";
}

unsigned char* Engine::io_address(const Chunk& c) {
  return c.stage != nullptr ? c.stage + c.done : c.op->buf + c.pos + c.done;
}

unsigned char* Engine::staging_area(std::unique_ptr<AlignedBuffer>& keep, size_t slots) const noexcept {
  try {
    keep.reset(new AlignedBuffer(slots * block_ + kHugePage));
  } catch (...) {
    return nullptr;  // no memory for it: read straight into the destination
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(keep->data());
  // AlignedBuffer already asked for huge pages; only the 2 MiB-aligned part can have them.
  unsigned char* area = reinterpret_cast<unsigned char*>((start + kHugePage - 1) & ~(kHugePage - 1));
  // Fault it in now, from user space: pages first touched by a direct read's
  // pinning tend to come as 4 KiB pages, which is what staging is meant to avoid.
  if (madvise(area, slots * block_, kMadvPopulateWrite) != 0) {
    if (errno == ENOMEM) {
      keep.reset();
      return nullptr;
    }
    std::memset(area, 0, slots * block_);  // a kernel before 5.14: touch each page ourselves
  }
  return area;
}

void Engine::stage_chunk(Staging& st, Chunk& c, size_t blocks) const noexcept {
  c.stage = nullptr;
  if (!c.op->staged) return;
  if (!st.tried) {
    st.tried = true;
    unsigned char* area = staging_area(st.keep, blocks);
    for (size_t i = 0; area != nullptr && i < blocks; ++i) st.free_blocks.push_back(area + i * block_);
  }
  // take_chunks handed out no more staged chunks than there are free blocks; without
  // staging memory (mmap failed) the chunk is read straight into its destination.
  if (!st.free_blocks.empty()) {
    c.stage = st.free_blocks.back();
    st.free_blocks.pop_back();
  }
}

void Engine::fill_stage(const Chunk& c) {
  // The write goes out from contiguous memory; its CRC is taken from the source as before.
  copy_bytes(c.stage, c.op->buf + c.pos, c.len, 1);
  staged_bytes_.fetch_add(c.len, std::memory_order_relaxed);
}

void Engine::land_staged(Chunk& c) {
  Op* op = c.op;
  // When the chunk holds whole CRC blocks, check them in the staging block: that
  // reads the data into the cache once, and the copy that follows finds it there
  // and streams it to the destination without reading the destination first.
  const bool whole_blocks = op->crc != nullptr && c.pos % op->crc_block == 0 &&
                            (c.len % op->crc_block == 0 || c.pos + c.len == op->nbytes);
  if (whole_blocks) {
    for (uint64_t start = 0; start < c.len; start += op->crc_block) {
      const uint64_t n = std::min(op->crc_block, c.len - start);
      check_block(op, (c.pos + start) / op->crc_block, crc32c(c.stage + start, n));
    }
  }
  copy_bytes(op->buf + c.pos, c.stage, c.len, 1);
  staged_bytes_.fetch_add(c.len, std::memory_order_relaxed);
  if (whole_blocks)
    finish_chunk(c);
  else
    complete_chunk(c);  // its CRC blocks span other chunks: checked in the destination
}

size_t Engine::take_chunks(WorkQueue& q, Chunk* out, size_t max, size_t max_staged) {
  size_t n = 0, staged = 0;
  auto it = q.ops.begin();
  while (n < max && it != q.ops.end()) {
    Op* op = *it;
    if (op->staged && staged == max_staged) {
      // It waits for a staging block; ops queued behind it that need none go ahead.
      if (q.unstaged_ops == 0) break;
      ++it;
      continue;
    }
    if (op->staged) ++staged;
    const uint64_t len = std::min(block_, op->nbytes - op->next);
    out[n++] = Chunk{op, op->next, len, 0, 0};
    op->next += len;
    if (op->next == op->nbytes) {
      if (!op->staged) --q.unstaged_ops;
      it = q.ops.erase(it);
    }
  }
  return n;
}

Engine::Outcome Engine::on_result(Chunk& c, int64_t res) {
  if (res == -EAGAIN || res == -EINTR) {
    if (++c.retries <= kMaxRetries) return Outcome::kRetry;
    fail_chunk(c, static_cast<int>(-res), call_name(c.op) + " failed: " + describe(c) + ": " +
                                              errno_text(static_cast<int>(-res)) + ", " +
                                              std::to_string(kMaxRetries) + " times in a row");
    return Outcome::kFinished;
  }
  if (res < 0) {
    const int err = static_cast<int>(-res);
    fail_chunk(c, err, call_name(c.op) + " failed: " + describe(c) + ": " + errno_text(err));
    return Outcome::kFinished;
  }
  c.retries = 0;
  c.done += static_cast<uint64_t>(res);
  if (c.done >= c.len) {
    complete_chunk(c);
    return Outcome::kFinished;
  }
  // Short transfer: resubmit the rest, unless it made no progress or the
  // rest is no longer 4096-aligned, which for O_DIRECT means end of file.
  if (res == 0 || (c.op->direct && c.done % kDirectAlign)) {
    if (c.op->is_write)
      fail_chunk(c, EIO, call_name(c.op) + " failed: " + describe(c) + ": short write (" +
                             std::to_string(c.done) + " of " + std::to_string(c.len) + " bytes written)");
    else
      fail_chunk(c, EIO, call_name(c.op) + " failed: " + describe(c) + ": short read: the file ends " +
                             std::to_string(c.done) + " bytes into this " + std::to_string(c.len) +
                             "-byte block; it is smaller than the read expects");
    return Outcome::kFinished;
  }
  return Outcome::kRetry;
}

void Engine::complete_chunk(Chunk& c) {
  // A write's checksum comes from its buffer and was taken when it was issued.
  if (c.op->crc && !c.op->is_write) crc_account(c);
  finish_chunk(c);
}

void Engine::crc_job(Chunk& c) {
  crc_account(c);
  finish_chunk(c);
}

void Engine::crc_account(const Chunk& c) {
  Op* op = c.op;
  const uint64_t cb = op->crc_block;
  const uint64_t end = c.pos + c.len;
  for (uint64_t k = c.pos / cb; k * cb < end; ++k) {
    const uint64_t bstart = k * cb;
    const uint64_t bend = std::min(bstart + cb, op->nbytes);
    const uint64_t overlap = std::min(bend, end) - std::max(bstart, c.pos);
    // acq_rel: the last chunk of a block must see the bytes the other
    // chunks brought in (their workers released them here).
    if (op->crc_left[k].fetch_sub(overlap, std::memory_order_acq_rel) != overlap) continue;
    const uint32_t v = crc32c(op->buf + bstart, bend - bstart);
    if (op->is_write)
      op->crc[k] = v;
    else
      check_block(op, k, v);
  }
}

void Engine::check_block(Op* op, uint64_t k, uint32_t v) {
  if (v == op->crc[k]) return;
  const uint64_t bstart = k * op->crc_block;
  const uint64_t bytes = std::min(op->crc_block, op->nbytes - bstart);
  record_error(op, EBADMSG,
               "checksum mismatch: fd " + std::to_string(op->fd) + ", block at file offset " +
                   std::to_string(op->offset + bstart) + " (" + std::to_string(bytes) +
                   " bytes): expected CRC32C " + hex(op->crc[k]) + ", the data read has " + hex(v));
}

void Engine::fail_chunk(Chunk& c, int err, const std::string& why) {
  record_error(c.op, err, why);
  finish_chunk(c);
}

void Engine::record_error(Op* op, int err, const std::string& message) {
  Batch* b = op->batch;
  {
    std::lock_guard<std::mutex> lk(b->err_mu);
    if (op->index < b->err_index) {
      b->err_index = op->index;
      b->err = err;
      b->message = "op " + std::to_string(op->index) + ": " + message;
    }
  }
  b->failed.store(true, std::memory_order_release);
}

void Engine::finish_chunk(Chunk& c, uint32_t times) {
  Op* op = c.op;
  // After this decrement another worker may retire the op and free the
  // batch, so nothing here touches `op` afterwards unless it was the last.
  if (op->chunks_left.fetch_sub(times, std::memory_order_acq_rel) == times) op_done(op);
}

void Engine::skip_chunk(Chunk& c) { finish_chunk(c, c.op->finishes_per_chunk); }

void Engine::op_done(Op* op) {
  Batch* b = op->batch;
  if (b->ops_left.fetch_sub(1, std::memory_order_acq_rel) == 1) batch_done(b);
}

void Engine::batch_done(Batch* b) {
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    b->done = true;
    completed_.push_back(b->id);
    if (efd_ >= 0) {
      const uint64_t one = 1;
      // EAGAIN means the counter is saturated, which is still "readable".
      while (write(efd_, &one, sizeof(one)) < 0 && errno == EINTR) {
      }
    }
  }
  done_cv_.notify_all();
}

// --- workers ------------------------------------------------------------------

void Engine::publish_crc(WorkQueue& q, std::vector<Chunk>& local) {
  // Called with q.mu held. What does not fit stays with its worker.
  const size_t cap = q.crc_ring.size();
  size_t kept = 0;
  for (Chunk& c : local) {
    if (q.crc_count < cap) {
      q.crc_ring[(q.crc_head + q.crc_count) % cap] = c;
      ++q.crc_count;
    } else {
      local[kept++] = c;
    }
  }
  local.resize(kept);
  q.crc_pending.store(q.crc_count, std::memory_order_relaxed);
}

void Engine::run_crc_jobs(WorkQueue& q, std::vector<Chunk>& local) {
  if (!local.empty()) {
    // Offer the jobs to idle workers first; the disk's queue is already full.
    {
      std::lock_guard<std::mutex> lk(q.mu);
      publish_crc(q, local);
    }
    q.cv.notify_all();
  }
  for (Chunk& c : local) crc_job(c);
  local.clear();
  for (;;) {
    Chunk c;
    {
      std::lock_guard<std::mutex> lk(q.mu);
      if (q.crc_count == 0) return;
      c = q.crc_ring[q.crc_head];
      q.crc_head = (q.crc_head + 1) % q.crc_ring.size();
      --q.crc_count;
      q.crc_pending.store(q.crc_count, std::memory_order_relaxed);
    }
    crc_job(c);
  }
}

// Both async workers run the same round: take chunks for the free slots, issue
// them (and any resubmissions), then do checksum work while the disk works:
// CRCs of the writes just issued and of reads that completed last round, plus
// jobs other workers offered. Only then wait for completions, which makes
// reads that need verifying into jobs for the next round.

void Engine::uring_worker(size_t index) {
  name_thread(("inf-uring-" + std::to_string(index)).c_str());
  UringRing& ring = *rings_[index];
  WorkQueue& q = async_q_;
  const size_t qd = static_cast<size_t>(queue_depth_);
  std::vector<Chunk> slots(qd), grabbed(qd), jobs;
  std::vector<uint32_t> free_slots, retry, landing;
  Staging staging;
  jobs.reserve(2 * qd);
  retry.reserve(qd);
  landing.reserve(qd);
  free_slots.reserve(qd);
  for (size_t i = qd; i-- > 0;) free_slots.push_back(static_cast<uint32_t>(i));
  size_t busy = 0;
  auto release = [&](uint32_t s) {
    if (slots[s].stage != nullptr) {
      staging.free_blocks.push_back(slots[s].stage);
      slots[s].stage = nullptr;
    }
    free_slots.push_back(s);
    --busy;
  };
  auto queue = [&](uint32_t s) {
    Chunk& c = slots[s];
    // The ring has at least queue_depth entries and each slot holds at most
    // one of them, so this cannot fail; if it ever did, fail loudly.
    if (!ring.queue_rw(c.op->is_write, c.op->fd, io_address(c), static_cast<uint32_t>(c.len - c.done),
                       c.op->offset + c.pos + c.done, s)) {
      fail_chunk(c, EOVERFLOW, "io_uring submission ring full (internal error): " + describe(c));
      release(s);
    }
  };
  for (;;) {
    size_t n = 0;
    {
      std::unique_lock<std::mutex> lk(q.mu);
      if (busy == 0 && jobs.empty()) {
        q.cv.wait(lk, [&] { return !q.ops.empty() || q.crc_count || q.stopping; });
        if (q.ops.empty() && q.crc_count == 0) break;
      }
      n = take_chunks(q, grabbed.data(), free_slots.size(), staging.room(staging_blocks_));
    }
    for (size_t i = 0; i < n; ++i) {
      Chunk& c = grabbed[i];
      if (c.op->batch->failed.load(std::memory_order_acquire)) {
        skip_chunk(c);  // the batch already failed: skip the I/O
        continue;
      }
      const uint32_t s = free_slots.back();
      free_slots.pop_back();
      stage_chunk(staging, c, staging_blocks_);
      if (c.stage != nullptr && c.op->is_write) fill_stage(c);
      slots[s] = c;
      ++busy;
      queue(s);
      if (c.op->crc && c.op->is_write) jobs.push_back(c);
    }
    for (uint32_t s : retry) queue(s);
    retry.clear();

    int r = 0;
    if (!jobs.empty() || !landing.empty() || q.crc_pending.load(std::memory_order_relaxed)) {
      if (ring.unsubmitted()) r = ring.submit_and_wait(0);
      for (uint32_t s : landing) {
        land_staged(slots[s]);
        release(s);
      }
      landing.clear();
      run_crc_jobs(q, jobs);
    } else if (busy) {
      r = ring.submit_and_wait(1);
    }
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
      const int err = -r;
      ring.drop_unsubmitted([&](uint64_t ud) {
        const uint32_t s = static_cast<uint32_t>(ud);
        fail_chunk(slots[s], err, "io_uring_enter failed: " + describe(slots[s]) + ": " + errno_text(err));
        release(s);
      });
    }
    const unsigned reaped = ring.reap([&](uint64_t ud, int res) {
      const uint32_t s = static_cast<uint32_t>(ud);
      Chunk& c = slots[s];
      if (res > 0 && c.stage != nullptr && !c.op->is_write && c.done + static_cast<uint64_t>(res) == c.len) {
        c.done = c.len;
        landing.push_back(s);  // copied out next round, after the free slots are refilled
        return;
      }
      if (res > 0 && c.op->crc && !c.op->is_write && c.done + static_cast<uint64_t>(res) == c.len) {
        c.done = c.len;
        jobs.push_back(c);  // verify next round, after the slot is refilled
        release(s);
        return;
      }
      if (on_result(c, res) == Outcome::kRetry)
        retry.push_back(s);
      else
        release(s);
    });
    if ((r == -EAGAIN || r == -EBUSY) && reaped == 0) backoff();
  }
}

void Engine::aio_worker(size_t index) {
  name_thread(("inf-aio-" + std::to_string(index)).c_str());
  AioContext& ctx = *aio_[index];
  WorkQueue& q = async_q_;
  const size_t qd = static_cast<size_t>(queue_depth_);
  std::vector<Chunk> slots(qd), grabbed(qd), jobs;
  std::vector<iocb> iocbs(qd);
  std::vector<iocb*> pending;  // prepared, not yet accepted by io_submit
  std::vector<io_event> events(qd);
  std::vector<uint32_t> free_slots, landing;
  Staging staging;
  jobs.reserve(2 * qd);
  pending.reserve(qd);
  landing.reserve(qd);
  free_slots.reserve(qd);
  for (size_t i = qd; i-- > 0;) free_slots.push_back(static_cast<uint32_t>(i));
  size_t busy = 0, in_kernel = 0;
  auto prepare = [&](uint32_t s) {
    Chunk& c = slots[s];
    iocb& cb = iocbs[s];
    std::memset(&cb, 0, sizeof(cb));
    cb.aio_data = s;
    cb.aio_lio_opcode = c.op->is_write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb.aio_fildes = static_cast<uint32_t>(c.op->fd);
    cb.aio_buf = reinterpret_cast<uint64_t>(io_address(c));
    cb.aio_nbytes = c.len - c.done;
    cb.aio_offset = static_cast<int64_t>(c.op->offset + c.pos + c.done);
    pending.push_back(&cb);
  };
  auto release = [&](uint32_t s) {
    if (slots[s].stage != nullptr) {
      staging.free_blocks.push_back(slots[s].stage);
      slots[s].stage = nullptr;
    }
    free_slots.push_back(s);
    --busy;
  };
  for (;;) {
    size_t n = 0;
    {
      std::unique_lock<std::mutex> lk(q.mu);
      if (busy == 0 && jobs.empty()) {
        q.cv.wait(lk, [&] { return !q.ops.empty() || q.crc_count || q.stopping; });
        if (q.ops.empty() && q.crc_count == 0) break;
      }
      n = take_chunks(q, grabbed.data(), free_slots.size(), staging.room(staging_blocks_));
    }
    for (size_t i = 0; i < n; ++i) {
      Chunk& c = grabbed[i];
      if (c.op->batch->failed.load(std::memory_order_acquire)) {
        skip_chunk(c);
        continue;
      }
      const uint32_t s = free_slots.back();
      free_slots.pop_back();
      stage_chunk(staging, c, staging_blocks_);
      if (c.stage != nullptr && c.op->is_write) fill_stage(c);
      slots[s] = c;
      ++busy;
      prepare(s);
      if (c.op->crc && c.op->is_write) jobs.push_back(c);
    }

    // io_submit takes a prefix of the array and reports an error only when
    // it could not take the first iocb, so walk past refused ones.
    size_t first = 0;
    bool shortage = false;
    while (first < pending.size()) {
      const int r = ctx.submit(static_cast<long>(pending.size() - first), pending.data() + first);
      if (r > 0) {
        first += static_cast<size_t>(r);
        in_kernel += static_cast<size_t>(r);
      } else if (r == -EINTR) {
        continue;
      } else if (r == -EAGAIN || r == 0) {
        shortage = true;
        break;
      } else {
        const uint32_t s = static_cast<uint32_t>(pending[first]->aio_data);
        fail_chunk(slots[s], -r, call_name(slots[s].op) + " failed: " + describe(slots[s]) + ": " + errno_text(-r));
        release(s);
        ++first;
      }
    }
    pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(first));
    if (shortage && in_kernel == 0) {
      // Nothing of ours will complete and free kernel resources: back off,
      // and turn a lasting shortage into an error through the retry limit.
      size_t keep = 0;
      for (iocb* cb : pending) {
        const uint32_t s = static_cast<uint32_t>(cb->aio_data);
        Chunk& c = slots[s];
        if (++c.retries > kMaxRetries) {
          fail_chunk(c, EAGAIN, call_name(c.op) + " failed: " + describe(c) +
                                    ": io_submit kept returning EAGAIN (the kernel's AIO resources are used up); "
                                    "raise fs.aio-max-nr or lower io.queue_depth");
          release(s);
        } else {
          pending[keep++] = cb;
        }
      }
      pending.resize(keep);
      backoff();
    }

    if (!landing.empty()) {
      for (uint32_t s : landing) {
        land_staged(slots[s]);
        release(s);
      }
      landing.clear();
    }
    if (!jobs.empty() || q.crc_pending.load(std::memory_order_relaxed)) run_crc_jobs(q, jobs);
    if (in_kernel == 0) continue;

    const int got = ctx.getevents(1, static_cast<long>(qd), events.data(), nullptr);
    if (got == -EINTR) continue;
    if (got < 0) {
      // Only a bad context or pointer gets here. The requests still belong
      // to the kernel and may write into their buffers, so the slots cannot
      // be given back; keep asking, slowly.
      backoff();
      continue;
    }
    for (int i = 0; i < got; ++i) {
      const io_event& ev = events[static_cast<size_t>(i)];
      const uint32_t s = static_cast<uint32_t>(ev.data);
      Chunk& c = slots[s];
      --in_kernel;
      if (ev.res > 0 && c.stage != nullptr && !c.op->is_write && c.done + static_cast<uint64_t>(ev.res) == c.len) {
        c.done = c.len;
        landing.push_back(s);
        continue;
      }
      if (ev.res > 0 && c.op->crc && !c.op->is_write && c.done + static_cast<uint64_t>(ev.res) == c.len) {
        c.done = c.len;
        jobs.push_back(c);
        release(s);
        continue;
      }
      if (on_result(c, ev.res) == Outcome::kRetry)
        prepare(s);
      else
        release(s);
    }
  }
}

void Engine::sync_worker() {
  name_thread("inf-pio");
  Staging staging;
  for (;;) {
    Chunk c;
    {
      std::unique_lock<std::mutex> lk(sync_q_.mu);
      sync_q_.cv.wait(lk, [&] { return !sync_q_.ops.empty() || sync_q_.stopping; });
      if (sync_q_.ops.empty()) break;
      take_chunks(sync_q_, &c, 1, 1);
    }
    Op* op = c.op;
    if (op->batch->failed.load(std::memory_order_acquire)) {
      skip_chunk(c);
      continue;
    }
    if (op->crc && op->is_write) crc_job(c);
    stage_chunk(staging, c, 1);  // one chunk at a time: one block
    if (c.stage != nullptr && op->is_write) fill_stage(c);
    unsigned char* const block = c.stage;
    for (;;) {
      const size_t want = static_cast<size_t>(c.len - c.done);
      const off_t off = static_cast<off_t>(op->offset + c.pos + c.done);
      unsigned char* at = io_address(c);
      const ssize_t r = op->is_write ? pwrite(op->fd, at, want, off) : pread(op->fd, at, want, off);
      if (r > 0 && c.stage != nullptr && !op->is_write && c.done + static_cast<uint64_t>(r) == c.len) {
        c.done = c.len;
        land_staged(c);
        break;
      }
      if (on_result(c, r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r)) == Outcome::kFinished) break;
    }
    if (block != nullptr) staging.free_blocks.push_back(block);
  }
}

}  // namespace infinity
