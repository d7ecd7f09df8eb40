// Caching allocator throughput on the CPU: the cache-hit path (allocate + free of one size),
// many live blocks at once, Tensor::empty on top, and aligned_alloc as the system baseline.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <vector>

#include "engine/core/allocator.h"
#include "engine/core/tensor.h"

namespace {

using conveyor::make_cpu_allocator;

void BM_CacheHitAllocFree(benchmark::State& state) {
  auto alloc = make_cpu_allocator();
  const auto bytes = static_cast<size_t>(state.range(0));
  alloc->deallocate(alloc->allocate(bytes));  // warm the bucket
  for (auto _ : state) {
    void* p = alloc->allocate(bytes);
    benchmark::DoNotOptimize(p);
    alloc->deallocate(p);
  }
  const auto s = alloc->stats();
  state.counters["hit_rate"] = static_cast<double>(s.cache_hits) / static_cast<double>(s.requests);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_CacheHitAllocFree)->Arg(512)->Arg(64 << 10)->Arg(8 << 20);

// 256 live blocks of mixed sizes, then all freed: a step's worth of activations.
void BM_ManyLiveBlocks(benchmark::State& state) {
  auto alloc = make_cpu_allocator();
  std::vector<void*> ptrs(256);
  for (auto _ : state) {
    for (size_t i = 0; i < ptrs.size(); ++i) ptrs[i] = alloc->allocate(512 * (1 + i % 16));
    for (void* p : ptrs) alloc->deallocate(p);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(ptrs.size()));
}
BENCHMARK(BM_ManyLiveBlocks);

void BM_TensorEmpty(benchmark::State& state) {
  auto alloc = make_cpu_allocator();
  for (auto _ : state) {
    auto t = conveyor::Tensor::empty({64, 256}, conveyor::DType::kF32, alloc);
    benchmark::DoNotOptimize(t.raw());
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_TensorEmpty);

// The system allocator for comparison (no cache).
void BM_AlignedAllocFree(benchmark::State& state) {
  const auto bytes = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    void* p = std::aligned_alloc(64, bytes);
    benchmark::DoNotOptimize(p);
    std::free(p);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_AlignedAllocFree)->Arg(512)->Arg(64 << 10)->Arg(8 << 20);

}  // namespace
