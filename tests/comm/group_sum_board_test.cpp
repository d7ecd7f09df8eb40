// The in-process group sum's shared board: the bits are those of adding every member's values
// in group order from zero, on any size and group; the sum is made once for all members (one
// member's test sums it, and the others only copy it); a member that waits finishes without
// the others' help; an abort wakes a waiter; parts whose counts differ fail, even empty ones.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <numeric>
#include <thread>

#include "comm/in_process.h"
#include "support/test_util.h"

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;

// Element k of the group sum as every transport defines it: 0.0f + v0[k] + v1[k] + ...
std::vector<float> reference_sum(const std::vector<std::vector<float>>& inputs) {
  std::vector<float> out(inputs.empty() ? 0 : inputs[0].size());
  for (size_t k = 0; k < out.size(); ++k) {
    float sum = 0.0f;
    for (const auto& part : inputs) sum += part[k];
    out[k] = sum;
  }
  return out;
}

TEST(GroupSumBoard, BitsAreTheGroupOrderSumOnAwkwardSizes) {
  int seed = 500;
  for (int members : {1, 2, 3, 5, 8}) {
    std::vector<size_t> sizes{0, 1, 7, 1009};
    if (members > 2) sizes.push_back(static_cast<size_t>(members - 1));  // an empty range
    for (size_t size : sizes) {
      SCOPED_TRACE(std::to_string(members) + " members, " + std::to_string(size) + " values");
      // The group skips rank 0, so positions and ranks differ.
      std::vector<int> group(members);
      std::iota(group.begin(), group.end(), 1);
      auto hub = InProcessHub::create(members + 1, 20000ms);
      std::vector<std::vector<float>> inputs, outputs(members);
      for (int i = 0; i < members; ++i) {
        inputs.push_back(testing::random_floats(size, seed++, -1e6f, 1e6f));
        if (size > 0) inputs.back()[0] = -0.0f;  // from zero, -0.0 sums to +0.0
      }
      std::vector<std::thread> threads;
      for (int i = 0; i < members; ++i)
        threads.emplace_back([&, i] {
          auto t = hub->endpoint(group[i]);
          std::this_thread::sleep_for(std::chrono::milliseconds((i * 7) % 5));
          outputs[i] = inputs[i];
          auto pending = t->start_group_sum(outputs[i], group);
          pending->wait();
        });
      for (auto& t : threads) t.join();
      const std::vector<float> want = reference_sum(inputs);
      for (int i = 0; i < members; ++i) {
        ASSERT_EQ(outputs[i].size(), size);
        EXPECT_EQ(std::memcmp(outputs[i].data(), want.data(), size * sizeof(float)), 0)
            << "member " << i;
      }
      if (size > 0) EXPECT_FALSE(std::signbit(outputs[0][0]));
      EXPECT_EQ(hub->group_posts_held(), 0u);
    }
  }
}

// Once every member has given its values, one member's test sums all of them: the hub holds
// none of them any more before the others test, and their tests only copy the sum. (Were
// each member to add every member's values itself, each would keep the others' values until
// its own test.)
TEST(GroupSumBoard, OneMembersTestSumsForAllAndTheOthersCopy) {
  auto hub = InProcessHub::create(3, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1), c = hub->endpoint(2);
  const std::vector<int> group{0, 1, 2};
  std::vector<std::vector<float>> inputs;
  for (int i = 0; i < 3; ++i) inputs.push_back(testing::random_floats(1000, 80 + i, -1.0f, 1.0f));
  std::vector<float> av = inputs[0], bv = inputs[1], cv = inputs[2];
  auto pa = a->start_group_sum(av, group);
  auto pb = b->start_group_sum(bv, group);
  auto pc = c->start_group_sum(cv, group);
  EXPECT_EQ(hub->group_posts_held(), 3u);
  EXPECT_TRUE(pb->test());
  EXPECT_EQ(hub->group_posts_held(), 0u);
  EXPECT_TRUE(pc->test());
  EXPECT_TRUE(pa->test());
  const std::vector<float> want = reference_sum(inputs);
  for (const auto* v : {&av, &bv, &cv})
    EXPECT_EQ(std::memcmp(v->data(), want.data(), want.size() * sizeof(float)), 0);
}

