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
//   The cap is a MemoryBudget, which the allocators of the ranks that share a device in one
//   process share: their reserved bytes together stay within it, as the memory check before
//   a run adds up their estimates. An allocator gives back only its own cache when a request
//   does not fit: returning another's would take that allocator's lock under its own, and two
//   allocators doing so at once would deadlock.
// - While communication kernels may run on the device (NCCL), a request that does not fit
//   throws at once instead of releasing the cache: cudaFree synchronises the whole device, and
//   a communication kernel that waits for a peer which waits for this rank never finishes.
// The same class serves the CPU (malloc, no events) and CUDA (cudaMalloc, cudaEvent) through
// a small backend interface, so the caching logic is tested on CI without a GPU.
#include <atomic>
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
  size_t limit_bytes = 0;           // 0 = no cap; a device's whole cap when it is shared
  int limit_shared_by = 1;          // allocators drawing from the cap, this one included
  size_t limit_reserved_bytes = 0;  // reserved by all of them (reserved_bytes when alone)
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
  virtual void synchronize_event(void* /*event*/) {}
};

// The memory cap of one device, drawn from by every allocator given it: their reserved bytes
// (live and cached blocks) together stay within the limit. Ranks that share a device in one
// process (threads on the CPU or on one GPU) each have an allocator of their own; with a cap
// each, R of them could hold R times it. Where each process holds one rank (mpirun), its
// budget is that rank's alone. Thread-safe: allocators on several threads draw from it at once.
class MemoryBudget {
 public:
  explicit MemoryBudget(size_t limit_bytes = 0);  // 0 = no cap: the budget only counts
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  size_t limit_bytes() const;
  void set_limit(size_t limit_bytes);  // for every allocator drawing from it
  size_t reserved_bytes() const;       // by every allocator drawing from it
  int allocators() const;              // drawing from it now

 private:
  friend class CachingAllocator;
  // What one allocator holds of the budget; `allocated` (its live bytes) is written by the
  // allocator alone and read only to describe the holders in an error.
  struct Holder {
    std::string name;
    size_t reserved = 0;
    std::atomic<size_t> allocated{0};
  };
  // An allocator on `device` joins (on construction) and leaves (on destruction); a budget
  // serves one device.
  std::shared_ptr<Holder> join(Device device, std::string name);
  void leave(const std::shared_ptr<Holder>& holder);
  // Takes `bytes` for `holder` when they fit under the limit (always without one).
  bool try_reserve(Holder& holder, size_t bytes);
  void release(Holder& holder, size_t bytes);
  // Why a request of `holder` did not fit: the limit shared by N allocators and what each
  // holds; empty for an allocator alone on its budget, whose own stats say it all.
  std::string sharing_sentence(const Holder& holder) const;

  mutable std::mutex mutex_;
  size_t limit_ = 0;
  size_t reserved_ = 0;
  bool has_device_ = false;
  Device device_;
  std::vector<std::shared_ptr<Holder>> holders_;
  int joined_ = 0;  // allocators ever joined: numbers the unnamed ones
};

class CachingAllocator {
 public:
  explicit CachingAllocator(std::unique_ptr<AllocatorBackend> backend, size_t limit_bytes = 0);
  // Draws on `budget`, with the allocators of the same device that share it; `name` says whose
  // allocator this is in the error when the budget runs out ("rank 1"; empty: "allocator N").
  CachingAllocator(std::unique_ptr<AllocatorBackend> backend, std::shared_ptr<MemoryBudget> budget,
                   std::string name = {});
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
  // The cap of this allocator's budget: of every allocator that shares it.
  void set_limit(size_t limit_bytes);
  const std::shared_ptr<MemoryBudget>& budget() const { return budget_; }
  // Frees cached (unused) blocks back to the system. On CUDA this synchronises the device:
  // call it at a point where no communication kernel can be waiting for a peer.
  void release_cache();
  Device device() const;

  // Says whether kernels that wait on other ranks (NCCL) may be running on this device; the
  // executor sets it on every allocator of its ranks once their transports exist, from each
  // transport's queues_kernels_that_wait_on_peers(). While true, a
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
  bool reserve_locked(size_t size);    // from the budget
  size_t cached_bytes_locked() const;  // bytes of blocks in the cache (not pending)
  // Waits for every pending block's events, then caches those blocks.
  void synchronize_pending();
  void* allocate_from_system(size_t bytes, size_t size);
  [[noreturn]] void throw_out_of_memory(size_t bytes, size_t size, const std::string& reason) const;
  AllocatorStats stats_locked() const;  // stats_ with the budget's figures

  std::unique_ptr<AllocatorBackend> backend_;
  std::shared_ptr<MemoryBudget> budget_;
  std::shared_ptr<MemoryBudget::Holder> holder_;
  // Locked before the budget's mutex, never after: the budget calls no allocator.
  mutable std::mutex mutex_;
  AllocatorStats stats_;
  std::unordered_map<void*, Block> live_;
  // Cached free blocks per (stream, rounded size).
  std::map<std::pair<void*, size_t>, std::vector<void*>> cache_;
  std::vector<Pending> pending_;
  bool communication_kernels_ = false;
};

// Allocators for the CPU (malloc) and CUDA device `index` (cudaMalloc), with a cap of their
// own, or drawing on a budget shared with other allocators of the same device.
std::shared_ptr<CachingAllocator> make_cpu_allocator(size_t limit_bytes = 0);
std::shared_ptr<CachingAllocator> make_cpu_allocator(std::shared_ptr<MemoryBudget> budget,
                                                     std::string name = {});
std::shared_ptr<CachingAllocator> make_cuda_allocator(int index, size_t limit_bytes = 0);
std::shared_ptr<CachingAllocator> make_cuda_allocator(int index,
                                                      std::shared_ptr<MemoryBudget> budget,
                                                      std::string name = {});
// Host memory (tensors in it are CPU tensors) for copies from and to CUDA devices: page-locked
// (cudaHostAlloc), so a device-to-host copy runs at the bus's speed instead of being staged
// through a bounce buffer. Keep the allocator to reuse its blocks, since pinning is slow.
// Plain host memory in a build without CUDA or on a machine without a usable GPU.
// Never capped: a cap emulates a smaller device, and these blocks are the host's, outside the
// device the run is checked against; the staged ids and checkpoint snapshots they hold are not
// in the memory estimate either, so counting them would fail runs the check let through.
std::shared_ptr<CachingAllocator> make_pinned_host_allocator();

}  // namespace conveyor
