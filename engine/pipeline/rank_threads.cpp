#include "engine/pipeline/rank_threads.h"

#include <utility>

namespace conveyor {

RankThreads::RankThreads(int ranks) {
  for (int r = 1; r < ranks; ++r) threads_.emplace_back([this, r] { loop(r); });
}

RankThreads::~RankThreads() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  start_.notify_all();
  for (auto& t : threads_) t.join();
}

void RankThreads::run(const std::function<void(int)>& job) {
  {
    std::lock_guard lock(mutex_);
    job_ = &job;
    remaining_ = static_cast<int>(threads_.size());
    escaped_ = nullptr;
    ++generation_;
  }
  start_.notify_all();
  // Rank 0's failure waits for the others too: they still run `job`, which the caller owns.
  std::exception_ptr failure;
  try {
    job(0);
  } catch (...) {
    failure = std::current_exception();
  }
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return remaining_ == 0; });
  job_ = nullptr;
  if (!failure) failure = std::exchange(escaped_, nullptr);
  escaped_ = nullptr;
  lock.unlock();
  if (failure) std::rethrow_exception(failure);
}

void RankThreads::loop(int rank) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int)>* job = nullptr;
    {
      std::unique_lock lock(mutex_);
      start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr failure;
    try {
      (*job)(rank);
    } catch (...) {
      failure = std::current_exception();
    }
    std::lock_guard lock(mutex_);
    if (failure && !escaped_) escaped_ = std::move(failure);
    if (--remaining_ == 0) done_.notify_one();
  }
}

}  // namespace conveyor
