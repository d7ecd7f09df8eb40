#pragma once
// Host buffers of floats kept between calls of a transport, so that a call of megabytes does
// not map fresh pages every time: the C library hands large blocks back to the system when
// they are freed, and each new one then costs a page fault per 4 KiB (half the time of a
// 16 MiB MPI group sum at four processes on a two-core machine). What it keeps is bounded by
// the most the calls have held at once, so the pool never more than doubles their peak.
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace conveyor::comm::detail {

class FloatBufferPool {
 public:
  struct Buffer {
    std::unique_ptr<float[]> data;  // uninitialised
    size_t capacity = 0;            // floats
  };

  // A kept buffer of at least `floats` and at most twice that (the smallest such), else a
  // new one of exactly `floats`.
  Buffer take(size_t floats);
  // Keeps `buffer` for a later take(), unless that would keep more than the most the callers
  // have held at once; then it is freed.
  void give(Buffer buffer);
  // A buffer taken and never given back (left to MPI, say) stops counting as held.
  void forget(size_t capacity);

  size_t kept_floats() const { return kept_floats_; }
  size_t held_floats() const { return held_floats_; }
  size_t peak_held_floats() const { return peak_held_floats_; }

 private:
  std::multimap<size_t, std::unique_ptr<float[]>> kept_;  // by capacity
  size_t kept_floats_ = 0;
  size_t held_floats_ = 0;  // taken and not yet given back
  size_t peak_held_floats_ = 0;
};

// The same pool for callers on several threads (the ranks of one process): each take and
// give holds the pool's own lock, which never waits on another.
class LockedFloatBufferPool {
 public:
  FloatBufferPool::Buffer take(size_t floats) {
    std::lock_guard lock(mutex_);
    return pool_.take(floats);
  }
  void give(FloatBufferPool::Buffer buffer) {
    std::lock_guard lock(mutex_);
    pool_.give(std::move(buffer));
  }
  size_t kept_floats() const {
    std::lock_guard lock(mutex_);
    return pool_.kept_floats();
  }

 private:
  mutable std::mutex mutex_;
  FloatBufferPool pool_;
};

}  // namespace conveyor::comm::detail
