// The NCCL transport: bitwise transfers (to self on one GPU, between ranks on two), FIFO
// order per link with both directions in flight at once, the host all-reduce, and failure
// instead of a hang (a stuck stream, a rank that never joins, an abort).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "comm/nccl.h"
#include "engine/core/device_context.h"
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

TEST(NcclGpu, AvailableWhenADeviceIs) {
  CONVEYOR_REQUIRE_GPU();
  EXPECT_TRUE(nccl_available());
}

#ifdef CONVEYOR_WITH_CUDA

using conveyor::testing::make_unique_ids;

NcclTransport& nccl(const std::unique_ptr<Transport>& t) {
  auto* n = dynamic_cast<NcclTransport*>(t.get());
  if (!n) throw std::logic_error("not an NcclTransport");
  return *n;
}

Tensor random_tensor(DeviceContext& ctx, int64_t n, uint64_t seed) {
  Tensor t = ctx.empty({n});
  const auto values = testing::random_floats(static_cast<size_t>(n), seed, -3.0f, 3.0f);
  copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(NcclGpu, SendToSelfOnOneRankIsBitwise) {
  CONVEYOR_REQUIRE_GPU();
  auto transports = make_nccl_transports({0}, 20000ms);
  ASSERT_EQ(transports.size(), 1u);
  NcclTransport& t = nccl(transports[0]);
  EXPECT_EQ(t.rank(), 0);
  EXPECT_EQ(t.size(), 1);
  DeviceContext ctx(Device::cuda(0));
  Stream stream(Device::cuda(0));
  // One element, an odd size, and one larger than NCCL's staging buffers (rendezvous).
  for (int64_t n : {int64_t{1}, int64_t{4097}, int64_t{3} << 20}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    Tensor src = random_tensor(ctx, n, 11 + n);
    Tensor dst = random_tensor(ctx, n, 99 + n);  // poison: different values
    const auto want = to_vector_f32(src);
    ASSERT_FALSE(bitwise_equal(to_vector_f32(dst), want));
    t.send_recv_self(src, dst, stream);
    t.synchronize(stream);
    EXPECT_TRUE(bitwise_equal(to_vector_f32(dst), want));
    EXPECT_TRUE(bitwise_equal(to_vector_f32(src), want));  // the source is untouched
  }
  // Byte counts must agree.
  EXPECT_THROW(t.send_recv_self(ctx.empty({4}), ctx.empty({5}), stream), TransportError);
}

TEST(NcclGpu, AllReduceOnOneRankIsTheIdentity) {
  CONVEYOR_REQUIRE_GPU();
  auto transports = make_nccl_transports({0}, 20000ms);
  std::vector<double> values = {1.0 / 3.0, -2.5e-300, 7.25e300, 0.0, -1.0, 1e-7, 42.0};
  for (size_t i = 0; i < 100; ++i) values.push_back(std::sin(static_cast<double>(i) + 0.5));
  const auto want = values;
  transports[0]->all_reduce_sum(values);
  EXPECT_EQ(values, want);
  // Again, larger: the buffers grow.
  std::vector<double> more(5000);
  for (size_t i = 0; i < more.size(); ++i) more[i] = std::cos(static_cast<double>(i)) * 1e3;
  const auto want_more = more;
  transports[0]->all_reduce_sum(more);
  EXPECT_EQ(more, want_more);
}

TEST(NcclGpu, BadRankListsAreClearErrors) {
  CONVEYOR_REQUIRE_GPU();
  EXPECT_THROW(make_nccl_transports({}, 1000ms), std::invalid_argument);
  EXPECT_THROW(make_nccl_transports({0, 0}, 1000ms), std::invalid_argument);
  EXPECT_THROW(make_nccl_transports({cuda_device_count()}, 1000ms), std::invalid_argument);
  EXPECT_THROW(make_nccl_transports({0}, 0ms), std::invalid_argument);
  auto transports = make_nccl_transports({0}, 1000ms);
  DeviceContext cpu(Device::cpu());
  Stream stream(Device::cuda(0));
  // A CPU tensor, or a peer that does not exist, is refused before NCCL sees it.
  EXPECT_THROW(transports[0]->send(cpu.empty({4}), 0, stream), TransportError);
  DeviceContext ctx(Device::cuda(0));
  EXPECT_THROW(transports[0]->send(ctx.empty({4}), 0, stream), TransportError);  // self
  EXPECT_THROW(transports[0]->recv(ctx.empty({4}), 1, stream), TransportError);
}

// Blocks a stream on the host until `release` is set (or 30 s pass), like a peer that never
// comes: a host function holds every later operation of the stream.
void CUDART_CB hold_stream(void* flag) {
  auto* release = static_cast<std::atomic<bool>*>(flag);
  const auto limit = Clock::now() + 30s;
  while (!release->load() && Clock::now() < limit) std::this_thread::sleep_for(1ms);
}

TEST(NcclGpu, AStuckStreamTimesOutAbortsAndLaterCallsThrow) {
  CONVEYOR_REQUIRE_GPU();
  constexpr auto kTimeout = 300ms;
  auto transports = make_nccl_transports({0}, kTimeout);
  NcclTransport& t = nccl(transports[0]);
  Stream stream(Device::cuda(0));
  std::atomic<bool> release{false};
  CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
  CONVEYOR_CUDA_CHECK(
      cudaLaunchHostFunc(static_cast<cudaStream_t>(stream.native()), hold_stream, &release));
  // The stream is let go a second after the deadline: ncclCommAbort may synchronise the
  // device, and then the failed wait can only return once the held stream moves on.
  const auto start = Clock::now();
  std::jthread releaser([&] {
    std::this_thread::sleep_until(start + kTimeout + 1s);
    release = true;
  });
  try {
    t.synchronize(stream);
    ADD_FAILURE() << "synchronize returned while the stream was held";
  } catch (const TransportAborted& e) {
    ADD_FAILURE() << "the timeout itself is the failure, not a follow-on abort: " << e.what();
  } catch (const TransportError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0"), std::string::npos) << what;
    EXPECT_NE(what.find("300 ms"), std::string::npos) << what;
  }
  EXPECT_GE(Clock::now() - start, kTimeout);
  EXPECT_LT(Clock::now() - start, 5s);
  releaser.join();
  stream.synchronize();
  // The transport is now aborted for good.
  std::vector<double> values = {1.0};
  EXPECT_THROW(t.all_reduce_sum(values), TransportError);
  DeviceContext ctx(Device::cuda(0));
  EXPECT_THROW(t.send_recv_self(ctx.empty({4}), ctx.empty({4}), stream), TransportError);
  // ... of the type that says so.
  EXPECT_THROW(t.all_reduce_sum(values), TransportAborted);
  EXPECT_THROW(t.synchronize(stream), TransportAborted);
}

// Waiting polls the stream; a busy stream's "not ready" must not stay behind as the thread's
// last CUDA error, where the next kernel-launch check would throw it.
TEST(NcclGpu, WaitingForABusyStreamLeavesNoErrorForTheNextLaunchCheck) {
  CONVEYOR_REQUIRE_GPU();
  auto transports = make_nccl_transports({0}, 20000ms);
  Stream stream(Device::cuda(0));
  std::atomic<bool> release{false};
  CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
  CONVEYOR_CUDA_CHECK(
      cudaLaunchHostFunc(static_cast<cudaStream_t>(stream.native()), hold_stream, &release));
  EXPECT_FALSE(stream.query());
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
  std::jthread releaser([&] {
    std::this_thread::sleep_for(100ms);  // long enough for many polls
    release = true;
  });
  transports[0]->synchronize(stream);
  EXPECT_TRUE(stream.query());
  EXPECT_EQ(cudaPeekAtLastError(), cudaSuccess);
}

TEST(NcclGpu, AbortIsIdempotentAndNamesTheReason) {
  CONVEYOR_REQUIRE_GPU();
  auto transports = make_nccl_transports({0}, 20000ms);
  transports[0]->abort("rank 3 ran out of memory");
  EXPECT_NO_THROW(transports[0]->abort("a second reason"));
  std::vector<double> values = {1.0, 2.0};
  try {
    transports[0]->all_reduce_sum(values);
    ADD_FAILURE() << "all-reduce succeeded after abort";
  } catch (const TransportError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("pipeline aborted: rank 3 ran out of memory"), std::string::npos) << what;
    const auto* aborted = dynamic_cast<const TransportAborted*>(&e);
    ASSERT_NE(aborted, nullptr) << "not a TransportAborted: " << what;
    EXPECT_EQ(aborted->reason(), "rank 3 ran out of memory");  // the first reason stays
  }
  // An abort from another thread is fine too.
  std::thread([&] { transports[0]->abort("from another thread"); }).join();
}

