// The in-process transport: FIFO per link, copies on send, all-reduce in rank order, and
// failure instead of a hang (timeouts, aborts, mismatched messages).
#include "comm/in_process.h"

#include <gtest/gtest.h>

#include <thread>

#include "engine/core/device_context.h"
#include "support/tensor_values.h"
#include "support/test_util.h"

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;

using testing::filled;

TEST(InProcessTransport, MessagesArriveInOrderAndAreCopies) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  DeviceContext ctx(Device::cpu());
  Stream& s = ctx.compute_stream();
  Tensor first = filled(ctx, {1, 2, 3});
  a->send(first, 1, s);
  first.data<float>()[0] = 99;  // the sender may reuse its memory at once
  a->send(filled(ctx, {4, 5, 6}), 1, s);
  Tensor got = ctx.empty({3});
  b->recv(got, 0, s);
  EXPECT_EQ(to_vector_f32(got), (std::vector<float>{1, 2, 3}));
  b->recv(got, 0, s);
  EXPECT_EQ(to_vector_f32(got), (std::vector<float>{4, 5, 6}));
}

TEST(InProcessTransport, TryReceiveTakesOnlyWhatHasArrivedAndKeepsTheLinkInOrder) {
  auto hub = InProcessHub::create(3, 5000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1), c = hub->endpoint(2);
  DeviceContext ctx(Device::cpu());
  Stream& s = ctx.compute_stream();
  const auto first = testing::random_floats(4, 11), second = testing::random_floats(4, 12);
  const auto untouched = testing::random_floats(4, 13);
  Tensor got = filled(ctx, untouched);
  // Nothing sent yet: no wait, and the tensor is left as it was.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(b->try_recv(got, 0, s));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1000ms);
  EXPECT_EQ(to_vector_f32(got), untouched);
  a->send(filled(ctx, first), 1, s);
  a->send(filled(ctx, second), 1, s);
  c->send(filled(ctx, untouched), 1, s);
  // Another link's message is not this link's.
  EXPECT_FALSE(c->try_recv(got, 0, s));
  ASSERT_TRUE(b->try_recv(got, 0, s));
  EXPECT_EQ(to_vector_f32(got), first);
  b->recv(got, 0, s);  // blocking and non-blocking receives share the link's order
  EXPECT_EQ(to_vector_f32(got), second);
  EXPECT_FALSE(b->try_recv(got, 0, s));
  ASSERT_TRUE(b->try_recv(got, 2, s));
  EXPECT_EQ(to_vector_f32(got), untouched);
  // Errors as for recv: a wrong size, a wrong peer, an aborted hub.
  a->send(filled(ctx, {1, 2}), 1, s);
  EXPECT_THROW(b->try_recv(got, 0, s), TransportError);
  EXPECT_THROW(b->try_recv(got, 1, s), TransportError);
  c->abort("rank 2 failed in F2.0");
  try {
    b->try_recv(got, 0, s);
    FAIL() << "a receive succeeded after the abort";
  } catch (const TransportAborted& e) {
    EXPECT_EQ(e.reason(), "rank 2 failed in F2.0");
  }
}

TEST(InProcessTransport, AllReduceSumsInRankOrderOnEveryRank) {
  constexpr int kRanks = 4;
  auto hub = InProcessHub::create(kRanks, 5000ms);
  std::vector<std::vector<double>> results(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      auto t = hub->endpoint(r);
      for (int round = 0; round < 50; ++round) {  // many rounds: no round overtakes another
        std::vector<double> v = {1.0 * r, 0.1 * round, r == 2 ? 1e16 : 1.0};
        t->all_reduce_sum(v);
        if (round == 49) results[r] = v;
      }
    });
  for (auto& t : threads) t.join();
  // Rank order: ((1 + 1) + 1e16) + 1 — the same bits everywhere.
  const double expected_last = ((1.0 + 1.0) + 1e16) + 1.0;
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(results[r][0], 6.0);
    EXPECT_EQ(results[r][2], expected_last);
  }
}

