// Caching allocator on the CPU: exact counters, bucket reuse, the cap (an allocator's own, or
// one shared by the allocators of a device), and stream-ordered reuse driven by a fake backend
// whose events complete only when the test says so.
#include "engine/core/allocator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <random>
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
  Device device = Device::cpu();
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
  Device device() const override { return s_->device; }
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
    EXPECT_EQ(msg.find("shared"), std::string::npos)
        << "the cap is this allocator's alone: " << msg;
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

// Two allocators of one device drawing from one cap, as the ranks that share a device in one
// process do (the executor names them "rank r").
struct SharedFakeAllocators {
  std::shared_ptr<MemoryBudget> budget;
  std::shared_ptr<FakeState> a_state = std::make_shared<FakeState>();
  std::shared_ptr<FakeState> b_state = std::make_shared<FakeState>();
  CachingAllocator a, b;
  explicit SharedFakeAllocators(size_t limit)
      : budget(std::make_shared<MemoryBudget>(limit)),
        a(std::make_unique<FakeBackend>(a_state), budget, "rank 0"),
        b(std::make_unique<FakeBackend>(b_state), budget, "rank 1") {}
};

TEST(MemoryBudget, TwoAllocatorsOnOneBudgetCannotTogetherExceedIt) {
  SharedFakeAllocators f(4 * MiB);
  EXPECT_EQ(f.budget->allocators(), 2);
  void* a = f.a.allocate(2 * MiB);
  void* b = f.b.allocate(2 * MiB);
  EXPECT_EQ(f.budget->reserved_bytes(), 4 * MiB);
  // Each holds 2 of the 4 MiB: alone either would take 512 B more, together neither may.
  EXPECT_THROW(f.b.allocate(512), OutOfMemoryError);
  EXPECT_THROW(f.a.allocate(512), OutOfMemoryError);
  EXPECT_EQ(f.a_state->system_bytes + f.b_state->system_bytes, 4 * MiB);
  EXPECT_EQ(f.budget->reserved_bytes(), 4 * MiB) << "a failed request takes nothing";
  const AllocatorStats s = f.a.stats();
  expect_stats(s, 2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB, 1, 2, 0);
  EXPECT_EQ(s.limit_bytes, 4 * MiB);
  EXPECT_EQ(s.limit_shared_by, 2);
  EXPECT_EQ(s.limit_reserved_bytes, 4 * MiB);
  // The limit is the budget's: lifting it through one allocator lifts it for both.
  f.a.set_limit(0);
  EXPECT_EQ(f.budget->limit_bytes(), 0u);
  void* more = f.b.allocate(6 * MiB);
  f.b.deallocate(more);
  f.a.deallocate(a);
  f.b.deallocate(b);
}

TEST(MemoryBudget, WhatOneAllocatorGivesBackTheOtherCanTake) {
  SharedFakeAllocators f(4 * MiB);
  void* a = f.a.allocate(3 * MiB);  // a 4 MiB block: the whole budget
  EXPECT_THROW(f.b.allocate(1000), OutOfMemoryError);
  f.a.deallocate(a);  // cached: still a's
  EXPECT_THROW(f.b.allocate(1000), OutOfMemoryError) << "another allocator's cache is not taken";
  EXPECT_EQ(f.a_state->system_frees, 0);
  f.a.release_cache();
  EXPECT_EQ(f.budget->reserved_bytes(), 0u);
  void* b = f.b.allocate(1000);
  EXPECT_EQ(f.budget->reserved_bytes(), 1 * KiB);
  // ... and back: a cannot have its 4 MiB again while b holds 1 KiB of the budget.
  EXPECT_THROW(f.a.allocate(3 * MiB), OutOfMemoryError);
  f.b.deallocate(b);
  f.b.release_cache();
  a = f.a.allocate(3 * MiB);
  EXPECT_EQ(f.budget->reserved_bytes(), 4 * MiB);
  f.a.deallocate(a);
}

TEST(MemoryBudget, ARequestThatDoesNotFitReleasesTheRequestersOwnCacheAndRetries) {
  SharedFakeAllocators f(6 * MiB);
  void* a = f.a.allocate(2 * MiB);
  f.a.deallocate(a);                // a's cache: 2 MiB
  void* b = f.b.allocate(2 * MiB);  // b's, live
  // 2 + 2 + 4 MiB pass the 6 MiB: a gives its cache back, then its request fits.
  void* big = f.a.allocate(4 * MiB);
  EXPECT_EQ(f.a_state->system_frees, 1);
  EXPECT_EQ(f.b_state->system_frees, 0);
  EXPECT_EQ(f.budget->reserved_bytes(), 6 * MiB);
  expect_stats(f.a.stats(), 4 * MiB, 4 * MiB, 4 * MiB, 4 * MiB, 2, 2, 0);
  // The other allocator's cache is never released for it.
  f.b.deallocate(b);
  EXPECT_THROW(f.a.allocate(2 * MiB), OutOfMemoryError);
  EXPECT_EQ(f.b_state->system_frees, 0);
  // A cache hit takes nothing more from the budget: b reuses its block at the limit.
  EXPECT_EQ(f.b.allocate(2 * MiB), b);
  f.a.deallocate(big);
  f.b.deallocate(b);
}

