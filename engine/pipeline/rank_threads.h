#pragma once
// Runs one job per rank per call of run(): rank 0 on the calling thread, the others on
// long-lived threads reused across steps (starting threads every step cost about 20 µs
// each, and waking one costs about as much, so rank 0 needs neither; docs/PERF.md).
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace conveyor {

class RankThreads {
 public:
  explicit RankThreads(int ranks);
  ~RankThreads();  // joins the threads
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;

  // Runs job(rank) for every rank and returns when all have finished. The job should catch
  // its own exceptions; one it lets out (of any type) is rethrown here once every rank's job
  // has finished, rank 0's first, rather than ending the process on a rank's thread.
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
  std::exception_ptr escaped_;  // the first exception a thread's job let out this run
};

}  // namespace conveyor
