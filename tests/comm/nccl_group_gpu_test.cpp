// The group calls of data parallelism over NCCL (sum, reduce-scatter, gather), bit for bit
// against the in-process transport, on ranks that are threads of one process and on ranks
// each holding only their own communicators (as processes do under mpirun); that start and
// test never wait; that several calls in flight each get their own result, whatever order
// they are finished in; and that an unknown group, a member that never comes, and an abort
// fail instead of hanging. Needs two CUDA devices or more.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/in_process.h"
#include "comm/nccl.h"
#include "engine/core/device.h"
#include "group_calls_in_flight.h"
#include "support/test_util.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "kernels/cuda_check.h"
#include "support/nccl_ids.h"
#endif

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

#ifdef CONVEYOR_WITH_CUDA

using conveyor::testing::make_unique_ids;

#define CONVEYOR_REQUIRE_TWO_GPUS()                                                       \
  do {                                                                                    \
    if (cuda_device_count() < 2)                                                          \
      GTEST_SKIP() << "NCCL group calls need two CUDA devices (one rank per GPU), found " \
                   << cuda_device_count();                                                \
  } while (0)

// Up to four ranks, one group of them all: with three or more members the order of the
// additions shows (two addends commute).
int group_ranks() { return std::min(cuda_device_count(), 4); }

std::vector<int> all_ranks(int n) {
  std::vector<int> out;
  for (int r = 0; r < n; ++r) out.push_back(r);
  return out;
}

// One group call of every kind on every rank of a group, one after another.
struct Case {
  size_t values;
  std::vector<size_t> bounds;  // one range per member
  uint64_t seed;
};

// Sizes of one, of an odd count and of more than NCCL's buffers; ranges even, uneven, empty
// at the front, and nearly all in the last member's.
std::vector<Case> cases(int members) {
  std::vector<Case> out;
  uint64_t seed = 1000;
  for (size_t n : {size_t{1}, size_t{4097}, (size_t{1} << 20) + 3}) {
    std::vector<size_t> even, empty_first, tiny;
    for (int i = 0; i <= members; ++i) {
      even.push_back(n * i / members);
      empty_first.push_back(i == 0 ? 0 : (n * (i - 1) + members - 2) / (members - 1));
      tiny.push_back(i == members ? n : std::min(n, static_cast<size_t>(i)));
    }
    empty_first.back() = n;
    for (auto& bounds : {even, empty_first, tiny}) out.push_back({n, bounds, seed++});
  }
  return out;
}

std::vector<float> input_of(const Case& c, int rank) {
  return testing::random_floats(c.values, c.seed * 16 + rank, -1e3f, 1e3f);
}

// What each rank ends with after a sum, a reduce-scatter and a gather of `c` over `group`:
// [case][kind * ranks + rank].
using Results = std::vector<std::vector<std::vector<float>>>;

// Runs every case on every rank of `transports`, one thread each (the device of rank r made
// current for NCCL); a failing rank aborts the transport so that the others end too.
Results run_cases(std::vector<std::unique_ptr<Transport>>& transports,
                  const std::vector<int>& group, const std::vector<Case>& all,
                  std::vector<std::string>& errors) {
  const int n = static_cast<int>(transports.size());
  Results results(all.size(), std::vector<std::vector<float>>(3 * n));
  errors.assign(n, "");
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        if (cuda_device_count() > r) CONVEYOR_CUDA_CHECK(cudaSetDevice(r));
        Transport& t = *transports[r];
        for (size_t k = 0; k < all.size(); ++k) {
          const Case& c = all[k];
          std::vector<float> sum = input_of(c, r), scattered = sum, gathered = sum;
          t.start_group_sum(sum, group)->wait();
          t.start_group_reduce_scatter(scattered, group, c.bounds)->wait();
          t.start_group_gather(gathered, group, c.bounds)->wait();
          results[k][r] = sum;
          results[k][n + r] = scattered;
          results[k][2 * n + r] = gathered;
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
        transports[r]->abort(e.what());
      }
    });
  for (auto& t : threads) t.join();
  return results;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same_bits(const Results& got, const Results& want, int ranks) {
  const char* kinds[] = {"group sum", "reduce-scatter", "gather"};
  for (size_t k = 0; k < want.size(); ++k)
    for (int kind = 0; kind < 3; ++kind)
      for (int r = 0; r < ranks; ++r)
        EXPECT_TRUE(bitwise_equal(got[k][kind * ranks + r], want[k][kind * ranks + r]))
            << kinds[kind] << ", case " << k << ", rank " << r;
}

