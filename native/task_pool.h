// The task pool: a fixed set of native threads that runs compute beside the
// data (copies, checksums, fills, Adam steps) without the GIL,
// and reports each finished task through an eventfd, as the I/O engine
// reports batches, so the daemon's loop polls both the same way. No Python here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine.h"  // WaitStatus

namespace infinity {

// One kind of work. The pool knows nothing of kinds: a task says how many
// independent chunks it has and runs one when asked, from any pool thread
// (several at once, each with its own index). A new kind (an Adam step over
// parameter, gradient and moment buffers) is one more subclass; the pool and
// its completion reporting stay as they are.
class Task {
 public:
  virtual ~Task() = default;
  // At least 1; fixed for the task's life.
  virtual size_t chunks() const noexcept = 0;
  // Runs chunk `index`. Returns 0, or a positive errno with *message saying
  // what failed (the failure of the task's lowest-numbered failed chunk is the
  // one reported, whichever thread met it first). An exception
  // fails the task too, never the process: ENOMEM for std::bad_alloc, EINVAL
  // for std::invalid_argument, EIO for anything else, with what() as message.
  virtual int run_chunk(size_t index, std::string* message) = 0;
};

struct TaskResult {
  uint64_t id = 0;
  int err = 0;  // 0, or the positive errno of the task's lowest-numbered failed chunk
  std::string message;
};

namespace detail {
struct PoolTask;
}

class TaskPool {
 public:
  // Starts num_threads threads (1..1024), named thread_name + their index
  // (as `top -H` shows them; up to 15 characters); throws std::invalid_argument
  // for a bad count and SysError when the eventfd or a thread cannot be had.
  explicit TaskPool(int num_threads, const std::string& thread_name = "infinity-task");
  ~TaskPool();
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;

  int num_threads() const noexcept { return num_threads_; }
  // Readable once a task has completed; poll() clears it. -1 after close().
  int completion_fd() const;

  // Queues the task and returns its id at once. Throws std::runtime_error
  // when the pool is closed.
  uint64_t submit(std::unique_ptr<Task> task);
  // Runs the task to the end on the pool and on this thread together, and
  // returns its outcome; nothing is reported through completion_fd. Used by
  // copy_bytes, whose callers wait anyway. On a closed pool it runs here alone.
  TaskResult run(Task& task);
  // Completed tasks not yet reported; never blocks. Drains completion_fd.
  std::vector<TaskResult> poll();
  // timeout_s < 0: no limit. kUnknown: no such task, or already reported.
  WaitStatus wait(uint64_t task_id, double timeout_s, TaskResult* out);
  // Cancels chunks that have not started (the task then fails with
  // ECANCELED), waits for the chunks in flight, joins the threads.
  // Idempotent; poll() and wait() keep working after it.
  void close();

 private:
  void worker(size_t index);
  // Takes the next chunk of the front task; false when the queue is empty.
  bool take(detail::PoolTask** task, size_t* index);
  void run_one(detail::PoolTask* task, size_t index);
  void chunk_done(detail::PoolTask* task, size_t count);
  void task_done(detail::PoolTask* task);

  const int num_threads_;
  const std::string thread_name_;
  std::vector<std::thread> threads_;

  std::mutex queue_mu_;  // queue_, stopping_, closed_
  std::condition_variable queue_cv_;
  std::deque<detail::PoolTask*> queue_;  // tasks with chunks not yet taken
  bool stopping_ = false;

  std::mutex close_mu_;
  bool closed_ = false;

  std::mutex done_mu_;  // tasks_, completed_, PoolTask::done, efd_
  std::condition_variable done_cv_;
  std::unordered_map<uint64_t, std::unique_ptr<detail::PoolTask>> tasks_;
  std::deque<uint64_t> completed_;
  int efd_ = -1;
  std::atomic<uint64_t> next_id_{1};
};

// The process-wide pool that copy_bytes splits large copies across: made on
// first use with as many threads as there are cores (at most 64), never
// destroyed. Null when it cannot be made (no threads to be had); a forked
// child gets a pool of its own, since the parent's threads are not there.
TaskPool* shared_task_pool() noexcept;

}  // namespace infinity
