// Devices, streams, events and the device context on the CPU backend.
#include "engine/core/device.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "engine/core/device_context.h"
#include "engine/core/stream.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

TEST(Device, ParsesAndPrints) {
  EXPECT_EQ(parse_device("cpu"), Device::cpu());
  EXPECT_EQ(parse_device("cuda"), Device::cuda(0));
  EXPECT_EQ(parse_device("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cuda(2).to_string(), "cuda:2");
  EXPECT_EQ(Device::cpu().to_string(), "cpu");
  for (const char* bad : {"", "gpu", "CPU", "cuda:", "cuda:-1", "cuda:-0", "cuda:+1", "cuda: 1",
                          "cuda:0x1", "cuda:1e0", "cuda:1x", "cuda:x", "cuda0"}) {
    EXPECT_THROW(parse_device(bad), std::invalid_argument) << bad;
  }
  try {
    parse_device("gpu");
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'gpu'"), std::string::npos) << e.what();
  }
}

TEST(Device, CountNeverThrowsAndMatchesTheBuild) {
  int count = -1;
  EXPECT_NO_THROW(count = cuda_device_count());
  EXPECT_GE(count, 0);
#ifdef CONVEYOR_WITH_CUDA
  EXPECT_TRUE(built_with_cuda());
#else
  EXPECT_FALSE(built_with_cuda());
  EXPECT_EQ(count, 0);
#endif
}

TEST(Device, CudaMemoryInfoIsUnknownInABuildWithoutCuda) {
#ifdef CONVEYOR_WITH_CUDA
  GTEST_SKIP() << "built with CUDA (core_gpu_tests checks it on a device)";
#else
  const CudaMemoryInfo info = cuda_memory_info(0);
  EXPECT_EQ(info.free_bytes, 0u);
  EXPECT_EQ(info.total_bytes, 0u);
#endif
}

TEST(Stream, CpuStreamsHaveUniqueIdsAndNoHandle) {
  Stream a(Device::cpu()), b(Device::cpu());
  EXPECT_NE(a.id(), 0u);
  EXPECT_NE(a.id(), b.id());
  EXPECT_EQ(a.native(), nullptr);
  const uint64_t id = a.id();
  Stream c(std::move(a));
  EXPECT_EQ(c.id(), id);
  EXPECT_EQ(a.id(), 0u);  // moved-from
  b = std::move(c);
  EXPECT_EQ(b.id(), id);
  b.synchronize();
}

TEST(Event, CpuEventsAreCompleteAndTimeWallClock) {
  Stream s(Device::cpu());
  Event start(Device::cpu()), end(Device::cpu());
  start.record(s);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  end.record(s);
  EXPECT_TRUE(end.query());
  end.synchronize();
  end.wait(s);
  const float ms = Event::elapsed_ms(start, end);
  EXPECT_GE(ms, 19.0f);
  EXPECT_LT(ms, 5000.0f);
}

TEST(Event, CudaObjectsFailClearlyWithoutADevice) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_ANY_THROW(Stream(Device::cuda(0)));
  EXPECT_ANY_THROW(Event(Device::cuda(0)));
  EXPECT_ANY_THROW(make_cuda_allocator(0));
  EXPECT_ANY_THROW(DeviceContext(Device::cuda(0)));
}

// The gpu tests' guard: without a usable device it skips, unless the environment says this
// machine has one (tools/gpu_check.sh), where it fails, so that a broken CUDA set-up cannot
// pass the GPU check as a run of skipped tests.
TEST(Device, GpuTestsFailInsteadOfSkippingWhereADeviceIsExpected) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present";
  const char* saved = std::getenv("CONVEYOR_EXPECT_GPU");
  const std::string kept = saved != nullptr ? saved : "";
  for (const char* unset : {"", "0"}) {
    ::setenv("CONVEYOR_EXPECT_GPU", unset, 1);
    EXPECT_FALSE(conveyor::testing::gpu_expected()) << "'" << unset << "'";
  }
  ::setenv("CONVEYOR_EXPECT_GPU", "1", 1);
  EXPECT_TRUE(conveyor::testing::gpu_expected());
  EXPECT_FATAL_FAILURE(CONVEYOR_REQUIRE_GPU(), "CONVEYOR_EXPECT_GPU says this machine has one");
  if (saved != nullptr)
    ::setenv("CONVEYOR_EXPECT_GPU", kept.c_str(), 1);
  else
    ::unsetenv("CONVEYOR_EXPECT_GPU");
}