Results in_process_reference(int ranks, const std::vector<int>& group,
                             const std::vector<Case>& all) {
  auto hub = InProcessHub::create(ranks, 30000ms);
  std::vector<std::unique_ptr<Transport>> transports;
  for (int r = 0; r < ranks; ++r) transports.push_back(hub->endpoint(r));
  std::vector<std::string> errors;
  Results out = run_cases(transports, group, all, errors);
  for (const std::string& e : errors)
    if (!e.empty()) throw std::runtime_error("the in-process reference failed: " + e);
  return out;
}

// The reference is computed from the in-process transport, and checked against the sums
// written out here (group order from zero), so that a reference gone wrong cannot pass.
TEST(NcclGroupGpu, ThreadRanksGetTheInProcessBitsForEveryCall) {
  CONVEYOR_REQUIRE_TWO_GPUS();
  const int n = group_ranks();
  const std::vector<int> group = all_ranks(n);
  const std::vector<Case> all = cases(n);
  const Results want = in_process_reference(n, group, all);
  for (size_t k = 0; k < all.size(); ++k) {
    std::vector<float> sum(all[k].values, 0.0f);
    for (int r = 0; r < n; ++r) {
      const auto in = input_of(all[k], r);
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += in[i];
    }
    ASSERT_TRUE(bitwise_equal(want[k][0], sum)) << "case " << k;
  }
  auto transports = make_nccl_transports(group, 30000ms, {group});
  std::vector<std::string> errors;
  const Results got = run_cases(transports, group, all, errors);
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  expect_same_bits(got, want, n);
  // The reduce-scatter leaves the other ranges as they were (4097 values, the first range
  // empty).
  const size_t k = 4;
  const Case& c = all[k];
  for (int r = 0; r < n; ++r) {
    const auto in = input_of(c, r);
    for (size_t i = 0; i < c.values; ++i)
      if (i < c.bounds[r] || i >= c.bounds[r + 1]) {
        ASSERT_EQ(std::memcmp(&got[k][n + r][i], &in[i], sizeof(float)), 0) << "rank " << r;
      }
  }
}

// Two groups at once, as the executor has them with two stages and two replicas.
TEST(NcclGroupGpu, SeveralGroupsOfOneCliqueEachGetTheirOwnSum) {
  CONVEYOR_REQUIRE_TWO_GPUS();
  if (cuda_device_count() < 4) GTEST_SKIP() << "two groups of two need four CUDA devices";
  const NcclGroups groups = {{0, 2}, {1, 3}};
  auto transports = make_nccl_transports({0, 1, 2, 3}, 30000ms, groups);
  std::vector<std::vector<float>> inputs(4), outputs(4);
  std::vector<std::string> errors(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    inputs[r] = testing::random_floats(12345, 70 + r, -10.0f, 10.0f);
    threads.emplace_back([&, r] {
      try {
        CONVEYOR_CUDA_CHECK(cudaSetDevice(r));
        outputs[r] = inputs[r];
        transports[r]->start_group_sum(outputs[r], groups[r % 2])->wait();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        transports[r]->abort(e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    std::vector<float> want(inputs[r].size(), 0.0f);
    for (int member : groups[r % 2])
      for (size_t i = 0; i < want.size(); ++i) want[i] += inputs[member][i];
    EXPECT_TRUE(bitwise_equal(outputs[r], want)) << "rank " << r;
  }
}

// Sums, reduce-scatters and gathers in flight at once, each rank finishing them in an order of
// its own: each call keeps staging buffers of its own and ends with its own result.
TEST(NcclGroupGpu, SeveralCallsInFlightEachGetTheirOwnResult) {
  CONVEYOR_REQUIRE_TWO_GPUS();
  const int n = group_ranks();
  const std::vector<int> group = all_ranks(n);
  auto transports = make_nccl_transports(group, 30000ms, {group});
  for (int round = 0; round < testing::kFinishOrders; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          CONVEYOR_CUDA_CHECK(cudaSetDevice(r));
          testing::run_group_calls_in_flight(
              *transports[r], group,
              static_cast<testing::FinishOrder>((r + round) % testing::kFinishOrders));
        } catch (const std::exception& e) {
          errors[r] = e.what();
          transports[r]->abort(e.what());
        }
      });
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  }
}

// Each rank a "process" of its own (a thread making only its own ends from the unique ids),
// as under mpirun.
TEST(NcclGroupGpu, RanksHoldingOnlyTheirOwnEndsGetTheInProcessBits) {
  CONVEYOR_REQUIRE_TWO_GPUS();
  const int n = group_ranks();
  const std::vector<int> group = all_ranks(n);
  std::vector<Case> all = cases(n);
  all.resize(6);  // the two smaller sizes
  const Results want = in_process_reference(n, group, all);
  const std::vector<std::string> ids = make_unique_ids(n, 1);
  // The id list must match the groups.
  EXPECT_THROW(make_nccl_transport_from_ids(0, n, 0, make_unique_ids(n, 0), 1000ms, {group}),
               std::invalid_argument);
  std::vector<std::unique_ptr<Transport>> transports(n);
  std::vector<std::string> errors(n);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          CONVEYOR_CUDA_CHECK(cudaSetDevice(r));
          transports[r] = make_nccl_transport_from_ids(r, n, r, ids, 30000ms, {group});
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : threads) t.join();
  }
  for (int r = 0; r < n; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  const Results got = run_cases(transports, group, all, errors);
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  expect_same_bits(got, want, n);
}