// Two ranks on two GPUs, as threads.
TEST(NcclGpu, TwoRanksExchangeInFifoOrderBothWaysAtOnceAndAllReduce) {
  CONVEYOR_REQUIRE_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  constexpr int kMessages = 4;
  constexpr int64_t kElements = int64_t{1} << 20;  // 4 MiB: more than NCCL buffers at once
  auto transports = make_nccl_transports({0, 1}, 30000ms);
  std::vector<std::string> errors(2);
  std::vector<std::vector<double>> reduced(2);
  auto run = [&](int r) {
    try {
      CONVEYOR_CUDA_CHECK(cudaSetDevice(r));
      NcclTransport& t = nccl(transports[r]);
      DeviceContext ctx(Device::cuda(r));
      Stream send(Device::cuda(r)), recv(Device::cuda(r));
      const int peer = 1 - r;
      // Every tensor is made before the first send: making one uploads from the host and
      // synchronizes the device, which would wait for this rank's sends, which wait for the
      // peer's receives, which the peer, in the same wait, never posts.
      std::vector<Tensor> inputs, got;
      for (int k = 0; k < kMessages; ++k) {
        inputs.push_back(random_tensor(ctx, kElements, 100 * r + k));
        got.push_back(random_tensor(ctx, kElements, 7777 + k));  // poison
      }
      // Both ranks post every send before any receive: with one communicator per rank
      // (NCCL orders all its operations) this would deadlock; one per link does not.
      for (const Tensor& x : inputs) t.send(x, peer, send);
      inputs.clear();  // a sent tensor may be dropped at once
      for (Tensor& g : got) t.recv(g, peer, recv);
      t.synchronize(send);
      t.synchronize(recv);
      for (int k = 0; k < kMessages; ++k) {
        const auto want = testing::random_floats(kElements, 100 * peer + k, -3.0f, 3.0f);
        if (!bitwise_equal(to_vector_f32(got[k]), want))
          throw std::runtime_error("message " + std::to_string(k) + " differs");
      }
      // Each rank fills its own slots; the others are zero, so the sums are exact.
      std::vector<double> values(4, 0.0);
      values[2 * r] = 1.0 / (3.0 + r);
      values[2 * r + 1] = -1e10 * (r + 1);
      t.all_reduce_sum(values);
      reduced[r] = values;
    } catch (const std::exception& e) {
      errors[r] = e.what();
      transports[r]->abort(e.what());
    }
  };
  std::thread a(run, 0), b(run, 1);
  a.join();
  b.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  const std::vector<double> want = {1.0 / 3.0, -1e10, 1.0 / 4.0, -2e10};
  EXPECT_EQ(reduced[0], want);
  EXPECT_EQ(reduced[1], want);
}

