// Caching allocator on the CPU: exact counters, bucket reuse, the cap, and stream-ordered
// reuse driven by a fake backend whose events complete only when the test says so.
#include "engine/core/allocator.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <thread>

namespace conveyor {
namespace {

constexpr size_t KiB = 1024;
constexpr size_t MiB = 1024 * 1024;

void* fake_stream(uintptr_t n) { return reinterpret_cast<void*>(0x1000 * n); }
void* const kStreamA = fake_stream(1);
void* const kStreamB = fake_stream(2);
void* const kStreamC = fake_stream(3);

struct FakeEvent {
  void* stream;
  bool done = false;
};

// What the test sees of the fake device.
struct FakeState {
  size_t capacity = SIZE_MAX;  // system bytes the fake device can hand out
  size_t system_bytes = 0;
  int system_frees = 0;
  bool synchronize_completes = false;  // whether synchronize_event waits (marks done)
  int synchronize_calls = 0;           // host waits for an event
  std::map<void*, size_t> blocks;
  std::vector<FakeEvent*> events;  // live events
  int events_created = 0;

  void complete(void* stream) {
    for (FakeEvent* e : events)
      if (e->stream == stream) e->done = true;
  }
};

class FakeBackend final : public AllocatorBackend {
 public:
  explicit FakeBackend(std::shared_ptr<FakeState> state) : s_(std::move(state)) {}
  ~FakeBackend() override {
    for (FakeEvent* e : s_->events) delete e;
    s_->events.clear();
  }
  Device device() const override { return Device::cpu(); }
  void* system_allocate(size_t bytes) override {
    if (s_->system_bytes + bytes > s_->capacity) return nullptr;
    void* p = std::aligned_alloc(64, bytes);
    s_->blocks[p] = bytes;
    s_->system_bytes += bytes;
    return p;
  }
  void system_free(void* ptr) override {
    auto it = s_->blocks.find(ptr);
    ASSERT_NE(it, s_->blocks.end()) << "freed a pointer the backend never gave out";
    s_->system_bytes -= it->second;
    s_->blocks.erase(it);
    ++s_->system_frees;
    std::free(ptr);
  }
  void* record_event(void* stream) override {
    auto* e = new FakeEvent{stream};
    s_->events.push_back(e);
    ++s_->events_created;
    return e;
  }
  bool event_done(void* event) override { return static_cast<FakeEvent*>(event)->done; }
  void destroy_event(void* event) override {
    auto* e = static_cast<FakeEvent*>(event);
    std::erase(s_->events, e);
    delete e;
  }
  void synchronize_event(void* event) override {
    ++s_->synchronize_calls;
    if (s_->synchronize_completes) static_cast<FakeEvent*>(event)->done = true;
  }

