// Engine core on a real CUDA device: the stream-ordered reuse hazard the allocator exists to
// prevent, events across streams, device OOM, and the device context with copy round trips.
// Every test skips without a device.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "engine/core/allocator.h"
#include "engine/core/device_context.h"
#include "engine/core/stream.h"
#include "engine/core/tensor.h"
#include "support/test_util.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "engine/core/cuda_device_guard.h"
#include "kernels/cuda_check.h"

namespace conveyor {
namespace {

using conveyor::testing::random_floats;
constexpr size_t MiB = 1 << 20;

// Holds a stream back (a host function that waits on the stream) until released, so that
// work queued behind it is still pending while the test looks at the allocator. The wait gives
// up after 30 s so that a failing test fails instead of hanging.
struct HostGate {
  std::atomic<bool> is_open{false};
  std::atomic<bool> timed_out{false};  // set when the wait gave up: something blocked the host
  void close(const Stream& stream) {
    CONVEYOR_CUDA_CHECK(
        cudaLaunchHostFunc(static_cast<cudaStream_t>(stream.native()), &HostGate::wait, this));
  }
  void open() { is_open = true; }
  static void wait(void* self) {
    auto* gate = static_cast<HostGate*>(self);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!gate->is_open.load() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (!gate->is_open.load()) gate->timed_out = true;
  }
};

// Declared after the streams: opens the gate before they synchronise in their destructors.
struct OpenOnExit {
  HostGate& gate;
  ~OpenOnExit() { gate.open(); }
};

cudaStream_t native(const Stream& s) { return static_cast<cudaStream_t>(s.native()); }

int current_device() {
  int device = -1;
  CONVEYOR_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

TEST(CudaDeviceGuardGpu, RestoresTheCallersDeviceThroughNestedScopes) {
  CONVEYOR_REQUIRE_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  CONVEYOR_CUDA_CHECK(cudaSetDevice(1));
  {
    detail::CudaDeviceGuard outer(0);
    EXPECT_EQ(current_device(), 0);
    {
      detail::CudaDeviceGuard inner(1);
      EXPECT_EQ(current_device(), 1);
    }
    EXPECT_EQ(current_device(), 0);
    {
      detail::CudaDeviceGuard same(0);  // already current: nothing to switch or restore
      EXPECT_EQ(current_device(), 0);
    }
    EXPECT_EQ(current_device(), 0);
  }
  EXPECT_EQ(current_device(), 1);
  // Objects made on another device switch only for their creation.
  Stream peer(Device::cuda(0));
  Event event(Device::cuda(0));
  event.record(peer);
  EXPECT_EQ(current_device(), 1);
  CONVEYOR_CUDA_CHECK(cudaSetDevice(0));
}

// The free and total bytes the memory checks read, with the caller's device left current
// and no CUDA error left behind for the next launch check.
TEST(CudaDeviceGpu, MemoryInfoGivesFreeWithinTotalAndLeavesTheDevice) {
  CONVEYOR_REQUIRE_GPU();
  const int before = current_device();
  const CudaMemoryInfo info = cuda_memory_info(cuda_device_count() - 1);
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_GT(info.free_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);
  EXPECT_EQ(current_device(), before);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaAllocatorGpu, BlockReadByAnotherStreamIsNotReusedUntilThatStreamPasses) {
  CONVEYOR_REQUIRE_GPU();
  HostGate gate;
  auto alloc = make_cuda_allocator(0);
  Stream a(Device::cuda(0)), b(Device::cuda(0));
  OpenOnExit opener{gate};
  const size_t bytes = 4 * MiB;

  void* block = alloc->allocate(bytes, a.native());
  void* spare = alloc->allocate(bytes, a.native());
  void* dst = alloc->allocate(bytes, b.native());
  alloc->deallocate(spare);  // cached for A: what A must get instead of `block`

  std::vector<uint8_t> pattern(bytes);
  for (size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<uint8_t>(i * 31 + 7);
  CONVEYOR_CUDA_CHECK(
      cudaMemcpyAsync(block, pattern.data(), bytes, cudaMemcpyHostToDevice, native(a)));
  a.synchronize();

  // B reads `block`, but only once the gate opens.
  gate.close(b);
  CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(dst, block, bytes, cudaMemcpyDeviceToDevice, native(b)));
  alloc->record_stream(block, b.native());
  alloc->deallocate(block);

  void* next = alloc->allocate(bytes, a.native());
  EXPECT_NE(next, block) << "a block still read by stream B was handed to stream A";
  EXPECT_EQ(next, spare);
  // Scribble over what A got; had it been `block`, B would copy the scribble.
  CONVEYOR_CUDA_CHECK(cudaMemsetAsync(next, 0xFF, bytes, native(a)));
  a.synchronize();
  gate.open();
  b.synchronize();

  EXPECT_FALSE(gate.timed_out) << "a host call blocked on stream B while its gate was shut";
  std::vector<uint8_t> seen(bytes);
  CONVEYOR_CUDA_CHECK(cudaMemcpy(seen.data(), dst, bytes, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(seen == pattern) << "stream B read data written after the block was reused";

  // B has passed its event: the block is A's again.
  void* again = alloc->allocate(bytes, a.native());
  EXPECT_EQ(again, block);
  const AllocatorStats s = alloc->stats();
  EXPECT_EQ(s.system_allocations, 3u);
  EXPECT_EQ(s.cache_hits, 2u);
  alloc->deallocate(next);
  alloc->deallocate(again);
  alloc->deallocate(dst);
}

TEST(CudaAllocatorGpu, SameStreamReuseDoesNotWaitForTheStream) {
  CONVEYOR_REQUIRE_GPU();
  HostGate gate;
  auto alloc = make_cuda_allocator(0);
  Stream a(Device::cuda(0)), b(Device::cuda(0));
  OpenOnExit opener{gate};
  // Both blocks come from cudaMalloc before A is held back, so nothing below can block on A.
  void* p = alloc->allocate(MiB, a.native());
  void* q = alloc->allocate(MiB, b.native());
  alloc->deallocate(q);
  gate.close(a);  // A is busy...
  CONVEYOR_CUDA_CHECK(cudaMemsetAsync(p, 1, MiB, native(a)));
  alloc->deallocate(p);
  EXPECT_EQ(alloc->allocate(MiB, a.native()), p);  // ...yet its own block comes back at once
  alloc->deallocate(p);
  EXPECT_EQ(alloc->allocate(MiB, b.native()), q);  // B never takes A's cached block
  EXPECT_EQ(alloc->stats().system_allocations, 2u);
  gate.open();
  a.synchronize();
  EXPECT_FALSE(gate.timed_out);
  alloc->deallocate(q);
}

// The in-process transport marks a sender's block as read by the receiver's stream, which
// lives on the receiver's GPU. The free-time event must be made on that stream's device, or
// recording it fails and the block is never freed.
TEST(CudaAllocatorGpu, BlockReadByAStreamOfAnotherDeviceIsFreedAndReused) {
  CONVEYOR_REQUIRE_GPU();
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto alloc = make_cuda_allocator(0);
  Stream a(Device::cuda(0)), peer(Device::cuda(1));
  void* block = alloc->allocate(MiB, a.native());
  alloc->record_stream(block, peer.native());
  EXPECT_NO_THROW(alloc->deallocate(block));
  EXPECT_EQ(alloc->stats().allocated_bytes, 0u);
  peer.synchronize();
  EXPECT_EQ(alloc->allocate(MiB, a.native()), block);  // the peer has passed its event
  int current = -1;
  CONVEYOR_CUDA_CHECK(cudaGetDevice(&current));
  EXPECT_EQ(current, 0) << "recording on the peer's device must not move this thread";
  alloc->deallocate(block);
}

TEST(CudaAllocatorGpu, CapAndDeviceOutOfMemory) {
  CONVEYOR_REQUIRE_GPU();
  auto alloc = make_cuda_allocator(0, 8 * MiB);
  void* p = alloc->allocate(6 * MiB);
  try {
    alloc->allocate(4 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("on cuda:0"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("request of 4194304 bytes"), std::string::npos);
  }
  alloc->deallocate(p);
  alloc->set_limit(0);
  // More than any GPU has: cudaMalloc fails, which must become OutOfMemoryError and leave
  // CUDA usable (the error is not sticky).
  EXPECT_THROW(alloc->allocate(size_t{1} << 44), OutOfMemoryError);
  void* q = alloc->allocate(MiB);
  CONVEYOR_CUDA_CHECK(cudaMemset(q, 0, MiB));
  CONVEYOR_CUDA_CHECK(cudaDeviceSynchronize());
  alloc->deallocate(q);
}

TEST(CudaStreamGpu, EventsOrderStreamsAndTime) {
  CONVEYOR_REQUIRE_GPU();
  HostGate gate;
  Stream a(Device::cuda(0)), b(Device::cuda(0));
  OpenOnExit opener{gate};
  EXPECT_NE(a.native(), nullptr);
  EXPECT_NE(a.id(), b.id());
  Event eb(Device::cuda(0), /*timing=*/false), ea(Device::cuda(0), false);
  gate.close(b);
  eb.record(b);
  EXPECT_FALSE(eb.query());
  eb.wait(a);  // A now waits for B's gate
  ea.record(a);
  EXPECT_FALSE(ea.query());
  gate.open();
  ea.synchronize();
  EXPECT_FALSE(gate.timed_out);
  EXPECT_TRUE(eb.query());
  EXPECT_TRUE(ea.query());

  auto alloc = make_cuda_allocator(0);
  void* p = alloc->allocate(64 * MiB, a.native());
  Event start(Device::cuda(0)), end(Device::cuda(0));
  start.record(a);
  CONVEYOR_CUDA_CHECK(cudaMemsetAsync(p, 3, 64 * MiB, native(a)));
  end.record(a);
  end.synchronize();
  const float ms = Event::elapsed_ms(start, end);
  EXPECT_GT(ms, 0.0f);
  EXPECT_LT(ms, 1000.0f);
  alloc->deallocate(p);
}

TEST(DeviceContextGpu, HoldsStreamHandleWorkspaceAndSetsTheDevice) {
  CONVEYOR_REQUIRE_GPU();
  DeviceContext ctx(Device::cuda(0));
  EXPECT_TRUE(ctx.is_cuda());
  int current = -1;
  CONVEYOR_CUDA_CHECK(cudaGetDevice(&current));
  EXPECT_EQ(current, 0);
  EXPECT_EQ(static_cast<void*>(ctx.cuda().stream), ctx.compute_stream().native());
  EXPECT_NE(ctx.cuda().cublaslt, nullptr);
  EXPECT_NE(ctx.cuda().workspace, nullptr);
  EXPECT_EQ(ctx.cuda().workspace_bytes, size_t{32} << 20);
  EXPECT_EQ(ctx.allocator().stats().allocated_bytes, size_t{32} << 20);

  void* s1 = ctx.scratch(1000);
  EXPECT_EQ(ctx.scratch(500), s1);  // big enough already
  void* s2 = ctx.scratch(16 * MiB);
  ASSERT_NE(s2, nullptr);
  CONVEYOR_CUDA_CHECK(cudaMemsetAsync(s2, 0, 16 * MiB, ctx.cuda().stream));
  ctx.synchronize();

  DeviceContext small(Device::cuda(0), DeviceContextOptions{.memory_limit_bytes = 48 * MiB});
  EXPECT_THROW(small.empty({int64_t{8} << 20}), OutOfMemoryError);  // 32 MiB + 32 MiB > 48
}

TEST(DeviceContextGpu, CopyRoundTripsAreBitExact) {
  CONVEYOR_REQUIRE_GPU();
  DeviceContext ctx(Device::cuda(0));
  const auto host = random_floats(3 * 1000, 11);
  Tensor d1 = ctx.empty({3, 1000});
  copy_from_host(d1, host.data(), host.size() * sizeof(float));
  EXPECT_EQ(d1.device(), Device::cuda(0));
  EXPECT_EQ(to_vector_f32(d1), host);

  // Device to device on the compute stream, then to the CPU on it and without a stream.
  Tensor d2 = ctx.empty({3000});
  copy_tensor(d2, d1, ctx.compute_stream().native());
  auto cpu_alloc = make_cpu_allocator();
  Tensor c1 = Tensor::empty({3000}, DType::kF32, cpu_alloc);
  copy_tensor(c1, d2, ctx.compute_stream().native());
  EXPECT_EQ(to_vector_f32(c1), host);
  Tensor c2 = Tensor::empty({3, 1000}, DType::kF32, cpu_alloc);
  copy_tensor(c2, d2);
  EXPECT_EQ(to_vector_f32(c2), host);

  // A row slice on the device.
  const auto row = to_vector_f32(d1.slice_rows(1, 1));
  EXPECT_TRUE(std::equal(row.begin(), row.end(), host.begin() + 1000));

  // CPU to device with a side stream.
  Stream side(Device::cuda(0));
  Tensor d3 = ctx.empty({3000});
  record_stream(d3, side.native());  // made for the compute stream, written on `side`
  copy_tensor(d3, c1, side.native());
  EXPECT_EQ(to_vector_f32(d3), host);

  // bf16 and i32 keep their bits.
  std::vector<uint16_t> bf(host.size());
  for (size_t i = 0; i < bf.size(); ++i) bf[i] = float_to_bf16(host[i]);
  Tensor db = ctx.empty({3000}, DType::kBF16);
  copy_from_host(db, bf.data(), bf.size() * 2);
  std::vector<uint16_t> bf_back(bf.size());
  copy_to_host(bf_back.data(), db, bf_back.size() * 2);
  EXPECT_EQ(bf_back, bf);
  const auto ints = conveyor::testing::random_ints(777, 12, -100000, 100000);
  Tensor di = ctx.empty({777}, DType::kI32);
  copy_from_host(di, ints.data(), ints.size() * 4);
  EXPECT_EQ(to_vector_i32(di), ints);
}

// A host copy given a stream waits for that stream alone: another stream of the device may
// hold a transfer that waits for a peer (NCCL), which may wait for this very rank.
TEST(DeviceContextGpu, HostCopiesOnAStreamDoNotWaitForTheOtherStreams) {
  CONVEYOR_REQUIRE_GPU();
  HostGate gate;
  DeviceContext ctx(Device::cuda(0));
  Stream held(Device::cuda(0));
  OpenOnExit opener{gate};
  const auto host = random_floats(4096, 21);
  Tensor t = ctx.empty({4096});
  gate.close(held);  // until the gate opens, a wait for the whole device would block
  copy_from_host(t, host.data(), t.nbytes(), ctx.compute_stream().native());
  std::vector<float> back(host.size());
  copy_to_host(back.data(), t, t.nbytes(), ctx.compute_stream().native());
  EXPECT_FALSE(held.query()) << "the held stream finished before its gate opened";
  gate.open();
  held.synchronize();
  EXPECT_FALSE(gate.timed_out) << "a copy on the compute stream waited for another stream";
  EXPECT_EQ(back, host);
}

TEST(DeviceContextGpu, ZerosClearsAReusedDirtyBlock) {
  CONVEYOR_REQUIRE_GPU();
  DeviceContext ctx(Device::cuda(0));
  const auto noise = random_floats(1 << 16, 13, 1.0f, 2.0f);
  {
    Tensor dirty = ctx.empty({1 << 16});
    copy_from_host(dirty, noise.data(), noise.size() * sizeof(float));
  }
  const uint64_t hits = ctx.allocator().stats().cache_hits;
  Tensor z = ctx.zeros({1 << 16});
  EXPECT_EQ(ctx.allocator().stats().cache_hits, hits + 1);
  for (float v : to_vector_f32(z)) ASSERT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace conveyor
#endif  // CONVEYOR_WITH_CUDA