TEST(NcclGpu, ARankThatNeverJoinsTheAllReduceFailsInsteadOfHanging) {
  CONVEYOR_REQUIRE_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto transports = make_nccl_transports({0, 1}, 500ms);
  const auto start = Clock::now();
  std::string error;
  std::thread lone([&] {
    try {
      CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
      std::vector<double> values = {1.0, 2.0, 3.0};
      transports[0]->all_reduce_sum(values);
    } catch (const TransportError& e) {
      error = e.what();
    }
  });
  lone.join();
  EXPECT_LT(Clock::now() - start, 10s);
  EXPECT_NE(error.find("rank 0"), std::string::npos) << error;
  EXPECT_NE(error.find("500 ms"), std::string::npos) << error;
  // Rank 1 learns of it at its next call.
  std::vector<double> values = {1.0};
  CONVEYOR_CUDA_CHECK(cudaSetDevice(1));
  try {
    transports[1]->all_reduce_sum(values);
    ADD_FAILURE() << "rank 1's all-reduce succeeded after rank 0 aborted";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline aborted"), std::string::npos) << e.what();
    EXPECT_NE(dynamic_cast<const TransportAborted*>(&e), nullptr) << e.what();
  }
  CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
}

TEST(NcclGpu, AOneRankCliqueFromUniqueIdsAllReducesAndCopiesToSelf) {
  CONVEYOR_REQUIRE_GPU();
  EXPECT_THROW(make_nccl_transport_from_ids(0, 1, 0, make_unique_ids(2), 1000ms),
               std::invalid_argument);  // ids for another clique size
  EXPECT_THROW(make_nccl_transport_from_ids(1, 1, 0, make_unique_ids(1), 1000ms),
               std::invalid_argument);
  auto transport = make_nccl_transport_from_ids(0, 1, 0, make_unique_ids(1), 20000ms);
  NcclTransport& t = nccl(transport);
  EXPECT_EQ(t.rank(), 0);
  EXPECT_EQ(t.size(), 1);
  EXPECT_EQ(t.cuda_device(), 0);
  std::vector<double> values = {1.0 / 3.0, -2.5e-300, 7.25e300, -1.0};
  const std::vector<double> want = values;
  t.all_reduce_sum(values);
  EXPECT_EQ(values, want);
  DeviceContext ctx(Device::cuda(0));
  Stream stream(Device::cuda(0));
  Tensor src = random_tensor(ctx, 4097, 5), dst = random_tensor(ctx, 4097, 6);
  t.send_recv_self(src, dst, stream);
  t.synchronize(stream);
  EXPECT_TRUE(bitwise_equal(to_vector_f32(dst), to_vector_f32(src)));
}

