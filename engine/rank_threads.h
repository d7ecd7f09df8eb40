#pragma once
// One long-lived thread per rank that runs one job per call of run(). The executor reuses
// them across steps: starting threads every step cost about 20 µs each (docs/PERF.md).
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace conveyor {

class RankThreads {
 public:
  explicit RankThreads(int count);
  ~RankThreads();  // joins the threads
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  // Runs job(rank) on every thread and returns when all have finished. The job must catch
  // its own exceptions.
  void run(const std::function<void(int)>& job);

 private:
  void loop(int rank);

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int remaining_ = 0;
  bool stopping_ = false;
};

}  // namespace conveyor
