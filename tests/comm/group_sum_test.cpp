// The in-process group sum of data parallelism: the values of a group's members added in
// group order on every member, whatever the order of arrival; several groups at once; in
// order over repeated sums; a member that never comes is named, and a bad group is refused.
// The group gather of a sharded optimizer: each member's range, bit for bit, to every member.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "comm/in_process.h"
#include "support/test_util.h"

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;

TEST(GroupSum, EveryMemberGetsTheSumInGroupOrder) {
  constexpr int kRanks = 6;  // two groups of three: {0, 2, 4} and {1, 3, 5}
  constexpr size_t kValues = 1000;
  auto hub = InProcessHub::create(kRanks, 5000ms);
  std::vector<std::vector<float>> inputs(kRanks), outputs(kRanks);
  for (int r = 0; r < kRanks; ++r) inputs[r] = testing::random_floats(kValues, 40 + r, -1e3f, 1e3f);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      auto t = hub->endpoint(r);
      const std::vector<int> group =
          r % 2 == 0 ? std::vector<int>{0, 2, 4} : std::vector<int>{1, 3, 5};
      // Late members: the others' parts must wait for them.
      std::this_thread::sleep_for(std::chrono::milliseconds(5 * (kRanks - r)));
      std::vector<float> values = inputs[r];
      auto pending = t->start_group_sum(values, group);
      pending->wait();
      EXPECT_TRUE(pending->test());
      outputs[r] = values;
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    const int g = r % 2;
    std::vector<float> want(kValues, 0.0f);
    for (int member = g; member < kRanks; member += 2)
      for (size_t i = 0; i < kValues; ++i) want[i] += inputs[member][i];
    ASSERT_EQ(outputs[r].size(), kValues);
    EXPECT_EQ(std::memcmp(outputs[r].data(), want.data(), kValues * sizeof(float)), 0)
        << "rank " << r;
  }
}

TEST(GroupSum, RepeatedSumsStayInOrderAndTestNeverWaits) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> a1{1, 2}, a2{10, 20}, b1{3, 4}, b2{30, 40};
  auto pa1 = a->start_group_sum(a1, {0, 1});
  EXPECT_FALSE(pa1->test());  // rank 1 has not given its part
  auto pb1 = b->start_group_sum(b1, {0, 1});
  EXPECT_TRUE(pa1->test());
  auto pa2 = a->start_group_sum(a2, {0, 1});
  auto pb2 = b->start_group_sum(b2, {0, 1});
  pb1->wait();
  pb2->wait();
  pa2->wait();
  EXPECT_EQ(a1, (std::vector<float>{4, 6}));
  EXPECT_EQ(b1, (std::vector<float>{4, 6}));
  EXPECT_EQ(a2, (std::vector<float>{40, 60}));
  EXPECT_EQ(b2, (std::vector<float>{40, 60}));
}

TEST(GroupSum, AMemberThatNeverComesIsNamed) {
  auto hub = InProcessHub::create(3, 100ms);
  auto a = hub->endpoint(0);
  std::vector<float> values{1, 2, 3};
  auto pending = a->start_group_sum(values, {0, 2});
  try {
    pending->wait();
    ADD_FAILURE() << "the sum finished without rank 2";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("waited 100 ms for rank(s) 2"), std::string::npos)
        << e.what();
  }
  // The transport is aborted for everyone.
  auto b = hub->endpoint(1);
  std::vector<float> more{1};
  EXPECT_THROW(b->start_group_sum(more, {1, 2}), TransportAborted);
}

TEST(GroupSum, RefusesAGroupWithoutThisRankOrOutOfOrder) {
  auto hub = InProcessHub::create(3, 100ms);
  auto a = hub->endpoint(0);
  std::vector<float> values{1};
  EXPECT_THROW(a->start_group_sum(values, {1, 2}), TransportError);
  EXPECT_THROW(a->start_group_sum(values, {2, 0}), TransportError);
  EXPECT_THROW(a->start_group_sum(values, {0, 3}), TransportError);
}

TEST(GroupSum, DifferentLengthsFail) {
  auto hub = InProcessHub::create(2, 1000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> av{1, 2}, bv{1, 2, 3};
  auto pa = a->start_group_sum(av, {0, 1});
  auto pb = b->start_group_sum(bv, {0, 1});
  EXPECT_THROW(pa->wait(), TransportError);
}

TEST(GroupGather, EveryMemberEndsWithEveryRange) {
  auto hub = InProcessHub::create(4, 5000ms);
  const std::vector<int> group{1, 3};
  const std::vector<size_t> bounds{0, 3, 5};
  auto a = hub->endpoint(1), b = hub->endpoint(3);
  // Each knows only its own range; -0.0 must keep its sign.
  std::vector<float> av{1.5f, -0.0f, 2.5f, 0, 0}, bv{0, 0, 0, -7.0f, 1e-30f};
  auto pa = a->start_group_gather(av, group, bounds);
  EXPECT_FALSE(pa->test());
  auto pb = b->start_group_gather(bv, group, bounds);
  pa->wait();
  pb->wait();
  const std::vector<float> want{1.5f, -0.0f, 2.5f, -7.0f, 1e-30f};
  EXPECT_EQ(std::memcmp(av.data(), want.data(), sizeof(float) * 5), 0);
  EXPECT_EQ(std::memcmp(bv.data(), want.data(), sizeof(float) * 5), 0);
  std::vector<float> bad(5);
  EXPECT_THROW(a->start_group_gather(bad, group, {0, 3}), TransportError);
  EXPECT_THROW(a->start_group_gather(bad, group, {0, 3, 4}), TransportError);
}

}  // namespace
}  // namespace conveyor::comm
