// The MPI transport's group calls with several in flight, run as processes under mpirun
// (ctest `mpi_group_calls`, 4 processes): sums, reduce-scatters and gathers started in the
// same order on every member, finished in an order of each member's own, each get their own
// result, bit for bit, over the whole world and over two groups at once, as the replica
// groups of data parallelism are. Not a *_test.cpp: comm_tests runs without mpirun, and this
// binary initialises MPI itself, as the program does.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "comm/mpi_transport.h"
#include "group_calls_in_flight.h"

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;

constexpr auto kTimeout = 20000ms;

// Every process runs `round` finishing its calls in another order than its neighbours', and
// starting a little later or earlier, so that parts of several calls wait at once.
void run_rounds(Transport& t, const std::vector<int>& group) {
  for (int round = 0; round < testing::kFinishOrders; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const int order = (t.rank() + round) % testing::kFinishOrders;
    std::this_thread::sleep_for(std::chrono::milliseconds(5 * ((t.rank() + round) % 3)));
    testing::run_group_calls_in_flight(t, group, static_cast<testing::FinishOrder>(order));
  }
}

TEST(MpiGroupCalls, EachCallGetsItsOwnResultWhateverTheFinishOrder) {
  auto t = make_mpi_transport(kTimeout);
  ASSERT_GE(t->size(), 2) << "run under mpirun -np 2 or more";
  std::vector<int> everyone;
  for (int r = 0; r < t->size(); ++r) everyone.push_back(r);
  run_rounds(*t, everyone);
}

TEST(MpiGroupCalls, TwoGroupsAtOnceKeepTheirCallsApart) {
  // The replica groups of two pipeline ranks: {0, 2} and {1, 3}.
  auto t = make_mpi_transport(kTimeout);
  ASSERT_EQ(t->size() % 2, 0) << "run under an even -np";
  std::vector<int> group;
  for (int r = t->rank() % 2; r < t->size(); r += 2) group.push_back(r);
  run_rounds(*t, group);
}

TEST(MpiGroupCalls, ALaterCallTestedFirstGetsItsOwnSum) {
  auto t = make_mpi_transport(kTimeout);
  const std::vector<int> group{0, 1};
  if (t->rank() < 2) {
    const float me = static_cast<float>(t->rank());
    std::vector<float> first{1 + me}, second{10 + me};
    auto p1 = t->start_group_sum(first, group);
    auto p2 = t->start_group_sum(second, group);
    p2->wait();
    EXPECT_EQ(second, std::vector<float>{21});
    p1->wait();
    EXPECT_EQ(first, std::vector<float>{3});
  }
}

// The sum is a reduce-scatter then a gather of ranges count * i / members: with fewer values
// than members some ranges are empty, and every value is still added once, in group order.
TEST(MpiGroupCalls, SumsOfFewerValuesThanMembersAddEveryValueOnce) {
  auto t = make_mpi_transport(kTimeout);
  std::vector<int> everyone;
  for (int r = 0; r < t->size(); ++r) everyone.push_back(r);
  const size_t members = everyone.size(), me = static_cast<size_t>(t->rank());
  for (size_t count : {size_t{0}, size_t{1}, size_t{2}, members - 1, members + 1}) {
    SCOPED_TRACE(std::to_string(count) + " values");
    const testing::PlannedGroupCall call{testing::GroupCallKind::kSum, count};
    std::vector<float> values = testing::group_call_input(me, count, count);
    t->start_group_sum(values, everyone)->wait();
    const std::vector<float> want = testing::group_call_result(call, count, me, members);
    ASSERT_EQ(values.size(), want.size());
    if (count > 0)  // an empty vector's data() may be null, which memcmp may not take
      EXPECT_EQ(std::memcmp(values.data(), want.data(), count * sizeof(float)), 0);
  }
}

// A member that never comes is the one named, not the members whose second phase waits on
// it too.
TEST(MpiGroupCalls, AWaitNamesTheMemberThatDidNotCome) {
  auto t = make_mpi_transport(1500ms);
  std::vector<int> everyone;
  for (int r = 0; r < t->size(); ++r) everyone.push_back(r);
  const int absent = t->size() - 1;
  if (t->rank() == absent) return;
  std::vector<float> values(64, 1.0f);
  try {
    t->start_group_sum(values, everyone)->wait();
    ADD_FAILURE() << "the sum finished without rank " << absent;
  } catch (const TransportError& e) {  // its own wait's, or an abort of another's
    EXPECT_NE(std::string(e.what()).find("for rank(s) " + std::to_string(absent) + " ("),
              std::string::npos)
        << e.what();
  }
}

// Members whose calls differ in length are told so; before, a part shorter than its buffer
// completed the receive and left the rest of the buffer in the sum.
TEST(MpiGroupCalls, APartOfAnotherLengthIsAnErrorNotASum) {
  auto t = make_mpi_transport(kTimeout);
  if (t->rank() >= 2) return;
  const std::vector<int> group{0, 1};
  // Rank 0 sums 6 values (its range [0, 3)), rank 1 sums 5 (its ranges [0, 2) and [2, 5)).
  std::vector<float> values(t->rank() == 0 ? 6 : 5, 1.0f);
  try {
    t->start_group_sum(values, group)->wait();
    ADD_FAILURE() << "sums of 6 and 5 values finished";
  } catch (const TransportAborted& e) {
    EXPECT_EQ(t->rank(), 1) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1 sent 2 values where 3 were expected"),
              std::string::npos)
        << e.what();
  } catch (const TransportError& e) {
    EXPECT_EQ(t->rank(), 0) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1 sent 2 values where 3 were expected"),
              std::string::npos)
        << e.what();
  }
}

// A call dropped unfinished (its rank failed elsewhere while the peers still run): what it
// sends still leaves whole, and what it receives lands in memory of its own, never in memory
// freed and handed out again. Messages of 4 MiB go by rendezvous, so the drop comes after
// MPI has matched them, where a cancel no longer stops them.
TEST(MpiGroupCalls, ADroppedCallStillSendsItsValuesAndWritesNoFreedMemory) {
  auto t = make_mpi_transport(kTimeout);
  const std::vector<int> group{0, 1};
  if (t->rank() >= 2) return;
  constexpr size_t kFloats = size_t{1} << 20;
  constexpr float kReused = -7;
  std::vector<float> big(kFloats, t->rank() == 0 ? 1.0f : 2.0f);
  if (t->rank() == 0) {
    t->start_group_sum(big, group).reset();
    big.assign(kFloats, kReused);
    // Blocks of the dropped call's sizes, allocated right after it: where freed buffers would
    // be handed out again.
    std::vector<std::vector<float> > reused(8, std::vector<float>(kFloats, kReused));
    std::vector<float> next{5};
    t->start_group_sum(next, group)->wait();
    EXPECT_EQ(next, std::vector<float>{11});
    for (const auto& block : reused)
      EXPECT_EQ(std::count(block.begin(), block.end(), kReused), static_cast<long>(kFloats));
  } else {
    t->start_group_sum(big, group)->wait();
    EXPECT_EQ(std::count(big.begin(), big.end(), 3.0f), static_cast<long>(kFloats))
        << "the dropped call's values did not come whole";
    std::vector<float> next{6};
    t->start_group_sum(next, group)->wait();
    EXPECT_EQ(next, std::vector<float>{11});
  }
}

}  // namespace
}  // namespace conveyor::comm

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  const int failed = RUN_ALL_TESTS();
  MPI_Finalize();
  return failed;
}
