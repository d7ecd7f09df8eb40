#include "comm/buffer_pool.h"

#include <algorithm>
#include <utility>

namespace conveyor::comm::detail {

FloatBufferPool::Buffer FloatBufferPool::take(size_t floats) {
  Buffer buffer;
  const auto found = kept_.lower_bound(floats);
  if (found != kept_.end() && found->first / 2 <= floats) {
    buffer = {std::move(found->second), found->first};
    kept_floats_ -= found->first;
    kept_.erase(found);
  } else {
    buffer = {std::make_unique_for_overwrite<float[]>(floats), floats};
  }
  held_floats_ += buffer.capacity;
  peak_held_floats_ = std::max(peak_held_floats_, held_floats_);
  return buffer;
}

void FloatBufferPool::give(Buffer buffer) {
  held_floats_ -= std::min(held_floats_, buffer.capacity);
  if (!buffer.data || kept_floats_ + buffer.capacity > peak_held_floats_) return;
  kept_floats_ += buffer.capacity;
  kept_.emplace(buffer.capacity, std::move(buffer.data));
}

void FloatBufferPool::forget(size_t capacity) { held_floats_ -= std::min(held_floats_, capacity); }

}  // namespace conveyor::comm::detail
