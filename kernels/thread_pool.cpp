#include "kernels/thread_pool.h"

#include <chrono>
#include <stdexcept>
#include <string>
#include <system_error>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace conveyor::kernels::cpu {
namespace {

// How long a thread spins for the next job (a worker) or for the job's end (the caller)
// before it sleeps. Long enough to bridge the gaps between the jobs of a step, short enough
// that an idle pool (a rank waiting for its peer, the time between steps) soon leaves the
// cores to others.
constexpr std::chrono::microseconds kSpin{50};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// True as soon as ready() is; false when kSpin passed first. Yields now and then, so that a
// spinning thread on a busy machine (more threads than cores) hands its core to one with work.
template <class F>
bool spin_until(F&& ready) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (int i = 1;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if (i % 64 == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::yield();
    }
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads) {
  if (threads < 1)
    throw std::invalid_argument("a CPU thread pool needs at least 1 thread, got " +
                                std::to_string(threads));
  workers_.reserve(static_cast<size_t>(threads - 1));
  try {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  } catch (const std::system_error& e) {
    // The system refused a thread (a process or memory limit): the ones started are stopped
    // and joined, as a running std::thread destroyed unjoined would end the process.
    const size_t started = workers_.size();
    stop_workers();
    throw std::runtime_error("cannot start CPU thread " + std::to_string(started + 2) + " of " +
                             std::to_string(threads) + ": " + e.what() +
                             "; use fewer threads or raise the process's limits");
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_.store(true, std::memory_order_release);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::work() {
  for (;;) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= tasks_) return;
    try {
      fn_(context_, i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::run(int64_t tasks, TaskFn fn, void* context) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn_ = fn;
    context_ = context;
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    busy_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    // Release: a worker that sees the new generation sees the job above.
    generation_.fetch_add(1, std::memory_order_release);
    wake = sleeping_workers_ > 0;
  }
  if (wake) wake_.notify_all();
  work();
  auto all_done = [this] { return busy_workers_.load(std::memory_order_acquire) == 0; };
  if (!spin_until(all_done)) {
    std::unique_lock<std::mutex> lock(mutex_);
    caller_sleeping_ = true;
    done_.wait(lock, all_done);
    caller_sleeping_ = false;
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::loop() {
  uint64_t seen = 0;
  auto job_or_stop = [&] {
    return stop_.load(std::memory_order_acquire) ||
           generation_.load(std::memory_order_acquire) != seen;
  };
  for (;;) {
    if (!spin_until(job_or_stop)) {
      std::unique_lock<std::mutex> lock(mutex_);
      ++sleeping_workers_;
      wake_.wait(lock, job_or_stop);
      --sleeping_workers_;
    }
    if (stop_.load(std::memory_order_acquire)) return;
    // The caller starts no job before every worker has finished this one, so the generation
    // moved by exactly one.
    seen = generation_.load(std::memory_order_acquire);
    work();
    if (busy_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      // Under the mutex: a caller about to sleep has either seen the count reach zero or
      // set caller_sleeping_ before this reads it.
      std::lock_guard<std::mutex> lock(mutex_);
      if (caller_sleeping_) done_.notify_one();
    }
  }
}

}  // namespace conveyor::kernels::cpu