TEST(DeviceContext, CpuZerosEmptyAndLimit) {
  DeviceContext ctx(Device::cpu(), DeviceContextOptions{.memory_limit_bytes = 1 << 20});
  EXPECT_FALSE(ctx.is_cuda());
  EXPECT_EQ(ctx.compute_stream().device(), Device::cpu());
  {
    // Dirty a block, give it back, and check zeros() on the reused block really zeroes it.
    Tensor dirty = ctx.empty({256});
    const auto noise = conveyor::testing::random_floats(256, 7, 1.0f, 2.0f);
    copy_from_host(dirty, noise.data(), noise.size() * sizeof(float));
  }
  Tensor z = ctx.zeros({16, 16});
  EXPECT_EQ(ctx.allocator().stats().cache_hits, 1u);
  for (float v : to_vector_f32(z)) ASSERT_EQ(v, 0.0f);
  Tensor i = ctx.zeros({5}, DType::kI32);
  for (int32_t v : to_vector_i32(i)) ASSERT_EQ(v, 0);
  EXPECT_EQ(i.device(), Device::cpu());
  EXPECT_EQ(ctx.allocator_ptr()->stats().limit_bytes, 1u << 20);
  EXPECT_THROW(ctx.empty({1 << 20}), OutOfMemoryError);  // 4 MiB > 1 MiB cap
  EXPECT_THROW(ctx.fill_zero(Tensor()), std::invalid_argument);
  ctx.synchronize();
}

// Contexts given one budget draw from one cap, as the ranks that share a device do.
// A count past the bound is refused before any thread starts: a million exhausted the machine.
TEST(DeviceContext, CpuThreadsOutsideTheirBoundsAreRefused) {
  for (const int threads : {0, -1, DeviceContextOptions::kMaxCpuThreads + 1}) {
    try {
      DeviceContext ctx(Device::cpu(), {.cpu_threads = threads});
      ADD_FAILURE() << threads << " CPU threads were accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()),
                "DeviceContextOptions::cpu_threads must be from 1 to 4096 "
                "on cpu, got " +
                    std::to_string(threads));
    }
  }
  DeviceContext most(Device::cpu(), {.cpu_threads = DeviceContextOptions::kMaxCpuThreads});
  EXPECT_EQ(most.device(), Device::cpu());
}

TEST(DeviceContext, ContextsGivenOneBudgetShareItsCap) {
  auto budget = std::make_shared<MemoryBudget>(1 << 20);
  DeviceContext first(Device::cpu(), {.memory_budget = budget, .allocator_name = "rank 0"});
  DeviceContext second(Device::cpu(), {.memory_limit_bytes = 1 << 20,  // the same: accepted
                                       .memory_budget = budget,
                                       .allocator_name = "rank 1"});
  EXPECT_EQ(first.allocator().budget(), budget);
  EXPECT_EQ(second.allocator().budget(), budget);
  EXPECT_EQ(second.allocator().stats().limit_shared_by, 2);
  Tensor held = first.empty({200 * 1024});  // 800 KiB of the 1 MiB
  try {
    second.empty({100 * 1024});  // 400 KiB: under the cap alone, not beside the first
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 (asking) holds nothing"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(
      DeviceContext(Device::cpu(), {.memory_limit_bytes = 2 << 20, .memory_budget = budget}),
      std::invalid_argument);
}

}  // namespace
}  // namespace conveyor