// Two "processes" as two threads, each with a clique of its own rank's ends only, as under
// mpirun: the transfers and the all-reduce meet across the cliques, and an abort stays in the
// clique that made it, the peer learning of it through its own deadline.
TEST(NcclGpu, RanksHoldingOnlyTheirOwnEndsExchangeAndAbortAlone) {
  CONVEYOR_REQUIRE_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  constexpr int64_t kElements = int64_t{1} << 20;
  const std::vector<std::string> ids = make_unique_ids(2);
  std::vector<std::unique_ptr<Transport>> transports(2);
  std::vector<std::string> errors(2), late_errors(2);
  std::vector<std::vector<double>> reduced(2);
  std::atomic<int> exchanged{0};
  auto run = [&](int r) {
    try {
      CONVEYOR_CUDA_CHECK(cudaSetDevice(r));
      // Both must be making their communicators at once: each waits for the other.
      transports[r] = make_nccl_transport_from_ids(r, 2, r, ids, 3000ms);
      NcclTransport& t = nccl(transports[r]);
      DeviceContext ctx(Device::cuda(r));
      Stream send(Device::cuda(r)), recv(Device::cuda(r));
      const int peer = 1 - r;
      // Both made before the send: making one synchronizes the device (see the exchange above).
      Tensor x = random_tensor(ctx, kElements, 10 + r);
      Tensor got = random_tensor(ctx, kElements, 999);  // poison
      t.send(x, peer, send);
      t.recv(got, peer, recv);
      t.synchronize(send);
      t.synchronize(recv);
      if (!bitwise_equal(to_vector_f32(got),
                         testing::random_floats(kElements, 10 + peer, -3.0f, 3.0f)))
        throw std::runtime_error("the message differs");
      std::vector<double> values(2, 0.0);
      values[r] = 1.0 / (3.0 + r);
      t.all_reduce_sum(values);
      reduced[r] = values;
      ++exchanged;
      while (exchanged.load() < 2) std::this_thread::sleep_for(1ms);
      if (r == 0) {
        t.abort("rank 0 gives up");
        try {
          t.synchronize(send);
        } catch (const TransportAborted& e) {
          late_errors[0] = e.what();
        }
      } else {
        // Rank 0's abort does not reach this clique: a receive from it waits out the deadline.
        Tensor never = ctx.empty({16});
        t.recv(never, peer, recv);
        try {
          t.synchronize(recv);
        } catch (const TransportAborted&) {
          late_errors[1] = "aborted from the other clique";
        } catch (const TransportError& e) {
          late_errors[1] = e.what();
        }
      }
    } catch (const std::exception& e) {
      errors[r] = e.what();
      if (transports[r]) transports[r]->abort(e.what());
      ++exchanged;
    }
  };
  std::thread a(run, 0), b(run, 1);
  a.join();
  b.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  const std::vector<double> want = {1.0 / 3.0, 1.0 / 4.0};
  EXPECT_EQ(reduced[0], want);
  EXPECT_EQ(reduced[1], want);
  EXPECT_NE(late_errors[0].find("rank 0 gives up"), std::string::npos) << late_errors[0];
  // Its own deadline, or NCCL's report of the broken connection.
  EXPECT_TRUE(late_errors[1].find("did not finish within 3000 ms") != std::string::npos ||
              late_errors[1].find("NCCL error while waiting") != std::string::npos)
      << late_errors[1];
}

#endif  // CONVEYOR_WITH_CUDA

}  // namespace
}  // namespace conveyor::comm