TEST(InProcessTransport, ReceiveTimesOutInsteadOfHanging) {
  auto hub = InProcessHub::create(2, 50ms);
  auto b = hub->endpoint(1);
  DeviceContext ctx(Device::cpu());
  Tensor got = ctx.empty({3});
  try {
    b->recv(got, 0, ctx.compute_stream());
    FAIL() << "receive with no sender returned";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("nothing arrived from rank 0"), std::string::npos);
  }
}

TEST(InProcessTransport, AbortWakesWaitingRanks) {
  auto hub = InProcessHub::create(3, 60000ms);
  std::string error;
  std::thread waiter([&] {
    DeviceContext ctx(Device::cpu());
    Tensor got = ctx.empty({1});
    try {
      hub->endpoint(2)->recv(got, 0, ctx.compute_stream());
    } catch (const TransportError& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(20ms);
  hub->endpoint(0)->abort("rank 0 failed in F0.3");
  waiter.join();  // would take a minute without the abort
  EXPECT_NE(error.find("rank 0 failed in F0.3"), std::string::npos) << error;
}

TEST(InProcessTransport, AfterAnAbortEveryCallThrowsTheTypedErrorWithTheFirstReason) {
  auto hub = InProcessHub::create(2, 60000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  DeviceContext ctx(Device::cpu());
  b->abort("rank 1 failed in B1.0");
  a->abort("a second reason");  // ignored: the first one stands
  Tensor t = filled(ctx, {1, 2});
  std::vector<double> values = {1.0};
  for (int call = 0; call < 3; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    try {
      if (call == 0) a->send(t, 1, ctx.compute_stream());
      if (call == 1) b->recv(t, 0, ctx.compute_stream());
      if (call == 2) a->all_reduce_sum(values);
      ADD_FAILURE() << "the call succeeded after the abort";
    } catch (const TransportAborted& e) {
      EXPECT_EQ(e.reason(), "rank 1 failed in B1.0");
      const std::string rank = call == 1 ? "rank 1" : "rank 0";
      EXPECT_EQ(std::string(e.what()), rank + ": pipeline aborted: rank 1 failed in B1.0");
    }
  }
}

TEST(InProcessTransport, ATimeoutIsTheRootFailureAndTheOthersSeeAnAbort) {
  auto hub = InProcessHub::create(2, 50ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  DeviceContext ctx(Device::cpu());
  Tensor got = ctx.empty({3});
  try {
    b->recv(got, 0, ctx.compute_stream());
    FAIL() << "receive with no sender returned";
  } catch (const TransportAborted& e) {
    FAIL() << "the rank that timed out started the failure: " << e.what();
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("within 50 ms"), std::string::npos) << e.what();
  }
  // The timeout aborted the hub for rank 0 too, naming rank 1's failure.
  try {
    a->send(got, 1, ctx.compute_stream());
    FAIL() << "send succeeded after rank 1 gave up";
  } catch (const TransportAborted& e) {
    EXPECT_NE(e.reason().find("rank 1: nothing arrived from rank 0"), std::string::npos)
        << e.reason();
  }
}

TEST(InProcessTransport, SizeMismatchAndBadPeersAreErrors) {
  auto hub = InProcessHub::create(2, 1000ms);
  auto a = hub->endpoint(0), b = hub->endpoint(1);
  DeviceContext ctx(Device::cpu());
  a->send(filled(ctx, {1, 2}), 1, ctx.compute_stream());
  Tensor wrong = ctx.empty({3});
  EXPECT_THROW(b->recv(wrong, 0, ctx.compute_stream()), TransportError);
  EXPECT_THROW(a->send(wrong, 0, ctx.compute_stream()), TransportError);  // to itself
  EXPECT_THROW(a->send(wrong, 5, ctx.compute_stream()), TransportError);
  EXPECT_THROW(b->recv(wrong, -1, ctx.compute_stream()), TransportError);
  try {
    b->recv(wrong, 2, ctx.compute_stream());
    FAIL() << "a receive from a rank that does not exist was accepted";
  } catch (const TransportError& e) {
    EXPECT_EQ(std::string(e.what()), "rank 1: cannot receive from rank 2 (ranks are 0..1)");
  }
  EXPECT_THROW(hub->endpoint(2), std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::comm
