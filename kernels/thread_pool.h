#pragma once
// A fixed set of worker threads for the CPU kernels of one device context. The caller of
// parallel_for works too, so a pool of n threads starts n - 1 workers, and a pool of one
// thread runs everything inline. Kernels split their work into tasks whose boundaries depend
// on the problem's shape only, never on the thread count, so every thread count gives the
// same bits. One caller at a time (one rank, one thread); tasks must not call back into it.
// Between jobs the workers, and the caller waiting for them, spin for a short while before
// they sleep: a training step runs thousands of jobs a few microseconds apart, and a wake-up
// through the kernel costs about as much as a small job.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace conveyor::kernels::cpu {

class ThreadPool {
 public:
  // threads >= 1, the caller included. Throws std::runtime_error when the system refuses a
  // thread, with the ones started already ended.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs f(0) … f(tasks - 1), each once, across the pool; returns when all are done and
  // rethrows the first exception a task threw.
  template <class F>
  void parallel_for(int64_t tasks, F&& f) {
    if (tasks <= 0) return;
    if (tasks == 1 || workers_.empty()) {
      for (int64_t i = 0; i < tasks; ++i) f(i);
      return;
    }
    // A plain function pointer and context instead of std::function: no allocation per call.
    using Fn = std::remove_reference_t<F>;
    run(
        tasks, [](void* context, int64_t i) { (*static_cast<Fn*>(context))(i); },
        const_cast<void*>(static_cast<const void*>(&f)));
  }

 private:
  using TaskFn = void (*)(void*, int64_t);
  void run(int64_t tasks, TaskFn fn, void* context);
  void work();          // takes tasks of the current job until none are left
  void loop();          // a worker's life
  void stop_workers();  // asks every worker to end and joins it

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;  // workers asleep until the next job
  std::condition_variable done_;  // the caller asleep until the last worker is done
  // Bumped per job under mutex_, read by spinning workers without it.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> busy_workers_{0};  // workers still inside the current job
  std::atomic<bool> stop_{false};     // set under mutex_
  int sleeping_workers_ = 0;          // under mutex_
  bool caller_sleeping_ = false;      // under mutex_
  TaskFn fn_ = nullptr;
  void* context_ = nullptr;
  int64_t tasks_ = 0;
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_;  // the first task failure, under mutex_
};

// parallel_for on `pool`, or inline where there is none.
template <class F>
void parallel_for(ThreadPool* pool, int64_t tasks, F&& f) {
  if (pool != nullptr) {
    pool->parallel_for(tasks, f);
    return;
  }
  for (int64_t i = 0; i < tasks; ++i) f(i);
}

}  // namespace conveyor::kernels::cpu