 private:
  std::shared_ptr<FakeState> s_;
};

struct FakeAllocator {
  std::shared_ptr<FakeState> state = std::make_shared<FakeState>();
  CachingAllocator alloc;
  explicit FakeAllocator(size_t limit = 0) : alloc(std::make_unique<FakeBackend>(state), limit) {}
};

// Compares every counter, so that any wrong one fails with its name.
void expect_stats(const AllocatorStats& s, size_t allocated, size_t peak_allocated, size_t reserved,
                  size_t peak_reserved, uint64_t system_allocations, uint64_t requests,
                  uint64_t cache_hits) {
  EXPECT_EQ(s.allocated_bytes, allocated);
  EXPECT_EQ(s.peak_allocated_bytes, peak_allocated);
  EXPECT_EQ(s.reserved_bytes, reserved);
  EXPECT_EQ(s.peak_reserved_bytes, peak_reserved);
  EXPECT_EQ(s.system_allocations, system_allocations);
  EXPECT_EQ(s.requests, requests);
  EXPECT_EQ(s.cache_hits, cache_hits);
}

TEST(CachingAllocator, RoundsSmallTo512AndLargeTo2MiB) {
  EXPECT_EQ(CachingAllocator::round_size(0), 512u);
  EXPECT_EQ(CachingAllocator::round_size(1), 512u);
  EXPECT_EQ(CachingAllocator::round_size(512), 512u);
  EXPECT_EQ(CachingAllocator::round_size(513), 1024u);
  EXPECT_EQ(CachingAllocator::round_size(1000), 1024u);
  EXPECT_EQ(CachingAllocator::round_size(1 * MiB), 1 * MiB);  // still "small"
  EXPECT_EQ(CachingAllocator::round_size(1 * MiB + 1), 2 * MiB);
  EXPECT_EQ(CachingAllocator::round_size(2 * MiB), 2 * MiB);
  EXPECT_EQ(CachingAllocator::round_size(2 * MiB + 1), 4 * MiB);
  EXPECT_EQ(CachingAllocator::round_size(5 * MiB), 6 * MiB);
}

TEST(CachingAllocator, CountersAreExactThroughAllocFreeReuseAndRelease) {
  auto alloc = make_cpu_allocator();
  void* a = alloc->allocate(1000);  // 1 KiB block
  expect_stats(alloc->stats(), 1 * KiB, 1 * KiB, 1 * KiB, 1 * KiB, 1, 1, 0);
  void* b = alloc->allocate(3 * MiB);  // 4 MiB block
  const size_t both = 4 * MiB + 1 * KiB;
  expect_stats(alloc->stats(), both, both, both, both, 2, 2, 0);
  EXPECT_EQ(alloc->block_size(a), 1 * KiB);
  EXPECT_EQ(alloc->block_size(b), 4 * MiB);

  alloc->deallocate(a);  // cached: still reserved
  expect_stats(alloc->stats(), 4 * MiB, both, both, both, 2, 2, 0);
  void* c = alloc->allocate(600);  // same 1 KiB bucket
  EXPECT_EQ(c, a);
  expect_stats(alloc->stats(), both, both, both, both, 2, 3, 1);

  alloc->deallocate(b);
  alloc->deallocate(c);
  expect_stats(alloc->stats(), 0, both, both, both, 2, 3, 1);
  alloc->reset_peak();
  expect_stats(alloc->stats(), 0, 0, both, both, 2, 3, 1);

  void* d = alloc->allocate(4 * MiB);  // the 4 MiB bucket
  EXPECT_EQ(d, b);
  expect_stats(alloc->stats(), 4 * MiB, 4 * MiB, both, both, 2, 4, 2);
  alloc->release_cache();  // frees the cached 1 KiB block only
  expect_stats(alloc->stats(), 4 * MiB, 4 * MiB, 4 * MiB, both, 2, 4, 2);
  alloc->deallocate(d);
  alloc->release_cache();
  expect_stats(alloc->stats(), 0, 4 * MiB, 0, both, 2, 4, 2);
}

TEST(CachingAllocator, DifferentBucketsAreNotShared) {
  auto alloc = make_cpu_allocator();
  void* a = alloc->allocate(512);
  alloc->deallocate(a);
  void* b = alloc->allocate(1024);  // another bucket: a fresh system allocation
  EXPECT_NE(a, b);
  expect_stats(alloc->stats(), 1024, 1024, 1536, 1536, 2, 2, 0);
  alloc->deallocate(b);
}

TEST(CachingAllocator, ZeroBytesGivesDistinctAlignedPointers) {
  auto alloc = make_cpu_allocator();
  void* a = alloc->allocate(0);
  void* b = alloc->allocate(0);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a, b);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  alloc->deallocate(a);
  alloc->deallocate(b);
}

TEST(CachingAllocator, BadPointersAreRejected) {
  auto alloc = make_cpu_allocator();
  int local = 0;
  EXPECT_THROW(alloc->deallocate(&local), std::invalid_argument);
  EXPECT_THROW(alloc->block_size(&local), std::invalid_argument);
  EXPECT_THROW(alloc->record_stream(&local, nullptr), std::invalid_argument);
  void* a = alloc->allocate(10);
  alloc->deallocate(a);
  EXPECT_THROW(alloc->deallocate(a), std::invalid_argument);  // double free
  alloc->deallocate(nullptr);                                 // a no-op
  EXPECT_EQ(alloc->stats().allocated_bytes, 0u);
}

TEST(CachingAllocator, CapThrowsOutOfMemoryNamingRequestDeviceAndStats) {
  auto alloc = make_cpu_allocator(5 * MiB);
  void* a = alloc->allocate(3 * MiB);  // 4 MiB of the 5
  try {
    alloc->allocate(2 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("on cpu"), std::string::npos) << msg;
    EXPECT_NE(msg.find("request of 2097152 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("limit would be exceeded"), std::string::npos) << msg;
    EXPECT_NE(msg.find(alloc->stats().to_string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("allocated 4.00 MiB (4194304 B)"), std::string::npos) << msg;
    EXPECT_NE(msg.find("limit 5.00 MiB (5242880 B)"), std::string::npos) << msg;
  }
  // A failed request leaves the allocator usable and its counters unchanged.
  expect_stats(alloc->stats(), 4 * MiB, 4 * MiB, 4 * MiB, 4 * MiB, 1, 2, 0);
  void* small = alloc->allocate(100);
  alloc->deallocate(small);
  alloc->deallocate(a);
  alloc->set_limit(0);
  void* big = alloc->allocate(64 * MiB);  // no cap any more
  alloc->deallocate(big);
}

TEST(CachingAllocator, CapReleasesTheCacheAndRetries) {
  FakeAllocator f(4 * MiB);
  void* a = f.alloc.allocate(2 * MiB);
  f.alloc.deallocate(a);                // cached: 2 MiB reserved, 0 allocated
  void* b = f.alloc.allocate(4 * MiB);  // fits only once the cache is given back
  EXPECT_EQ(f.state->system_frees, 1);
  expect_stats(f.alloc.stats(), 4 * MiB, 4 * MiB, 4 * MiB, 4 * MiB, 2, 2, 0);
  EXPECT_EQ(f.state->system_bytes, 4 * MiB);
  f.alloc.deallocate(b);
}

TEST(CachingAllocator, SystemOutOfMemoryReleasesTheCacheRetriesThenThrows) {
  FakeAllocator f;
  f.state->capacity = 4 * MiB;
  void* a = f.alloc.allocate(2 * MiB);
  f.alloc.deallocate(a);
  void* b = f.alloc.allocate(4 * MiB);  // the device is full until the cache is released
  EXPECT_EQ(f.state->system_frees, 1);
  try {
    f.alloc.allocate(2 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("request of 2097152 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("no free memory left"), std::string::npos) << msg;
    EXPECT_NE(msg.find("limit none"), std::string::npos) << msg;
  }
  f.alloc.deallocate(b);
}

// With communication kernels on the device, freeing the cache (a device-wide synchronisation
// on CUDA) could deadlock the ranks: the allocator fails the request and keeps its cache.
TEST(CachingAllocator, SystemOutOfMemoryKeepsTheCacheWhileCommunicationKernelsMayRun) {
  FakeAllocator f;
  f.state->capacity = 4 * MiB;
  void* a = f.alloc.allocate(2 * MiB);
  void* b = f.alloc.allocate(2 * MiB);
  f.alloc.deallocate(a);  // cached; the device is full
  EXPECT_FALSE(f.alloc.device_may_run_communication_kernels());
  f.alloc.set_device_may_run_communication_kernels(true);
  EXPECT_TRUE(f.alloc.device_may_run_communication_kernels());
  try {
    f.alloc.allocate(4 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("request of 4194304 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("no free memory left"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2.00 MiB (2097152 B) of cached blocks were not returned"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("communication kernels"), std::string::npos) << msg;
    EXPECT_NE(msg.find("release_cache()"), std::string::npos) << msg;
  }
  EXPECT_EQ(f.state->system_frees, 0);
  EXPECT_EQ(f.state->system_bytes, 4 * MiB);
  EXPECT_EQ(f.alloc.allocate(2 * MiB), a) << "the cache must survive the failed request";
  f.alloc.deallocate(a);

  // Without communication kernels the same request frees the cache and succeeds.
  f.alloc.set_device_may_run_communication_kernels(false);
  f.alloc.deallocate(b);
  void* c = f.alloc.allocate(4 * MiB);
  EXPECT_EQ(f.state->system_frees, 2);
  f.alloc.deallocate(c);
}

TEST(CachingAllocator, CapNeitherFreesNorWaitsWhileCommunicationKernelsMayRun) {
  FakeAllocator f(2 * KiB);
  f.state->synchronize_completes = true;
  void* a = f.alloc.allocate(1000, kStreamA);
  void* b = f.alloc.allocate(1000, kStreamA);
  f.alloc.record_stream(a, kStreamB);
  f.alloc.deallocate(a);  // waits for B
  f.alloc.deallocate(b);  // cached
  f.alloc.set_device_may_run_communication_kernels(true);
  try {
    f.alloc.allocate(2000, kStreamC);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("limit would be exceeded"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(1024 B) of cached blocks were not returned"), std::string::npos) << msg;
    EXPECT_NE(msg.find("(1024 B) of freed blocks still wait for other streams"), std::string::npos)
        << msg;
  }
  EXPECT_EQ(f.state->system_frees, 0);
  EXPECT_EQ(f.state->synchronize_calls, 0) << "the host must not wait for another stream";
  EXPECT_EQ(f.state->events.size(), 1u);
  expect_stats(f.alloc.stats(), 0, 2 * KiB, 2 * KiB, 2 * KiB, 2, 3, 0);

  // A request that fits without releasing anything still succeeds.
  EXPECT_EQ(f.alloc.allocate(1000, kStreamA), b);
  f.alloc.deallocate(b);
  // Once the flag is cleared the cap path waits for B and frees both blocks.
  f.alloc.set_device_may_run_communication_kernels(false);
  void* c = f.alloc.allocate(2000, kStreamC);
  EXPECT_EQ(f.state->system_frees, 2);
  EXPECT_EQ(f.state->synchronize_calls, 1);
  f.alloc.deallocate(c);
}

TEST(CachingAllocator, SameStreamReuseIsImmediate) {
  FakeAllocator f;
  void* a = f.alloc.allocate(1000, kStreamA);
  f.alloc.deallocate(a);
  EXPECT_EQ(f.alloc.allocate(1000, kStreamA), a);
  EXPECT_EQ(f.state->events_created, 0);
  EXPECT_EQ(f.alloc.stats().cache_hits, 1u);
  // Recording the block's own stream changes nothing: still no event, still immediate.
  f.alloc.record_stream(a, kStreamA);
  f.alloc.deallocate(a);
  EXPECT_EQ(f.state->events_created, 0);
  EXPECT_EQ(f.alloc.allocate(1000, kStreamA), a);
  f.alloc.deallocate(a);
}

TEST(CachingAllocator, AnotherStreamDoesNotTakeACachedBlock) {
  FakeAllocator f;
  void* a = f.alloc.allocate(1000, kStreamA);
  f.alloc.deallocate(a);
  void* b = f.alloc.allocate(1000, kStreamB);
  EXPECT_NE(b, a);
  expect_stats(f.alloc.stats(), 1024, 1024, 2048, 2048, 2, 2, 0);
  f.alloc.deallocate(b);
}

TEST(CachingAllocator, BlockUsedOnAnotherStreamWaitsForThatStreamsEvent) {
  FakeAllocator f;
  void* a = f.alloc.allocate(1000, kStreamA);
  f.alloc.record_stream(a, kStreamB);
  f.alloc.record_stream(a, kStreamB);  // recorded once
  f.alloc.deallocate(a);
  ASSERT_EQ(f.state->events.size(), 1u);
  EXPECT_EQ(f.state->events[0]->stream, kStreamB);
  EXPECT_EQ(f.alloc.stats().allocated_bytes, 0u);  // freed, but not reusable yet
  EXPECT_EQ(f.alloc.stats().reserved_bytes, 1024u);

  void* b = f.alloc.allocate(1000, kStreamA);  // B may still read a
  EXPECT_NE(b, a);
  f.alloc.deallocate(b);  // b goes to the cache (LIFO top)
  EXPECT_EQ(f.alloc.allocate(1000, kStreamA), b);

  f.state->complete(kStreamB);
  void* c = f.alloc.allocate(1000, kStreamA);  // B passed its event: a is reusable
  EXPECT_EQ(c, a);
  EXPECT_TRUE(f.state->events.empty()) << "completed events must be destroyed";
  expect_stats(f.alloc.stats(), 2048, 2048, 2048, 2048, 2, 4, 2);
  f.alloc.deallocate(b);
  f.alloc.deallocate(c);
}

TEST(CachingAllocator, BlockUsedOnTwoStreamsWaitsForBoth) {
  FakeAllocator f;
  void* a = f.alloc.allocate(1000, kStreamA);
  f.alloc.record_stream(a, kStreamB);
  f.alloc.record_stream(a, kStreamC);
  f.alloc.deallocate(a);
  EXPECT_EQ(f.state->events.size(), 2u);
  f.state->complete(kStreamB);
  void* b = f.alloc.allocate(1000, kStreamA);
  EXPECT_NE(b, a);  // C has not passed yet
  EXPECT_EQ(f.state->events.size(), 1u);
  f.state->complete(kStreamC);
  void* c = f.alloc.allocate(1000, kStreamA);
  EXPECT_EQ(c, a);
  EXPECT_TRUE(f.state->events.empty());
  f.alloc.deallocate(b);
  f.alloc.deallocate(c);
}

TEST(CachingAllocator, ReleaseCacheKeepsBlocksThatWaitForOtherStreams) {
  FakeAllocator f;
  void* a = f.alloc.allocate(1000, kStreamA);
  f.alloc.record_stream(a, kStreamB);
  f.alloc.deallocate(a);
  f.alloc.release_cache();
  EXPECT_EQ(f.state->system_frees, 0);  // B may still use it
  EXPECT_EQ(f.alloc.stats().reserved_bytes, 1024u);
  f.state->complete(kStreamB);
  f.alloc.release_cache();
  EXPECT_EQ(f.state->system_frees, 1);
  EXPECT_EQ(f.alloc.stats().reserved_bytes, 0u);
}

TEST(CachingAllocator, CapWaitsForPendingBlocksWhenTheBackendCan) {
  FakeAllocator f(1 * KiB);
  f.state->synchronize_completes = true;
  void* a = f.alloc.allocate(1000, kStreamA);
  f.alloc.record_stream(a, kStreamB);
  f.alloc.deallocate(a);
  void* b = f.alloc.allocate(1000, kStreamC);  // needs a's bytes: waits for B, frees a
  EXPECT_EQ(f.state->system_frees, 1);
  EXPECT_TRUE(f.state->events.empty());
  expect_stats(f.alloc.stats(), 1024, 1024, 1024, 1024, 2, 2, 0);
  f.alloc.deallocate(b);
}

TEST(CachingAllocator, CapOutOfMemoryMentionsBlocksStillWaiting) {
  FakeAllocator f(1 * KiB);  // synchronize_event cannot wait here
  void* a = f.alloc.allocate(1000, kStreamA);
  f.alloc.record_stream(a, kStreamB);
  f.alloc.deallocate(a);
  try {
    f.alloc.allocate(1000, kStreamA);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("still wait for other streams"), std::string::npos)
        << e.what();
  }
  f.state->complete(kStreamB);
  EXPECT_EQ(f.alloc.allocate(1000, kStreamA), a);
  f.alloc.deallocate(a);
}

TEST(CachingAllocator, DestructorReturnsCachedAndPendingBlocksAndEvents) {
  auto state = std::make_shared<FakeState>();
  state->synchronize_completes = true;
  {
    CachingAllocator alloc(std::make_unique<FakeBackend>(state));
    void* a = alloc.allocate(1000, kStreamA);
    void* b = alloc.allocate(3 * MiB, kStreamA);
    alloc.record_stream(b, kStreamB);
    alloc.deallocate(a);
    alloc.deallocate(b);
    EXPECT_EQ(state->system_bytes, 1 * KiB + 4 * MiB);
  }
  EXPECT_EQ(state->system_bytes, 0u);
  EXPECT_EQ(state->system_frees, 2);
  EXPECT_TRUE(state->events.empty());
}

TEST(CachingAllocator, ConcurrentAllocFreeKeepsCountersConsistent) {
  auto alloc = make_cpu_allocator();
  constexpr int kThreads = 4, kIters = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kIters; ++i) {
        void* p = alloc->allocate(static_cast<size_t>(64 * (1 + (i + t) % 7)));
        static_cast<char*>(p)[0] = static_cast<char>(i);
        alloc->deallocate(p);
      }
    });
  }
  for (auto& th : threads) th.join();
  const AllocatorStats s = alloc->stats();
  EXPECT_EQ(s.allocated_bytes, 0u);
  EXPECT_EQ(s.requests, static_cast<uint64_t>(kThreads * kIters));
  EXPECT_EQ(s.cache_hits + s.system_allocations, s.requests);
  EXPECT_LE(s.system_allocations, static_cast<uint64_t>(kThreads));  // one bucket of 512 B
  EXPECT_EQ(s.reserved_bytes, s.system_allocations * 512);
}

}  // namespace
}  // namespace conveyor
