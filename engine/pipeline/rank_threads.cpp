#include "engine/pipeline/rank_threads.h"

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
    ++generation_;
  }
  start_.notify_all();
  job(0);
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return remaining_ == 0; });
  job_ = nullptr;
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
    (*job)(rank);
    std::lock_guard lock(mutex_);
    if (--remaining_ == 0) done_.notify_one();
  }
}

}  // namespace conveyor
