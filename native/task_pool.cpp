// Threading model: submit() puts a task at the back of one queue; an idle
// thread takes the next chunk index of the front task under queue_mu_ (the
// task leaves the queue once its last index is taken), so a task split into
// chunks spreads over every idle thread while the tasks behind it wait their
// turn. The thread that finishes a task's last chunk publishes the task
// under done_mu_ and signals the eventfd, exactly as the engine does for a
// batch. run() queues a task the same way and then takes that task's chunks
// on the calling thread too, so a caller that waits anyway does a share of
// the work and no thread is ever made per call.
#include "task_pool.h"

#include <cstdint>

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <new>
#include <stdexcept>
#include <system_error>

#include "errors.h"

namespace infinity {
namespace detail {

struct PoolTask {
  uint64_t id = 0;
  Task* task = nullptr;
  std::unique_ptr<Task> owned;  // null for run(), whose caller owns the task
  size_t chunks = 0;
  size_t next = 0;                  // the next chunk index to hand out (queue_mu_)
  std::atomic<size_t> remaining{0};  // chunks not finished or cancelled
  bool reported = true;             // false for run(): no eventfd, no entry in tasks_
  std::mutex err_mu;
  int err = 0;
  std::string message;
  size_t err_chunk = SIZE_MAX;  // the chunk whose failure is reported
  bool done = false;  // done_mu_

  // The failure reported is that of the lowest-numbered chunk that failed (as the engine reports
  // a batch's lowest-numbered failed op), whichever thread got there first; a failure of no
  // chunk (cancellation) counts after every chunk's.
  void fail(int e, const std::string& why, size_t chunk = SIZE_MAX) {
    std::lock_guard<std::mutex> lk(err_mu);
    if (err == 0 || chunk < err_chunk) {
      err = e;
      message = why;
      err_chunk = chunk;
    }
  }
};

}  // namespace detail

using detail::PoolTask;

TaskPool::TaskPool(int num_threads, const std::string& thread_name)
    : num_threads_(num_threads), thread_name_(thread_name) {
  if (num_threads < 1 || num_threads > 1024)
    throw std::invalid_argument("num_threads is " + std::to_string(num_threads) + "; it must be 1 to 1024");
  // Non-blocking so poll() can drain it without ever sleeping.
  efd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (efd_ < 0) {
    const int err = errno;
    throw SysError(err, "eventfd failed: " + errno_text(err) +
                            "; the process may be out of file descriptors (raise `ulimit -n`)");
  }
  try {
    threads_.reserve(static_cast<size_t>(num_threads));
    for (size_t i = 0; i < static_cast<size_t>(num_threads); ++i) threads_.emplace_back(&TaskPool::worker, this, i);
  } catch (const std::system_error& e) {
    close();
    throw SysError(e.code().value(), "could not start task-pool thread " + std::to_string(threads_.size()) +
                                         " of " + std::to_string(num_threads) + ": " + e.what() +
                                         "; ask for fewer threads or raise the process's thread limit");
  }
}

TaskPool::~TaskPool() { close(); }

int TaskPool::completion_fd() const { return efd_; }

void TaskPool::worker(size_t index) {
  const std::string name = (thread_name_ + std::to_string(index)).substr(0, 15);  // the kernel keeps 15
  (void)pthread_setname_np(pthread_self(), name.c_str());  // a name only helps debugging; failing costs nothing
  for (;;) {
    PoolTask* task = nullptr;
    size_t chunk = 0;
    {
      std::unique_lock<std::mutex> lk(queue_mu_);
      queue_cv_.wait(lk, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and close() emptied the queue
      task = queue_.front();
      chunk = task->next++;
      if (task->next == task->chunks) queue_.pop_front();
    }
    run_one(task, chunk);
  }
}

void TaskPool::run_one(PoolTask* task, size_t index) {
  std::string why;
  int err = 0;
  try {
    err = task->task->run_chunk(index, &why);
  } catch (const std::bad_alloc&) {
    err = ENOMEM;
    why = "out of memory";
  } catch (const std::invalid_argument& e) {
    err = EINVAL;
    why = e.what();
  } catch (const std::exception& e) {
    err = EIO;
    why = e.what();
  } catch (...) {
    err = EIO;
    why = "an unknown exception";
  }
  if (err != 0) {
    try {
      task->fail(err, "chunk " + std::to_string(index) + " of task " + std::to_string(task->id) + ": " + why,
                 index);
    } catch (const std::bad_alloc&) {
      task->fail(err, std::string(), index);  // the errno alone still reaches the caller
    }
  }
  chunk_done(task, 1);
}

void TaskPool::chunk_done(PoolTask* task, size_t count) {
  if (count == 0) return;
  if (task->remaining.fetch_sub(count, std::memory_order_acq_rel) == count) task_done(task);
}

void TaskPool::task_done(PoolTask* task) {
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    task->done = true;  // after this a run() caller may return and free the task: not touched again
    if (task->reported) {
      completed_.push_back(task->id);
      if (efd_ >= 0) {
        const uint64_t one = 1;
        // EAGAIN means the counter is saturated, which is still "readable"; EBADF
        // and EINVAL cannot happen on our own open eventfd with 8 bytes.
        while (write(efd_, &one, sizeof(one)) < 0 && errno == EINTR) {
        }
      }
    }
  }
  done_cv_.notify_all();
}

uint64_t TaskPool::submit(std::unique_ptr<Task> task) {
  if (!task) throw std::invalid_argument("no task to submit");
  const size_t chunks = task->chunks();
  if (chunks == 0) throw std::invalid_argument("a task must have at least one chunk");
  auto entry = std::make_unique<PoolTask>();
  PoolTask* t = entry.get();
  t->id = next_id_.fetch_add(1);
  t->task = task.get();
  t->owned = std::move(task);
  t->chunks = chunks;
  t->remaining.store(chunks);
  {
    std::lock_guard<std::mutex> lk(done_mu_);
    tasks_.emplace(t->id, std::move(entry));
  }
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    if (stopping_) {
      std::lock_guard<std::mutex> dl(done_mu_);
      tasks_.erase(t->id);
      throw std::runtime_error("the task pool is closed: make a new one");
    }
    queue_.push_back(t);
  }
  if (chunks == 1)
    queue_cv_.notify_one();
  else
    queue_cv_.notify_all();
  return t->id;
}