// A hold on the host: rank 1 comes 300 ms late, so rank 0's call cannot be done before.
TEST(NcclGroupGpu, StartAndTestNeverWaitForALateMember) {
  CONVEYOR_REQUIRE_TWO_GPUS();
  const std::vector<int> group = {0, 1};
  auto transports = make_nccl_transports({0, 1}, 30000ms, {group});
  std::vector<float> a = testing::random_floats(50000, 5, -1.0f, 1.0f), b = a;
  for (float& v : b) v *= 3.0f;
  std::vector<float> want(a.size(), 0.0f);
  for (size_t i = 0; i < a.size(); ++i) want[i] = (0.0f + a[i]) + b[i];
  std::string error_b;
  std::thread late([&] {
    try {
      CONVEYOR_CUDA_CHECK(cudaSetDevice(1));
      std::this_thread::sleep_for(300ms);
      transports[1]->start_group_sum(b, group)->wait();
    } catch (const std::exception& e) {
      error_b = e.what();
      transports[1]->abort(e.what());
    }
  });
  CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
  const auto start = Clock::now();
  auto pending = transports[0]->start_group_sum(a, group);
  const bool done_at_once = pending->test();
  const auto took = Clock::now() - start;
  pending->wait();
  late.join();
  EXPECT_FALSE(done_at_once) << "the sum was done before rank 1 started its part";
  EXPECT_LT(took, 200ms);
  EXPECT_EQ(error_b, "");
  EXPECT_TRUE(pending->test());
  EXPECT_TRUE(bitwise_equal(a, want));
  EXPECT_TRUE(bitwise_equal(b, want));
}

TEST(NcclGroupGpu, AnUnknownGroupALoneMemberAndAnAbortFailByName) {
  CONVEYOR_REQUIRE_TWO_GPUS();
  const std::vector<int> group = {0, 1};
  auto transports = make_nccl_transports({0, 1}, 500ms, {group});
  CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
  // A group of this rank alone needs no communicator: the sum from zero of its own values.
  std::vector<float> alone = {-0.0f, 1.5f};
  transports[0]->start_group_sum(alone, {0})->wait();
  EXPECT_FALSE(std::signbit(alone[0])) << "0.0f + -0.0f is +0.0f";
  EXPECT_EQ(alone[1], 1.5f);
  // A transport made without groups has no communicator for {0, 1}.
  auto bare = make_nccl_transports({0, 1}, 500ms);
  std::vector<float> values = {1.0f, 2.0f};
  try {
    bare[0]->start_group_sum(values, group);
    ADD_FAILURE() << "a group sum without a communicator started";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("no communicator for the group {0,1}"), std::string::npos)
        << e.what();
  }
  // Rank 1 never comes: the deadline ends the wait and aborts the transport.
  const auto start = Clock::now();
  auto pending = transports[0]->start_group_sum(values, group);
  try {
    pending->wait();
    ADD_FAILURE() << "the group sum finished without rank 1";
  } catch (const TransportAborted& e) {
    ADD_FAILURE() << "the timeout itself is the failure, not a follow-on abort: " << e.what();
  } catch (const TransportError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("group {0,1}"), std::string::npos) << what;
    EXPECT_NE(what.find("500 ms"), std::string::npos) << what;
  }
  EXPECT_LT(Clock::now() - start, 10s);
  CONVEYOR_CUDA_CHECK(cudaSetDevice(1));
  std::vector<float> late = {3.0f, 4.0f};
  EXPECT_THROW(transports[1]->start_group_sum(late, group), TransportAborted);
  EXPECT_THROW(transports[1]->start_group_gather(late, group, {0, 1, 2}), TransportAborted);
  EXPECT_THROW(transports[1]->start_group_reduce_scatter(late, group, {0, 1, 2}), TransportAborted);
  CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
}

#endif  // CONVEYOR_WITH_CUDA

}  // namespace
}  // namespace conveyor::comm
