// The asynchronous I/O engine: batches of reads and writes on raw buffers,
// split into blocks and carried out by worker threads over io_uring, kernel
// AIO or pread/pwrite, with optional CRC32C per block. No Python in here.
#pragma once

#include <atomic>
#include <cstddef>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace infinity {

class AlignedBuffer;
class UringRing;
class AioContext;

struct OpSpec {
  bool is_write = false;
  int64_t fd = -1;
  uint64_t buf_addr = 0;
  int64_t nbytes = 0;
  int64_t file_offset = 0;
  bool direct = true;
  uint64_t crc_addr = 0;  // 0: no checksums
  int64_t crc_block_bytes = 0;
  // O_DIRECT ops only: move each block through the worker's staging area
  // (anonymous memory on huge pages): a read lands there and is copied to
  // buf_addr, a write is copied there from buf_addr and goes out from there. A
  // virtual disk serves transfers to and from scattered 4 KiB pages (a
  // shared-memory tier without huge pages) at a third to four-fifths of its speed
  // with contiguous memory; the copy costs a fraction of that.
  bool staged = false;
};

struct BatchResult {
  uint64_t id = 0;
  int err = 0;  // 0, or the positive errno of the batch's first failed op
  std::string message;
};

enum class WaitStatus { kDone, kTimeout, kUnknown };

namespace detail {
struct Op;
struct Batch;

struct Chunk {
  Op* op = nullptr;
  uint64_t pos = 0;   // from the start of the op
  uint64_t len = 0;
  uint64_t done = 0;  // bytes already transferred (short transfers resume here)
  uint32_t retries = 0;
  unsigned char* stage = nullptr;  // the staging slot a staged read lands in, else null
};

struct WorkQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Op*> ops;  // ops with bytes not yet handed to a worker
  size_t unstaged_ops = 0;  // of those, the ones that need no staging block
  // Chunks whose data has arrived and whose CRC block is due, for any idle
  // worker to take: the disk tends to complete a deep queue in bursts that
  // belong to one worker. A fixed ring, so no allocation per chunk.
  std::vector<Chunk> crc_ring;
  size_t crc_head = 0;
  size_t crc_count = 0;
  std::atomic<size_t> crc_pending{0};  // crc_count, readable without the lock
  bool stopping = false;
};
}  // namespace detail

class Engine {
 public:
  // backend: "auto" | "io_uring" | "aio" | "threads". Throws
  // std::invalid_argument for bad arguments and std::runtime_error when a
  // named backend cannot be used here (the message says why).
  // staging_bytes: each worker's staging memory for staged reads (rounded down
  // to whole blocks, at least one); it also caps that worker's staged reads in
  // flight. Kept small so the staged data is still in the last-level cache when
  // it is checked and copied out.
  Engine(int num_threads, int queue_depth, int64_t block_size_bytes, const std::string& backend,
         int64_t staging_bytes = 4 << 20);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::string& backend() const noexcept { return backend_; }
  // Why "auto" did not pick io_uring (empty when it did or was not asked).
  const std::string& backend_note() const noexcept { return backend_note_; }
  int completion_fd() const;
  // Bytes that staged ops moved through the staging memory so far (not counting
  // those that fell back to a direct transfer for want of that memory).
  uint64_t staged_bytes() const noexcept { return staged_bytes_.load(std::memory_order_relaxed); }

  // Validates every op first (std::invalid_argument / AlignmentViolation),
  // then queues them all and returns the batch id at once.
  uint64_t submit(const std::vector<OpSpec>& ops);
  // Completed batches not yet reported; never blocks. Drains completion_fd.
  std::vector<BatchResult> poll();
  // timeout_s < 0: no limit. kUnknown: no such batch, or already reported.
  WaitStatus wait(uint64_t batch_id, double timeout_s, BatchResult* out);
  // Cancels ops that have not started (ECANCELED), waits for those in flight,
  // stops the threads. Idempotent; poll() and wait() keep working after it.
  void close();

