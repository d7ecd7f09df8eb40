#pragma once
// Several group calls of one group in flight at once, as a rank's gradient buckets are:
// every member starts the same sums, reduce-scatters and gathers in the same order, then
// finishes them in an order of its own (the latest first, polling them all, one from the
// middle first, or in start order), some before the rest have started. Each call must end
// with its own result, bit for bit. Shared by the in-process test (members as threads) and
// the MPI one (members as processes under mpirun).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/transport.h"
#include "support/test_util.h"

namespace conveyor::testing {
using comm::PendingGroupCall;
using comm::Transport;

enum class GroupCallKind { kSum, kReduceScatter, kGather };

struct PlannedGroupCall {
  GroupCallKind kind;
  size_t count;  // values
};

// The calls every member starts, in this order. Lengths repeat, so that a call given another
// call's parts shows it in its values, not only in a length the transport would refuse.
inline std::vector<PlannedGroupCall> group_calls_in_flight() {
  using K = GroupCallKind;
  return {{K::kSum, 300}, {K::kReduceScatter, 300}, {K::kSum, 300},   {K::kGather, 300},
          {K::kSum, 77},  {K::kReduceScatter, 300}, {K::kGather, 77}, {K::kSum, 300}};
}

// How a member finishes its calls in flight.
enum class FinishOrder { kLatestFirst, kPollingAll, kMiddleFirst, kStartOrder };
inline constexpr int kFinishOrders = 4;

inline const char* finish_order_name(FinishOrder order) {
  switch (order) {
    case FinishOrder::kLatestFirst:
      return "latest first";
    case FinishOrder::kPollingAll:
      return "polling all";
    case FinishOrder::kMiddleFirst:
      return "middle first";
    case FinishOrder::kStartOrder:
      return "start order";
  }
  return "?";
}

// What the member at position `member` gives to call `call`.
inline std::vector<float> group_call_input(size_t member, size_t call, size_t count) {
  return random_floats(count, 1000 * (call + 1) + member, -1e3f, 1e3f);
}

// Member i's range of a reduce-scatter or gather of `count` values over `members`.
inline std::vector<size_t> group_call_bounds(size_t count, size_t members) {
  std::vector<size_t> bounds;
  for (size_t i = 0; i <= members; ++i) bounds.push_back(count * i / members);
  return bounds;
}

// What the member at position `me` of `members` holds once call `call` is done.
inline std::vector<float> group_call_result(const PlannedGroupCall& c, size_t call, size_t me,
                                            size_t members) {
  std::vector<std::vector<float>> inputs;
  for (size_t i = 0; i < members; ++i) inputs.push_back(group_call_input(i, call, c.count));
  const std::vector<size_t> bounds = group_call_bounds(c.count, members);
  std::vector<float> out = inputs[me];
  auto sum_over = [&](size_t begin, size_t end) {
    for (size_t k = begin; k < end; ++k) {
      float sum = 0.0f;
      for (const auto& part : inputs) sum += part[k];
      out[k] = sum;
    }
  };
  switch (c.kind) {
    case GroupCallKind::kSum:
      sum_over(0, c.count);
      break;
    case GroupCallKind::kReduceScatter:
      sum_over(bounds[me], bounds[me + 1]);
      break;
    case GroupCallKind::kGather:
      for (size_t i = 0; i < members; ++i)
        std::copy(inputs[i].begin() + bounds[i], inputs[i].begin() + bounds[i + 1],
                  out.begin() + bounds[i]);
      break;
  }
  return out;
}

// Calls test() on every call not yet done, latest first, until all are; fails the test past
// `limit`.
inline void poll_until_done(std::vector<std::unique_ptr<PendingGroupCall>>& pending,
                            std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  std::vector<bool> done(pending.size(), false);
  for (;;) {
    bool all = true;
    for (size_t c = pending.size(); c-- > 0;)
      if (!done[c]) all = (done[c] = pending[c]->test()) && all;
    if (all) return;
    if (std::chrono::steady_clock::now() > deadline) {
      ADD_FAILURE() << "calls still not done after polling " << limit.count() << " ms";
      return;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

inline void finish_in_order(std::vector<std::unique_ptr<PendingGroupCall>>& pending,
                            FinishOrder order) {
  const size_t n = pending.size();
  switch (order) {
    case FinishOrder::kLatestFirst:
      for (size_t c = n; c-- > 0;) pending[c]->wait();
      break;
    case FinishOrder::kPollingAll:
      poll_until_done(pending, std::chrono::milliseconds(20000));
      break;
    case FinishOrder::kMiddleFirst:
      pending[n / 2]->wait();
      (void)pending[n - 1]->test();
      for (auto& p : pending) p->wait();
      break;
    case FinishOrder::kStartOrder:
      for (auto& p : pending) p->wait();
      break;
  }
  // Done calls stay done.
  for (auto& p : pending) EXPECT_TRUE(p->test());
}

// Runs group_calls_in_flight() on `t`, a member of `group`: starts the first half, waits for
// the latest of them, starts the rest while the others are still in flight, then finishes
// every call in `order` and checks each one's result, bit for bit.
inline void run_group_calls_in_flight(Transport& t, const std::vector<int>& group,
                                      FinishOrder order) {
  const std::vector<PlannedGroupCall> plan = group_calls_in_flight();
  size_t me = 0;
  while (group[me] != t.rank()) ++me;
  const size_t members = group.size();
  // Sized once: the calls hold references to these vectors until they are done.
  std::vector<std::vector<float>> values(plan.size());
  std::vector<std::unique_ptr<PendingGroupCall>> pending(plan.size());
  auto start = [&](size_t c) {
    values[c] = group_call_input(me, c, plan[c].count);
    const std::vector<size_t> bounds = group_call_bounds(plan[c].count, members);
    switch (plan[c].kind) {
      case GroupCallKind::kSum:
        pending[c] = t.start_group_sum(values[c], group);
        break;
      case GroupCallKind::kReduceScatter:
        pending[c] = t.start_group_reduce_scatter(values[c], group, bounds);
        break;
      case GroupCallKind::kGather:
        pending[c] = t.start_group_gather(values[c], group, bounds);
        break;
    }
  };
  const size_t half = plan.size() / 2;
  for (size_t c = 0; c < half; ++c) start(c);
  pending[half - 1]->wait();
  for (size_t c = half; c < plan.size(); ++c) start(c);
  finish_in_order(pending, order);
  for (size_t c = 0; c < plan.size(); ++c) {
    const std::vector<float> want = group_call_result(plan[c], c, me, members);
    ASSERT_EQ(values[c].size(), want.size()) << "call " << c;
    EXPECT_EQ(std::memcmp(values[c].data(), want.data(), want.size() * sizeof(float)), 0)
        << "rank " << t.rank() << ", call " << c << " (finished " << finish_order_name(order)
        << ") does not hold its own result";
  }
}

}  // namespace conveyor::testing
