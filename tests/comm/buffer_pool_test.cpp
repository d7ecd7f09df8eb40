// The float buffers the MPI transport's group calls reuse between calls.
#include "comm/buffer_pool.h"

#include <gtest/gtest.h>

#include <utility>

namespace conveyor::comm::detail {
namespace {

TEST(FloatBufferPool, ABufferGivenBackIsTakenAgainForTheSameSize) {
  FloatBufferPool pool;
  FloatBufferPool::Buffer first = pool.take(1000);
  ASSERT_NE(first.data, nullptr);
  EXPECT_EQ(first.capacity, 1000u);
  first.data[999] = 1.0f;  // the whole capacity is there
  const float* address = first.data.get();
  pool.give(std::move(first));
  EXPECT_EQ(pool.kept_floats(), 1000u);
  const FloatBufferPool::Buffer again = pool.take(1000);
  EXPECT_EQ(again.data.get(), address);
  EXPECT_EQ(pool.kept_floats(), 0u);
}

TEST(FloatBufferPool, AKeptBufferServesUpToTwiceItsNeedAndNoMore) {
  FloatBufferPool pool;
  pool.give(pool.take(1000));
  // 500 floats may take the 1000 kept; 499 would hold more than twice its need.
  const FloatBufferPool::Buffer small = pool.take(499);
  EXPECT_EQ(small.capacity, 499u);
  EXPECT_EQ(pool.kept_floats(), 1000u);
  const FloatBufferPool::Buffer half = pool.take(500);
  EXPECT_EQ(half.capacity, 1000u);
  EXPECT_EQ(pool.kept_floats(), 0u);
  // Larger than anything kept: new.
  pool.give(pool.take(10));
  EXPECT_EQ(pool.take(11).capacity, 11u);
}

TEST(FloatBufferPool, ItKeepsNoMoreThanTheCallersHeldAtOnce) {
  FloatBufferPool pool;
  {
    FloatBufferPool::Buffer a = pool.take(100), b = pool.take(100);
    EXPECT_EQ(pool.held_floats(), 200u);
    pool.give(std::move(a));
    pool.give(std::move(b));
  }
  EXPECT_EQ(pool.peak_held_floats(), 200u);
  EXPECT_EQ(pool.kept_floats(), 200u);
  // A buffer of another size held alone: given back, it would make 210 kept, past the peak.
  pool.give(pool.take(10));
  EXPECT_EQ(pool.kept_floats(), 200u);
  EXPECT_EQ(pool.held_floats(), 0u);
}

TEST(FloatBufferPool, AForgottenBufferNoLongerCountsAsHeld) {
  FloatBufferPool pool;
  FloatBufferPool::Buffer left = pool.take(64);
  pool.forget(left.capacity);  // as the transport does for a buffer it leaves to MPI
  EXPECT_EQ(pool.held_floats(), 0u);
  EXPECT_EQ(pool.peak_held_floats(), 64u);
}

}  // namespace
}  // namespace conveyor::comm::detail
