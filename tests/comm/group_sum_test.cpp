// The in-process group sum of data parallelism: the values of a group's members added in
// group order on every member, whatever the order of arrival; several groups at once; in
// order over repeated sums; a member that never comes is named, and a bad group is refused.
// The group gather of a sharded optimizer: each member's range, bit for bit, to every member.
// The reduce-scatter of a sharded optimizer: each member's range of the group sum, bit for
// bit, whatever the order of arrival, sending only the others' ranges.
// Several group calls in flight at once: each takes its own parts, whichever is tested first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "comm/in_process.h"
#include "group_calls_in_flight.h"
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

TEST(GroupCallsInFlight, ALaterCallTestedFirstTakesItsOwnParts) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> a1{1, 2}, a2{10, 20}, b1{3, 4}, b2{30, 40};
  auto pa1 = a->start_group_sum(a1, {0, 1});
  auto pa2 = a->start_group_sum(a2, {0, 1});
  auto pb1 = b->start_group_sum(b1, {0, 1});
  auto pb2 = b->start_group_sum(b2, {0, 1});
  // Both of rank 1's parts are there: the second call must take the second.
  EXPECT_TRUE(pa2->test());
  EXPECT_EQ(a2, (std::vector<float>{40, 60}));
  EXPECT_TRUE(pa1->test());
  EXPECT_EQ(a1, (std::vector<float>{4, 6}));
  pb2->wait();
  pb1->wait();
  EXPECT_EQ(b1, (std::vector<float>{4, 6}));
  EXPECT_EQ(b2, (std::vector<float>{40, 60}));
}