// Each step sums the same gradients again: the copies and the sum of one call serve the next,
// and what the hub keeps stays what one call held at once (three copies and the sum), with
// the bits right every time.
TEST(GroupSumBoard, ACallsBuffersServeTheNextAndNoMoreAreKept) {
  auto hub = InProcessHub::create(3, 5000ms);
  std::vector<std::unique_ptr<Transport>> ends;
  for (int r = 0; r < 3; ++r) ends.push_back(hub->endpoint(r));
  const std::vector<int> group{0, 1, 2};
  EXPECT_EQ(hub->group_sum_floats_kept(), 0u);
  int seed = 90;
  for (size_t size : {1000, 1000, 600, 100, 1000}) {
    SCOPED_TRACE(std::to_string(size) + " values");
    std::vector<std::vector<float>> inputs, outputs;
    for (int i = 0; i < 3; ++i) inputs.push_back(testing::random_floats(size, seed++, -1.0f, 1.0f));
    outputs = inputs;
    std::vector<std::unique_ptr<PendingGroupCall>> calls;
    for (int i = 0; i < 3; ++i) calls.push_back(ends[i]->start_group_sum(outputs[i], group));
    for (auto& call : calls) EXPECT_TRUE(call->test());
    calls.clear();
    const std::vector<float> want = reference_sum(inputs);
    for (const auto& out : outputs)
      EXPECT_EQ(std::memcmp(out.data(), want.data(), size * sizeof(float)), 0);
    EXPECT_EQ(hub->group_sum_floats_kept(), 4000u);
  }
}

// A member that never tests does not hold the others up: a waiting member sums its range too.
TEST(GroupSumBoard, AWaiterSumsTheRangesOfMembersThatDoNotTest) {
  auto hub = InProcessHub::create(4, 5000ms);
  const std::vector<int> group{0, 1, 2, 3};
  std::vector<std::unique_ptr<Transport>> ends;
  for (int r : group) ends.push_back(hub->endpoint(r));
  std::vector<std::vector<float>> inputs, values;
  for (int i = 0; i < 4; ++i) inputs.push_back(testing::random_floats(4096, 90 + i, -1.0f, 1.0f));
  values = inputs;
  std::vector<std::unique_ptr<PendingGroupCall>> calls;
  for (int i = 0; i < 4; ++i) calls.push_back(ends[i]->start_group_sum(values[i], group));
  calls[2]->wait();  // ranks 0, 1 and 3 have not tested
  const std::vector<float> want = reference_sum(inputs);
  EXPECT_EQ(std::memcmp(values[2].data(), want.data(), want.size() * sizeof(float)), 0);
  for (int i : {0, 1, 3}) {
    EXPECT_TRUE(calls[i]->test());
    EXPECT_EQ(std::memcmp(values[i].data(), want.data(), want.size() * sizeof(float)), 0);
  }
}

TEST(GroupSumBoard, AnAbortWakesAWaiter) {
  auto hub = InProcessHub::create(2, 60000ms);
  auto a = hub->endpoint(0);
  std::vector<float> values{1, 2};
  auto pending = a->start_group_sum(values, {0, 1});  // rank 1 never comes
  std::thread aborter([&] {
    std::this_thread::sleep_for(20ms);
    hub->abort("stopped from outside");
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(pending->wait(), TransportAborted);
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 30s);
  EXPECT_EQ(values, (std::vector<float>{1, 2}));
}

// A sum of no values still waits for every member, and names the one that never comes when
// the deadline passes, instead of spinning (every range of an empty board is done at once).
TEST(GroupSumBoard, AnEmptySumWithAMissingMemberTimesOutNamingIt) {
  auto hub = InProcessHub::create(2, 200ms);
  auto a = hub->endpoint(0);
  std::vector<float> empty;
  auto pending = a->start_group_sum(empty, {0, 1});  // rank 1 never comes
  const auto start = std::chrono::steady_clock::now();
  std::clock_t cpu_start = std::clock();
  try {
    pending->wait();
    ADD_FAILURE() << "the sum finished without rank 1";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("waited 200 ms for rank(s) 1"), std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  // Waiting, not spinning: well under the 200 ms of the wait in processor time.
  EXPECT_LT(static_cast<double>(std::clock() - cpu_start) / CLOCKS_PER_SEC, 0.15);
}

// An empty part beside a non-empty one is no sum of nothing: the counts differ.
TEST(GroupSumBoard, AnEmptyPartBesideAFullOneFails) {
  auto hub = InProcessHub::create(2, 1000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> av, bv{1, 2, 3};
  auto pa = a->start_group_sum(av, {0, 1});
  auto pb = b->start_group_sum(bv, {0, 1});
  try {
    pb->wait();
    ADD_FAILURE() << "summed parts of 0 and 3 values";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("group sum of 0 values, but rank 1 gave 3"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(bv, (std::vector<float>{1, 2, 3}));
}

}  // namespace
}  // namespace conveyor::comm
