#pragma once
// Per-device caching allocator.
//
// - Size-bucketed reuse: requests are rounded up (512 B granularity for small blocks, 2 MiB
//   for large ones) and freed blocks are kept in a cache keyed by rounded size.
// - Stream-ordered safety: a block belongs to the stream it was allocated on; a block that
//   another stream used (record_stream) is not handed out again until an event recorded on
//   each of those streams at free time has completed. Same-stream reuse is immediate, since
//   the stream orders the old and the new use.
// - Stats: bytes currently allocated (live, rounded sizes), their peak, bytes reserved from
//   the system (live + cached), its peak, number of system allocations, requests, cache hits.
// - An optional cap on reserved bytes emulates a smaller device; when a request does not fit
//   the cache is released and retried, then OutOfMemoryError prints the request and stats.
// - While communication kernels may run on the device (NCCL), a request that does not fit
//   throws at once instead of releasing the cache: cudaFree synchronises the whole device, and
//   a communication kernel that waits for a peer which waits for this rank never finishes.
// The same class serves the CPU (malloc, no events) and CUDA (cudaMalloc, cudaEvent) through
// a small backend interface, so the caching logic is tested on CI without a GPU.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/core/device.h"

namespace conveyor {

struct AllocatorStats {
  size_t allocated_bytes = 0;  // live blocks (rounded sizes)
  size_t peak_allocated_bytes = 0;
  size_t reserved_bytes = 0;  // live + cached, i.e. held from the system
  size_t peak_reserved_bytes = 0;
  size_t limit_bytes = 0;           // 0 = no cap
  uint64_t system_allocations = 0;  // calls to malloc / cudaMalloc
  uint64_t requests = 0;
  uint64_t cache_hits = 0;
  std::string to_string() const;
};

class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The sentence of an error for a message: a failed host allocation (std::bad_alloc, whose own
// text is only "std::bad_alloc") said as one.
inline std::string error_sentence(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr)
    return "out of memory on the host: an allocation of its memory failed";
  return e.what();
}

// What the caching logic needs from a device.
class AllocatorBackend {
 public:
  virtual ~AllocatorBackend() = default;
  virtual Device device() const = 0;
  // Returns null when the system is out of memory (the allocator then frees its cache and
  // retries once, unless communication kernels may run, then throws OutOfMemoryError).
  virtual void* system_allocate(size_t bytes) = 0;
  virtual void system_free(void* ptr) = 0;
  // Events for stream-ordered reuse. `stream` is the native stream handle.
  virtual void* record_event(void* stream) = 0;  // may return null (CPU: nothing to wait for)
  virtual bool event_done(void* event) = 0;
  virtual void destroy_event(void* event) = 0;
  // Blocks the host until `event` has completed. Used only when memory runs out (so that
  // blocks waiting for other streams can be reused) and on destruction. The default does
  // nothing; such blocks then stay pending.
  virtual void synchronize_event(void* event) {}
};

class CachingAllocator {
 public:
  explicit CachingAllocator(std::unique_ptr<AllocatorBackend> backend, size_t limit_bytes = 0);
  ~CachingAllocator();  // returns every cached block to the system
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // A block of at least `bytes` bytes (bytes == 0 gives a valid unique pointer) for use on
  // `stream` (native handle, null on the CPU).
  void* allocate(size_t bytes, void* stream = nullptr);
  void deallocate(void* ptr);
  // Marks that `stream` also uses the block (so its reuse waits for that stream).
  void record_stream(void* ptr, void* stream);
  size_t block_size(void* ptr) const;  // rounded size of a live block

  AllocatorStats stats() const;
  void reset_peak();  // peaks := current values
  void set_limit(size_t limit_bytes);
  // Frees cached (unused) blocks back to the system. On CUDA this synchronises the device:
  // call it at a point where no communication kernel can be waiting for a peer.
  void release_cache();
  Device device() const;

  // Says whether kernels that wait on other ranks (NCCL) may be running on this device; set
  // by whoever creates communicators for it, on every allocator of that device. While true, a
  // request that does not fit (the cap or the device) fails with OutOfMemoryError without
  // releasing the cache or waiting for other streams, since either could wait for such a
  // kernel and deadlock the ranks.
  void set_device_may_run_communication_kernels(bool value);
  bool device_may_run_communication_kernels() const;

  static size_t round_size(size_t bytes);

 private:
  struct Block {
    size_t size = 0;
    void* stream = nullptr;
    std::vector<void*> other_streams;
  };
  struct Pending {
    void* ptr;
    Block block;
    std::vector<void*> events;
  };
  void process_pending();
  void* try_take_cached(size_t size, void* stream);
  void release_cache_locked();
  size_t cached_bytes_locked() const;  // bytes of blocks in the cache (not pending)
  // Waits for every pending block's events, then caches those blocks.
  void synchronize_pending();
  void* allocate_from_system(size_t bytes, size_t size);
  [[noreturn]] void throw_out_of_memory(size_t bytes, size_t size, const std::string& reason) const;

  std::unique_ptr<AllocatorBackend> backend_;
  mutable std::mutex mutex_;
  AllocatorStats stats_;
  std::unordered_map<void*, Block> live_;
  // Cached free blocks per (stream, rounded size).
  std::map<std::pair<void*, size_t>, std::vector<void*>> cache_;
  std::vector<Pending> pending_;
  bool communication_kernels_ = false;
};

// Allocators for the CPU (malloc) and CUDA device `index` (cudaMalloc).
std::shared_ptr<CachingAllocator> make_cpu_allocator(size_t limit_bytes = 0);
std::shared_ptr<CachingAllocator> make_cuda_allocator(int index, size_t limit_bytes = 0);
// Host memory (tensors in it are CPU tensors) for copies from and to CUDA devices: page-locked
// (cudaHostAlloc), so a device-to-host copy runs at the bus's speed instead of being staged
// through a bounce buffer. Keep the allocator to reuse its blocks, since pinning is slow.
// Plain host memory in a build without CUDA or on a machine without a usable GPU.
std::shared_ptr<CachingAllocator> make_pinned_host_allocator();

}  // namespace conveyor