 private:
  enum class Kind { kUring, kAio, kThreads };
  enum class Outcome { kRetry, kFinished };

  std::string try_uring();
  std::string try_aio();
  void start_async_threads();
  void ensure_sync_pool();
  void stop_threads() noexcept;
  // The staging memory of one worker: `slots` blocks, 2 MiB-aligned so the
  // kernel can back it with huge pages. Null when mmap fails (the worker then
  // reads straight into the destination, which is correct, only slower).
  unsigned char* staging_area(std::unique_ptr<AlignedBuffer>& keep, size_t slots) const noexcept;
  // A worker's staging blocks, allocated on its first staged chunk.
  struct Staging {
    std::unique_ptr<AlignedBuffer> keep;
    std::vector<unsigned char*> free_blocks;
    bool tried = false;
    // How many staged chunks may be taken now: all blocks before the first
    // (allocation is lazy), any number when there is no staging memory.
    size_t room(size_t blocks) const noexcept {
      return !tried ? blocks : keep != nullptr ? free_blocks.size() : SIZE_MAX;
    }
  };
  void stage_chunk(Staging& st, detail::Chunk& c, size_t blocks) const noexcept;
  void land_staged(detail::Chunk& c);
  void fill_stage(const detail::Chunk& c);

  static unsigned char* io_address(const detail::Chunk& c);

  void uring_worker(size_t index);
  void aio_worker(size_t index);
  void sync_worker();

  // Up to `max` chunks, of which at most `max_staged` of staged ops.
  size_t take_chunks(detail::WorkQueue& q, detail::Chunk* out, size_t max, size_t max_staged);
  Outcome on_result(detail::Chunk& c, int64_t res);
  void complete_chunk(detail::Chunk& c);
  void crc_account(const detail::Chunk& c);
  void check_block(detail::Op* op, uint64_t k, uint32_t v);
  void crc_job(detail::Chunk& c);
  void skip_chunk(detail::Chunk& c);
  void publish_crc(detail::WorkQueue& q, std::vector<detail::Chunk>& local);
  void run_crc_jobs(detail::WorkQueue& q, std::vector<detail::Chunk>& local);
  void fail_chunk(detail::Chunk& c, int err, const std::string& why);
  void finish_chunk(detail::Chunk& c, uint32_t times = 1);
  void op_done(detail::Op* op);
  void batch_done(detail::Batch* b);
  void record_error(detail::Op* op, int err, const std::string& message);
  void cancel_queue(detail::WorkQueue& q);
  std::string call_name(const detail::Op* op) const;
  std::string describe(const detail::Chunk& c) const;

  const int num_threads_;
  const int queue_depth_;
  const uint64_t block_;
  const size_t staging_blocks_;
  std::string backend_;
  std::string backend_note_;
  Kind kind_ = Kind::kThreads;

  std::vector<std::unique_ptr<UringRing>> rings_;
  std::vector<std::unique_ptr<AioContext>> aio_;
  detail::WorkQueue async_q_;  // O_DIRECT ops for the io_uring / aio workers
  detail::WorkQueue sync_q_;   // pread/pwrite ops
  std::vector<std::thread> async_threads_;
  std::vector<std::thread> sync_threads_;

  std::mutex state_mu_;  // closed_, close_done_, starting the sync pool, enqueueing
  bool closed_ = false;
  bool close_done_ = false;  // the first close() finished; later callers wait for it
  std::condition_variable close_cv_;
  bool sync_started_ = false;

  std::mutex done_mu_;  // batches_, completed_, Batch::done, efd_
  std::condition_variable done_cv_;
  std::unordered_map<uint64_t, std::unique_ptr<detail::Batch>> batches_;
  std::deque<uint64_t> completed_;
  int efd_ = -1;
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> staged_bytes_{0};
};

}  // namespace infinity