TaskResult TaskPool::run(Task& task) {
  PoolTask t;
  t.task = &task;
  t.chunks = task.chunks();
  t.remaining.store(t.chunks);
  t.reported = false;
  if (t.chunks == 0) return TaskResult{};
  bool queued = false;
  if (t.chunks > 1) {
    std::lock_guard<std::mutex> lk(queue_mu_);
    if (!stopping_) {
      queue_.push_back(&t);
      queued = true;
    }
  }
  if (queued) queue_cv_.notify_all();
  // Take this task's chunks here until none is left to take.
  for (;;) {
    size_t chunk;
    {
      std::lock_guard<std::mutex> lk(queue_mu_);
      if (t.next == t.chunks) break;
      chunk = t.next++;
      if (t.next == t.chunks && queued) {
        // Off the queue (close() may have taken it off already).
        auto pos = std::find(queue_.begin(), queue_.end(), &t);
        if (pos != queue_.end()) queue_.erase(pos);
      }
    }
    run_one(&t, chunk);
  }
  {
    std::unique_lock<std::mutex> lk(done_mu_);
    done_cv_.wait(lk, [&t] { return t.done; });
  }
  return TaskResult{0, t.err, t.message};
}

std::vector<TaskResult> TaskPool::poll() {
  std::vector<TaskResult> out;
  std::lock_guard<std::mutex> lk(done_mu_);
  if (efd_ >= 0) {
    // Drain before collecting: a completion racing with us signals again and
    // is picked up by the next poll, never lost.
    uint64_t value;
    if (read(efd_, &value, sizeof(value)) < 0 && errno != EAGAIN) {
      const int err = errno;
      throw SysError(err, "read of the task pool's completion eventfd " + std::to_string(efd_) +
                              " failed: " + errno_text(err));
    }
  }
  out.reserve(completed_.size());
  for (uint64_t id : completed_) {
    auto it = tasks_.find(id);
    if (it == tasks_.end()) continue;  // already taken by wait()
    out.push_back(TaskResult{id, it->second->err, it->second->message});
    tasks_.erase(it);
  }
  completed_.clear();
  return out;
}