TEST(GroupCallsInFlight, ACallWaitedForFirstWaitsForItsOwnPartsOnly) {
  // Rank 1 has started only the first of the two: rank 0's wait for the second must not end
  // with the first's part.
  auto hub = InProcessHub::create(2, 100ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> a1{1}, a2{2}, b1{3};
  auto pa1 = a->start_group_sum(a1, {0, 1});
  auto pa2 = a->start_group_sum(a2, {0, 1});
  auto pb1 = b->start_group_sum(b1, {0, 1});
  EXPECT_FALSE(pa2->test());
  EXPECT_THROW(pa2->wait(), TransportError);
  EXPECT_EQ(a2, (std::vector<float>{2}));
}

TEST(GroupCallsInFlight, EachCallGetsItsOwnResultWhateverTheFinishOrder) {
  const std::vector<int> group{0, 2, 3};  // rank 1 stays out
  for (int round = 0; round < testing::kFinishOrders; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    auto hub = InProcessHub::create(4, 20000ms);
    std::vector<std::thread> threads;
    for (size_t i = 0; i < group.size(); ++i)
      threads.emplace_back([&, i] {
        auto t = hub->endpoint(group[i]);
        // Members come at different times, so that parts of several calls wait in the queues.
        std::this_thread::sleep_for(std::chrono::milliseconds(5 * ((i + round) % group.size())));
        try {
          testing::run_group_calls_in_flight(
              *t, group, static_cast<testing::FinishOrder>((i + round) % testing::kFinishOrders));
        } catch (const std::exception& e) {
          ADD_FAILURE() << "rank " << group[i] << ": " << e.what();
        }
      });
    for (auto& t : threads) t.join();
    EXPECT_EQ(hub->group_bytes_sent(1), 0u);
  }
}

// A call dropped unfinished (its rank failed elsewhere) leaves its part with its peers, who
// still get their sum from what it gave at the start; once summed, the hub holds nothing,
// and the calls after it meet as before.
TEST(GroupCallsInFlight, ADroppedCallReleasesItsPostAndTheOthersStillPair) {
  auto hub = InProcessHub::create(3, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1), c = hub->endpoint(2);
  const std::vector<int> group{0, 1, 2};
  // The others' posts came before the drop.
  std::vector<float> a1{1, 2}, b1{3, 4}, c1{5, 6};
  auto pb1 = b->start_group_sum(b1, group);
  auto pc1 = c->start_group_sum(c1, group);
  EXPECT_EQ(hub->group_posts_held(), 2u);  // 1's and 2's values
  {
    auto pa1 = a->start_group_sum(a1, group);  // gives its values, and is dropped untested
  }
  EXPECT_EQ(hub->group_posts_held(), 3u);  // 0's values stay for 1 and 2
  pb1->wait();
  pc1->wait();
  EXPECT_EQ(b1, (std::vector<float>{9, 12}));
  EXPECT_EQ(c1, (std::vector<float>{9, 12}));
  EXPECT_EQ(hub->group_posts_held(), 0u);
  // The others' posts come after the drop, and after a part was taken.
  std::vector<float> a2{10, 20}, b2{30, 40}, c2{50, 60};
  auto pb2 = b->start_group_sum(b2, group);
  {
    auto pa2 = a->start_group_sum(a2, group);
    EXPECT_FALSE(pa2->test());  // 2's part has not come
  }
  auto pc2 = c->start_group_sum(c2, group);
  pb2->wait();
  pc2->wait();
  EXPECT_EQ(b2, (std::vector<float>{90, 120}));
  EXPECT_EQ(c2, (std::vector<float>{90, 120}));
  EXPECT_EQ(hub->group_posts_held(), 0u);
  // The next calls meet as before, each with the others' third call.
  std::vector<float> a3{100}, b3{300}, c3{500};
  auto pa3 = a->start_group_sum(a3, group);
  auto pb3 = b->start_group_sum(b3, group);
  auto pc3 = c->start_group_sum(c3, group);
  pa3->wait();
  pb3->wait();
  pc3->wait();
  for (const auto* v : {&a3, &b3, &c3}) EXPECT_EQ(*v, (std::vector<float>{900}));
  EXPECT_EQ(hub->group_posts_held(), 0u);
}

// The same for the reduce-scatter and the gather, whose posts go to one member or all.
TEST(GroupCallsInFlight, DroppedReduceScattersAndGathersReleaseTheirPosts) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  const std::vector<int> group{0, 1};
  const std::vector<size_t> bounds{0, 1, 2};
  std::vector<float> a1{1, 2}, b1{3, 4};
  { auto pa1 = a->start_group_reduce_scatter(a1, group, bounds); }
  auto pb1 = b->start_group_reduce_scatter(b1, group, bounds);
  pb1->wait();
  EXPECT_EQ(b1, (std::vector<float>{3, 6}));  // its own range summed, the rest its own
  std::vector<float> a2{7, 0}, b2{0, 8};
  auto pb2 = b->start_group_gather(b2, group, bounds);
  { auto pa2 = a->start_group_gather(a2, group, bounds); }
  pb2->wait();
  EXPECT_EQ(b2, (std::vector<float>{7, 8}));
  EXPECT_EQ(hub->group_posts_held(), 0u);
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

// Runs one call per member of `group` on its own thread, member i starting after delays[i] ms,
// each on its own copy of inputs[i]; returns what each member's vector holds afterwards.
template <class Start>
std::vector<std::vector<float>> run_group(InProcessHub& hub, const std::vector<int>& group,
                                          const std::vector<std::vector<float>>& inputs,
                                          const std::vector<int>& delays, Start start) {
  std::vector<std::vector<float>> outputs(group.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < group.size(); ++i)
    threads.emplace_back([&, i] {
      auto t = hub.endpoint(group[i]);
      std::this_thread::sleep_for(std::chrono::milliseconds(delays[i]));
      outputs[i] = inputs[i];
      auto pending = start(*t, outputs[i]);
      pending->wait();
      EXPECT_TRUE(pending->test());
    });
  for (auto& t : threads) t.join();
  return outputs;
}

TEST(GroupReduceScatter, EachMemberGetsTheGroupSumOfItsRangeAndSendsOnlyTheOthers) {
  constexpr size_t kValues = 1000;
  const std::vector<int> group{0, 2, 3};  // rank 1 stays out
  const std::vector<std::vector<size_t>> cuts{
      {0, 0, 613, kValues}, {0, 333, 666, kValues}, {0, kValues, kValues, kValues}};
  const std::vector<std::vector<int>> arrivals{{0, 10, 20}, {20, 10, 0}, {10, 0, 20}};
  auto hub = InProcessHub::create(4, 5000ms);
  int seed = 70;
  for (const auto& bounds : cuts)
    for (const auto& delays : arrivals) {
      SCOPED_TRACE("bounds " + std::to_string(bounds[1]) + ", " + std::to_string(bounds[2]) +
                   ", delays " + std::to_string(delays[0]) + " " + std::to_string(delays[1]) + " " +
                   std::to_string(delays[2]));
      std::vector<std::vector<float>> inputs;
      for (size_t i = 0; i < group.size(); ++i)
        inputs.push_back(testing::random_floats(kValues, seed++, -1e3f, 1e3f));
      const auto sums = run_group(*hub, group, inputs, {0, 0, 0}, [&](Transport& t, auto& v) {
        return t.start_group_sum(v, group);
      });
      std::vector<size_t> sent_before;
      for (int r : group) sent_before.push_back(hub->group_bytes_sent(r));
      const auto scattered = run_group(*hub, group, inputs, delays, [&](Transport& t, auto& v) {
        return t.start_group_reduce_scatter(v, group, bounds);
      });
      for (size_t i = 0; i < group.size(); ++i) {
        const size_t begin = bounds[i], end = bounds[i + 1];
        ASSERT_EQ(scattered[i].size(), kValues);
        EXPECT_EQ(std::memcmp(scattered[i].data() + begin, sums[i].data() + begin,
                              (end - begin) * sizeof(float)),
                  0)
            << "member " << i << ": its range differs from the group sum";
        // Outside its range the member keeps its own values.
        EXPECT_EQ(std::memcmp(scattered[i].data(), inputs[i].data(), begin * sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(scattered[i].data() + end, inputs[i].data() + end,
                              (kValues - end) * sizeof(float)),
                  0);
        EXPECT_EQ(hub->group_bytes_sent(group[i]) - sent_before[i],
                  (kValues - (end - begin)) * sizeof(float))
            << "member " << i << " sends more than the others' ranges";
      }
    }
  EXPECT_EQ(hub->group_bytes_sent(1), 0u);
}

TEST(GroupReduceScatter, AddsFromZeroInGroupOrder) {
  // 1e8 + 1 - 1e8 is 0 in float, 1e8 - 1e8 + 1 is 1: the order shows in the bits, and -0.0
  // from zero is +0.0, as in the group sum.
  auto hub = InProcessHub::create(3, 5000ms);
  const std::vector<int> group{0, 1, 2};
  const std::vector<size_t> bounds{0, 1, 2, 3};
  const std::vector<std::vector<float>> inputs{
      {1e8f, 1e8f, -0.0f}, {1.0f, -1e8f, -0.0f}, {-1e8f, 1.0f, -0.0f}};
  const auto out = run_group(*hub, group, inputs, {20, 0, 10}, [&](Transport& t, auto& v) {
    return t.start_group_reduce_scatter(v, group, bounds);
  });
  EXPECT_EQ(out[0][0], 0.0f);
  EXPECT_EQ(out[1][1], 1.0f);
  EXPECT_FALSE(std::signbit(out[2][2]));
}

TEST(GroupReduceScatter, RepeatedCallsStayInOrderAndTestNeverWaits) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  const std::vector<size_t> bounds{0, 1, 3};
  std::vector<float> a1{1, 2, 3}, a2{10, 20, 30}, b1{4, 5, 6}, b2{40, 50, 60};
  auto pa1 = a->start_group_reduce_scatter(a1, {0, 1}, bounds);
  EXPECT_FALSE(pa1->test());  // rank 1 has not sent rank 0's range
  auto pb1 = b->start_group_reduce_scatter(b1, {0, 1}, bounds);
  EXPECT_TRUE(pa1->test());
  auto pa2 = a->start_group_reduce_scatter(a2, {0, 1}, bounds);
  auto pb2 = b->start_group_reduce_scatter(b2, {0, 1}, bounds);
  pb1->wait();
  pb2->wait();
  pa2->wait();
  EXPECT_EQ(a1, (std::vector<float>{5, 2, 3}));
  EXPECT_EQ(b1, (std::vector<float>{4, 7, 9}));
  EXPECT_EQ(a2, (std::vector<float>{50, 20, 30}));
  EXPECT_EQ(b2, (std::vector<float>{40, 70, 90}));
}

TEST(GroupReduceScatter, AMemberThatNeverComesIsNamedAndEveryoneIsAborted) {
  auto hub = InProcessHub::create(3, 100ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> av = testing::random_floats(6, 80), bv = testing::random_floats(6, 81);
  auto pa = a->start_group_reduce_scatter(av, {0, 1, 2}, {0, 2, 4, 6});
  auto pb = b->start_group_reduce_scatter(bv, {0, 1, 2}, {0, 2, 4, 6});
  const auto started = std::chrono::steady_clock::now();
  try {
    pa->wait();
    ADD_FAILURE() << "the reduce-scatter finished without rank 2";
  } catch (const TransportError& e) {
    EXPECT_NE(
        std::string(e.what()).find("reduce-scatter over replicas waited 100 ms for rank(s) 2"),
        std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, 2000ms);
  // Rank 1, waiting for the same member, sees the abort rather than its own deadline.
  EXPECT_THROW(pb->wait(), TransportAborted);
  auto c = hub->endpoint(2);
  std::vector<float> cv(6);
  EXPECT_THROW(c->start_group_reduce_scatter(cv, {0, 1, 2}, {0, 2, 4, 6}), TransportAborted);
}

TEST(GroupReduceScatter, AnAbortEndsAPendingCallAtOnce) {
  auto hub = InProcessHub::create(2, 10000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> av = testing::random_floats(4, 82);
  auto pa = a->start_group_reduce_scatter(av, {0, 1}, {0, 2, 4});
  std::thread aborter([&] {
    std::this_thread::sleep_for(20ms);
    b->abort("rank 1 failed");
  });
  const auto started = std::chrono::steady_clock::now();
  try {
    pa->wait();
    ADD_FAILURE() << "the reduce-scatter finished without rank 1";
  } catch (const TransportAborted& e) {
    EXPECT_EQ(e.reason(), "rank 1 failed");
  }
  aborter.join();
  EXPECT_LT(std::chrono::steady_clock::now() - started, 5000ms);
}

TEST(GroupReduceScatter, RefusesBadBoundsAndFailsOnRangesThatDisagree) {
  auto hub = InProcessHub::create(2, 1000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  std::vector<float> av = testing::random_floats(5, 83), bv = testing::random_floats(5, 84);
  EXPECT_THROW(a->start_group_reduce_scatter(av, {0, 1}, {0, 5}), TransportError);
  EXPECT_THROW(a->start_group_reduce_scatter(av, {0, 1}, {0, 3, 4}), TransportError);
  EXPECT_THROW(a->start_group_reduce_scatter(av, {0, 1}, {0, 4, 3, 5}), TransportError);
  EXPECT_THROW(a->start_group_reduce_scatter(av, {1}, {0, 5}), TransportError);
  // Rank 1 cuts at 3 where rank 0 cuts at 2: each gets a part of another size.
  auto pa = a->start_group_reduce_scatter(av, {0, 1}, {0, 2, 5});
  auto pb = b->start_group_reduce_scatter(bv, {0, 1}, {0, 3, 5});
  try {
    pa->wait();
    ADD_FAILURE() << "ranges that disagree were summed";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("expected 2 values from rank 1, got 3"), std::string::npos)
        << e.what();
  }
}

TEST(GroupReduceScatter, TheDefaultTransportHasNone) {
  // A transport that implements nothing but the point-to-point calls.
  class Bare : public Transport {
   public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    void send(const Tensor&, int, const Stream&) override {}
    void recv(const Tensor&, int, const Stream&) override {}
    bool try_recv(const Tensor&, int, const Stream&) override { return false; }
    void all_reduce_sum(std::vector<double>&) override {}
    void abort(const std::string&) override {}
  } bare;
  std::vector<float> values(3);
  try {
    bare.start_group_reduce_scatter(values, {0}, {0, 3});
    ADD_FAILURE() << "the default reduce-scatter did something";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("no group reduce-scatter"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace conveyor::comm