// Under a shared cap as under an allocator's own: while communication kernels may run, the
// requester keeps its cache (returning it would synchronise the device) and the request fails.
TEST(MemoryBudget, TheRequestersCacheStaysWhileCommunicationKernelsMayRun) {
  SharedFakeAllocators f(4 * MiB);
  void* a = f.a.allocate(2 * MiB);
  f.a.deallocate(a);
  void* b = f.b.allocate(2 * MiB);
  f.a.set_device_may_run_communication_kernels(true);
  try {
    f.a.allocate(4 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("limit would be exceeded; the limit of 4.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("of cached blocks were not returned"), std::string::npos) << msg;
  }
  EXPECT_EQ(f.a_state->system_frees, 0);
  EXPECT_EQ(f.a.allocate(2 * MiB), a) << "the cache must survive the failed request";
  f.a.deallocate(a);
  f.b.deallocate(b);
}

TEST(MemoryBudget, OutOfMemoryNamesTheSharedCapAndWhatEachAllocatorHolds) {
  SharedFakeAllocators f(3 * MiB);
  void* a = f.a.allocate(1 * MiB);
  f.a.deallocate(f.a.allocate(1000));  // 1 KiB of a's is cached
  void* b = f.b.allocate(1 * MiB);
  try {
    f.b.allocate(2 * MiB);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of memory on cpu: cannot allocate 2.00 MiB (2097152 B) (request of "
                       "2097152 bytes, 2097152 bytes after rounding): the memory limit would be "
                       "exceeded; the limit of 3.00 MiB (3145728 B) is shared by the 2 "
                       "allocators of cpu in this process (ranks that share a device share its "
                       "cap), which hold 2.00 MiB (2098176 B) of it: "
                       "rank 0 holds 1.00 MiB (1049600 B), 1.00 MiB (1048576 B) in use and the "
                       "rest cached; rank 1 (asking) holds 1.00 MiB (1048576 B), all in use. "
                       "Allocator stats: "),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("limit 3.00 MiB (3145728 B) shared by 2 allocators, which reserve 2.00 MiB "
                       "(2098176 B) of it"),
              std::string::npos)
        << msg;
  }
  f.a.deallocate(a);
  f.b.deallocate(b);
}

// Whatever it held, cached or still waiting for another stream, as it goes.
TEST(MemoryBudget, AnAllocatorThatGoesGivesItsShareBack) {
  auto budget = std::make_shared<MemoryBudget>(4 * MiB);
  auto b = make_cpu_allocator(budget, "rank 1");
  {
    auto state = std::make_shared<FakeState>();  // synchronize_event cannot wait here
    CachingAllocator a(std::make_unique<FakeBackend>(state), budget);  // unnamed: "allocator 1"
    void* cached = a.allocate(1 * MiB + 1);
    void* pending = a.allocate(1 * MiB + 1);
    a.deallocate(cached);  // 2 MiB cached
    a.record_stream(pending, kStreamB);
    a.deallocate(pending);  // 2 MiB waiting for stream B
    EXPECT_EQ(budget->allocators(), 2);
    try {
      b->allocate(1000);
      FAIL() << "expected OutOfMemoryError";
    } catch (const OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 (asking) holds nothing; allocator 1 holds "
                                           "4.00 MiB (4194304 B), 0 B in use and the rest cached"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(budget->allocators(), 1);
  EXPECT_EQ(budget->reserved_bytes(), 0u);
  void* p = b->allocate(3 * MiB);
  EXPECT_EQ(b->stats().limit_shared_by, 1);
  b->deallocate(p);
}

TEST(MemoryBudget, ServesOneDevice) {
  auto budget = std::make_shared<MemoryBudget>(4 * MiB);
  auto cpu = make_cpu_allocator(budget);
  auto state = std::make_shared<FakeState>();
  state->device = Device::cuda(0);
  try {
    CachingAllocator other(std::make_unique<FakeBackend>(state), budget);
    FAIL() << "an allocator of cuda:0 joined a budget of cpu";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("this one serves cpu, and an allocator of cuda:0 cannot "
                                         "draw from it"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(budget->allocators(), 1);
}

// Ranks' threads allocate at once: the budget is taken before the system is asked, so no two
// requests can both pass a check that only one of them fits.
TEST(MemoryBudget, ConcurrentRequestsNeverTogetherPassTheLimit) {
  constexpr size_t kLimit = 64 * KiB;
  auto budget = std::make_shared<MemoryBudget>(kLimit);
  std::vector<std::shared_ptr<CachingAllocator>> allocators;
  for (int t = 0; t < 4; ++t) allocators.push_back(make_cpu_allocator(budget));
  std::atomic<size_t> most_reserved{0};
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937 rng(101 + t);
      std::vector<void*> held;
      for (int i = 0; i < 3000; ++i) {
        CachingAllocator& alloc = *allocators[t];
        if (held.size() > 8 || (!held.empty() && rng() % 3 == 0)) {
          alloc.deallocate(held.back());
          held.pop_back();
          if (rng() % 4 == 0) alloc.release_cache();
          continue;
        }
        try {
          held.push_back(alloc.allocate(512 * (1 + rng() % 16)));
        } catch (const OutOfMemoryError&) {
          ++refused;
        }
        const size_t now = budget->reserved_bytes();
        size_t seen = most_reserved.load();
        while (now > seen && !most_reserved.compare_exchange_weak(seen, now)) {
        }
      }
      for (void* p : held) allocators[t]->deallocate(p);
    });
  for (auto& th : threads) th.join();
  EXPECT_LE(most_reserved.load(), kLimit);
  EXPECT_GT(refused.load(), 0) << "the limit never bound: the test checks nothing";
  size_t reserved = 0;
  for (const auto& alloc : allocators) reserved += alloc->stats().reserved_bytes;
  EXPECT_EQ(budget->reserved_bytes(), reserved);
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