WaitStatus TaskPool::wait(uint64_t task_id, double timeout_s, TaskResult* out) {
  if (std::isnan(timeout_s)) throw std::invalid_argument("timeout_s is NaN");
  std::unique_lock<std::mutex> lk(done_mu_);
  if (tasks_.find(task_id) == tasks_.end()) return WaitStatus::kUnknown;
  auto ready = [&] {
    auto it = tasks_.find(task_id);
    return it == tasks_.end() || it->second->done;
  };
  if (timeout_s < 0 || timeout_s > 1e9) {
    done_cv_.wait(lk, ready);
  } else if (!done_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready)) {
    return WaitStatus::kTimeout;
  }
  auto it = tasks_.find(task_id);
  if (it == tasks_.end()) return WaitStatus::kUnknown;  // another caller reported it meanwhile
  out->id = task_id;
  out->err = it->second->err;
  out->message = it->second->message;
  tasks_.erase(it);
  auto pos = std::find(completed_.begin(), completed_.end(), task_id);
  if (pos != completed_.end()) completed_.erase(pos);
  return WaitStatus::kDone;
}

void TaskPool::close() {
  // Held throughout: a second caller returns only once the first is done.
  std::lock_guard<std::mutex> cl(close_mu_);
  if (closed_) return;
  closed_ = true;
  std::vector<std::pair<PoolTask*, size_t>> cancelled;
  {
    std::lock_guard<std::mutex> lk(queue_mu_);
    stopping_ = true;
    for (PoolTask* t : queue_) {
      if (!t->reported) continue;  // a run() caller takes the rest of its chunks itself
      cancelled.emplace_back(t, t->chunks - t->next);
      t->next = t->chunks;
    }
    queue_.clear();
  }
  queue_cv_.notify_all();
  for (auto& [t, count] : cancelled) {
    t->fail(ECANCELED, "task " + std::to_string(t->id) + " was cancelled: the task pool was closed before " +
                           std::to_string(count) + " of its " + std::to_string(t->chunks) + " chunks ran");
    chunk_done(t, count);
  }
  for (auto& th : threads_)
    if (th.joinable()) th.join();
  threads_.clear();
  std::lock_guard<std::mutex> lk(done_mu_);
  if (efd_ >= 0) (void)::close(efd_);  // nothing useful to do if close() of an eventfd fails
  efd_ = -1;
}

namespace {
std::mutex g_shared_mu;
std::atomic<TaskPool*> g_shared{nullptr};
std::atomic<pid_t> g_shared_pid{0};

// Held across fork(), so that a child never inherits it locked by a thread it does not have.
void lock_shared_mu() { g_shared_mu.lock(); }
void unlock_shared_mu() { g_shared_mu.unlock(); }
// pthread_atfork fails only for want of memory; the child then merely risks what every
// process without the handler does, so the result is kept only for debuggers to see.
const int g_atfork_result = pthread_atfork(lock_shared_mu, unlock_shared_mu, unlock_shared_mu);
}  // namespace

TaskPool* shared_task_pool() noexcept {
  const pid_t pid = getpid();
  TaskPool* pool = g_shared.load(std::memory_order_acquire);
  if (pool != nullptr && g_shared_pid.load(std::memory_order_relaxed) == pid) return pool;
  std::lock_guard<std::mutex> lk(g_shared_mu);
  pool = g_shared.load(std::memory_order_acquire);
  if (pool != nullptr && g_shared_pid.load(std::memory_order_relaxed) == pid) return pool;
  // None yet, or the parent's (whose threads a forked child lacks): left alone, never freed.
  const unsigned cores = std::thread::hardware_concurrency();
  const int threads = static_cast<int>(std::min(64u, std::max(1u, cores)));
  try {
    pool = new TaskPool(threads, "infinity-copy");
  } catch (const std::exception&) {
    return nullptr;  // the caller copies on its own thread
  }
  g_shared_pid.store(pid, std::memory_order_relaxed);
  g_shared.store(pool, std::memory_order_release);
  return pool;
}

}  // namespace infinity
