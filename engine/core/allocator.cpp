// Caching allocator: size-bucketed, stream-ordered reuse with counters. The device-specific
// parts (system allocation and events) sit behind AllocatorBackend; see allocator.h.
#include "engine/core/allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace conveyor {
namespace {

constexpr size_t kSmallGranularity = 512;
constexpr size_t kLargeThreshold = size_t{1} << 20;  // above 1 MiB a block is "large"
constexpr size_t kLargeGranularity = size_t{2} << 20;
// Anything above this cannot be a real request (and rounding it would overflow).
constexpr size_t kMaxRequest = size_t{1} << 62;

std::string format_bytes(size_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  int unit = 0;
  while (value >= 1024.0 && unit < 3) {
    value /= 1024.0;
    ++unit;
  }
  char text[64];
  std::snprintf(text, sizeof(text), "%.2f %s (%zu B)", value, units[unit], bytes);
  return text;
}

// Host memory from the C library, 64-byte aligned (a cache line; enough for any vector load).
class CpuAllocatorBackend final : public AllocatorBackend {
 public:
  Device device() const override { return Device::cpu(); }
  void* system_allocate(size_t bytes) override {
    // Rounded sizes are multiples of 512, as aligned_alloc requires a multiple of 64.
    return std::aligned_alloc(64, bytes);
  }
  void system_free(void* ptr) override { std::free(ptr); }
  // CPU work is synchronous: once freed, a block is no longer used by anyone.
  void* record_event(void*) override { return nullptr; }
  bool event_done(void*) override { return true; }
  void destroy_event(void*) override {}
};

}  // namespace

std::string AllocatorStats::to_string() const {
  std::string limit = limit_bytes == 0 ? std::string("none") : format_bytes(limit_bytes);
  if (limit_bytes != 0 && limit_shared_by > 1)
    limit += " shared by " + std::to_string(limit_shared_by) + " allocators, which reserve " +
             format_bytes(limit_reserved_bytes) + " of it";
  return "allocated " + format_bytes(allocated_bytes) + ", peak allocated " +
         format_bytes(peak_allocated_bytes) + ", reserved " + format_bytes(reserved_bytes) +
         ", peak reserved " + format_bytes(peak_reserved_bytes) + ", limit " + limit +
         ", system allocations " + std::to_string(system_allocations) + ", requests " +
         std::to_string(requests) + ", cache hits " + std::to_string(cache_hits);
}

MemoryBudget::MemoryBudget(size_t limit_bytes) : limit_(limit_bytes) {}

size_t MemoryBudget::limit_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_;
}

void MemoryBudget::set_limit(size_t limit_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = limit_bytes;
}

size_t MemoryBudget::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_;
}

int MemoryBudget::allocators() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(holders_.size());
}

std::shared_ptr<MemoryBudget::Holder> MemoryBudget::join(Device device, std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (has_device_ && !(device == device_))
    throw std::invalid_argument("a memory budget serves one device: this one serves " +
                                device_.to_string() + ", and an allocator of " +
                                device.to_string() + " cannot draw from it");
  has_device_ = true;
  device_ = device;
  auto holder = std::make_shared<Holder>();
  holder->name = name.empty() ? "allocator " + std::to_string(joined_) : std::move(name);
  ++joined_;
  holders_.push_back(holder);
  return holder;
}

void MemoryBudget::leave(const std::shared_ptr<Holder>& holder) {
  std::lock_guard<std::mutex> lock(mutex_);
  // What the allocator still holds goes with it: its cache was returned to the system, and
  // blocks it leaves live can no longer be freed through it.
  reserved_ -= holder->reserved;
  holder->reserved = 0;
  std::erase(holders_, holder);
}

bool MemoryBudget::try_reserve(Holder& holder, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Written so as not to overflow, and false when a lowered limit is already exceeded.
  if (limit_ != 0 && (reserved_ > limit_ || bytes > limit_ - reserved_)) return false;
  reserved_ += bytes;
  holder.reserved += bytes;
  return true;
}

void MemoryBudget::release(Holder& holder, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_ -= bytes;
  holder.reserved -= bytes;
}

std::string MemoryBudget::sharing_sentence(const Holder& holder) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (holders_.size() < 2) return "";
  std::string text = "; the limit of " + format_bytes(limit_) + " is shared by the " +
                     std::to_string(holders_.size()) + " allocators of " + device_.to_string() +
                     " in this process (ranks that share a device share its cap), which hold " +
                     format_bytes(reserved_) + " of it: ";
  for (size_t i = 0; i < holders_.size(); ++i) {
    const Holder& h = *holders_[i];
    const size_t in_use = std::min(h.allocated.load(std::memory_order_relaxed), h.reserved);
    text += (i == 0 ? "" : "; ") + h.name + (&h == &holder ? " (asking)" : "") + " holds ";
    if (h.reserved == 0)
      text += "nothing";
    else
      text += format_bytes(h.reserved) +
              (in_use == h.reserved ? ", all in use"
                                    : ", " + format_bytes(in_use) + " in use and the rest cached");
  }
  return text;
}

CachingAllocator::CachingAllocator(std::unique_ptr<AllocatorBackend> backend, size_t limit_bytes)
    : CachingAllocator(std::move(backend), std::make_shared<MemoryBudget>(limit_bytes)) {}

CachingAllocator::CachingAllocator(std::unique_ptr<AllocatorBackend> backend,
                                   std::shared_ptr<MemoryBudget> budget, std::string name)
    : backend_(std::move(backend)), budget_(std::move(budget)) {
  if (!backend_) throw std::invalid_argument("CachingAllocator: backend is null");
  if (!budget_) throw std::invalid_argument("CachingAllocator: memory budget is null");
  holder_ = budget_->join(backend_->device(), std::move(name));
}

CachingAllocator::~CachingAllocator() {
  try {
    std::lock_guard<std::mutex> lock(mutex_);
    synchronize_pending();
    // Blocks still pending belong to a backend that cannot wait for its events, i.e. one
    // without asynchronous users: nothing can still be using them.
    for (Pending& p : pending_) {
      for (void* event : p.events) backend_->destroy_event(event);
      backend_->system_free(p.ptr);
    }
    pending_.clear();
    release_cache_locked();
    // Live blocks (raw allocate() without deallocate()) are the caller's and are left alone:
    // freeing them could turn a leak into a use after free.
  } catch (...) {
    // A destructor must not throw; the process is likely failing already.
  }
  budget_->leave(holder_);
}

size_t CachingAllocator::round_size(size_t bytes) {
  if (bytes > kMaxRequest)
    throw std::length_error("CachingAllocator: request of " + std::to_string(bytes) +
                            " bytes is too large to round");
  if (bytes <= kLargeThreshold) {
    const size_t size = (bytes + kSmallGranularity - 1) / kSmallGranularity * kSmallGranularity;
    return std::max(size, kSmallGranularity);  // bytes == 0 still gets a unique block
  }
  return (bytes + kLargeGranularity - 1) / kLargeGranularity * kLargeGranularity;
}

void* CachingAllocator::allocate(size_t bytes, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.requests;
  if (bytes > kMaxRequest) throw_out_of_memory(bytes, bytes, "no device has that much memory");
  const size_t size = round_size(bytes);
  process_pending();
  void* ptr = try_take_cached(size, stream);
  if (ptr != nullptr) {
    ++stats_.cache_hits;
  } else {
    ptr = allocate_from_system(bytes, size);
  }
  live_.emplace(ptr, Block{size, stream, {}});
  stats_.allocated_bytes += size;
  holder_->allocated.store(stats_.allocated_bytes, std::memory_order_relaxed);
  stats_.peak_allocated_bytes = std::max(stats_.peak_allocated_bytes, stats_.allocated_bytes);
  return ptr;
}

bool CachingAllocator::reserve_locked(size_t size) { return budget_->try_reserve(*holder_, size); }

void* CachingAllocator::allocate_from_system(size_t bytes, size_t size) {
  // Returning cached blocks to the system (cudaFree synchronises the device) or waiting for
  // other streams could wait for a communication kernel, which may wait for this rank: while
  // such kernels may run, a retry that would do either fails instead.
  const auto must_keep_the_cache = [&] {
    return communication_kernels_ && (!cache_.empty() || !pending_.empty());
  };
  const auto kept = [&](const std::string& reason) {
    return reason + "; the " + format_bytes(cached_bytes_locked()) +
           " of cached blocks were not returned to the system because communication kernels "
           "may run on this device, and returning them would synchronise it, which can "
           "deadlock the ranks. Call release_cache() between steps, or use less memory per step";
  };
  // The bytes are taken from the budget before the system is asked for them, so that
  // allocators sharing it cannot together pass its limit between a check and an allocation.
  const auto over_the_limit = [&] {
    return "the memory limit would be exceeded" + budget_->sharing_sentence(*holder_);
  };
  bool reserved = reserve_locked(size);
  if (!reserved && must_keep_the_cache()) throw_out_of_memory(bytes, size, kept(over_the_limit()));
  // Over the cap: give back what is cached, then what waits for other streams, and retry.
  if (!reserved) {
    release_cache_locked();
    reserved = reserve_locked(size);
  }
  if (!reserved && !pending_.empty()) {
    synchronize_pending();
    release_cache_locked();
    reserved = reserve_locked(size);
  }
  if (!reserved) throw_out_of_memory(bytes, size, over_the_limit());

  // Given back to the budget unless the system gives the block.
  struct Reservation {
    MemoryBudget& budget;
    MemoryBudget::Holder& holder;
    size_t bytes;
    ~Reservation() {
      if (bytes != 0) budget.release(holder, bytes);
    }
    void give_back() {
      budget.release(holder, bytes);
      bytes = 0;
    }
  } reservation{*budget_, *holder_, size};
  void* ptr = backend_->system_allocate(size);
  if (ptr == nullptr && must_keep_the_cache()) {
    reservation.give_back();
    throw_out_of_memory(bytes, size, kept("the system has no free memory left"));
  }
  if (ptr == nullptr) {
    release_cache_locked();
    synchronize_pending();
    release_cache_locked();
    ptr = backend_->system_allocate(size);
  }
  if (ptr == nullptr) {
    reservation.give_back();
    throw_out_of_memory(bytes, size, "the system has no free memory left");
  }
  reservation.bytes = 0;  // the block's now
  ++stats_.system_allocations;
  stats_.reserved_bytes += size;
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  return ptr;
}

void CachingAllocator::throw_out_of_memory(size_t bytes, size_t size,
                                           const std::string& reason) const {
  size_t pending_bytes = 0;
  for (const Pending& p : pending_) pending_bytes += p.block.size;
  std::string message = "out of memory on " + backend_->device().to_string() +
                        ": cannot allocate " + format_bytes(bytes) + " (request of " +
                        std::to_string(bytes) + " bytes, " + std::to_string(size) +
                        " bytes after rounding): " + reason +
                        ". Allocator stats: " + stats_locked().to_string();
  if (pending_bytes > 0)
    message += "; " + format_bytes(pending_bytes) + " of freed blocks still wait for other streams";
  throw OutOfMemoryError(message);
}

void CachingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end())
    throw std::invalid_argument(
        "CachingAllocator::deallocate: pointer was not allocated by this allocator or was "
        "already freed");
  // Record the events before touching any state, so that a failure leaves the block live.
  std::vector<void*> events;
  try {
    for (void* other : it->second.other_streams)
      if (void* event = backend_->record_event(other)) events.push_back(event);
  } catch (...) {
    for (void* event : events) backend_->destroy_event(event);
    throw;
  }
  Block block = std::move(it->second);
  live_.erase(it);
  stats_.allocated_bytes -= block.size;
  holder_->allocated.store(stats_.allocated_bytes, std::memory_order_relaxed);
  if (events.empty()) {
    // Only the allocating stream used it (or the backend is synchronous): the stream orders
    // the old use before any new one, so the block is reusable at once on that stream.
    cache_[{block.stream, block.size}].push_back(ptr);
  } else {
    pending_.push_back(Pending{ptr, std::move(block), std::move(events)});
  }
}

void CachingAllocator::record_stream(void* ptr, void* stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end())
    throw std::invalid_argument(
        "CachingAllocator::record_stream: pointer is not a live block of this allocator");
  Block& block = it->second;
  if (stream == block.stream) return;
  if (std::find(block.other_streams.begin(), block.other_streams.end(), stream) ==
      block.other_streams.end())
    block.other_streams.push_back(stream);
}

size_t CachingAllocator::block_size(void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end())
    throw std::invalid_argument(
        "CachingAllocator::block_size: pointer is not a live block of this allocator");
  return it->second.size;
}

void CachingAllocator::process_pending() {
  size_t kept = 0;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = pending_[i];
    std::erase_if(p.events, [&](void* event) {
      if (!backend_->event_done(event)) return false;
      backend_->destroy_event(event);
      return true;
    });
    if (p.events.empty()) {
      cache_[{p.block.stream, p.block.size}].push_back(p.ptr);
    } else {
      if (kept != i) pending_[kept] = std::move(p);
      ++kept;
    }
  }
  pending_.resize(kept);
}

void CachingAllocator::synchronize_pending() {
  for (Pending& p : pending_)
    for (void* event : p.events) backend_->synchronize_event(event);
  process_pending();
}

void* CachingAllocator::try_take_cached(size_t size, void* stream) {
  auto it = cache_.find({stream, size});
  if (it == cache_.end()) return nullptr;
  void* ptr = it->second.back();  // most recently freed: likeliest to be warm in cache
  it->second.pop_back();
  if (it->second.empty()) cache_.erase(it);
  return ptr;
}

void CachingAllocator::release_cache_locked() {
  // Detach the cache first: if a free fails midway, the rest leak rather than being freed
  // twice later.
  auto cache = std::move(cache_);
  cache_.clear();
  for (auto& [key, ptrs] : cache) {
    for (void* ptr : ptrs) {
      stats_.reserved_bytes -= key.second;
      budget_->release(*holder_, key.second);
      backend_->system_free(ptr);
    }
  }
}

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_locked();
}

AllocatorStats CachingAllocator::stats_locked() const {
  AllocatorStats s = stats_;
  std::lock_guard<std::mutex> lock(budget_->mutex_);
  s.limit_bytes = budget_->limit_;
  s.limit_shared_by = static_cast<int>(budget_->holders_.size());
  s.limit_reserved_bytes = budget_->reserved_;
  return s;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_allocated_bytes = stats_.allocated_bytes;
  stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

void CachingAllocator::set_limit(size_t limit_bytes) { budget_->set_limit(limit_bytes); }

void CachingAllocator::release_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  process_pending();
  release_cache_locked();
}

Device CachingAllocator::device() const { return backend_->device(); }

void CachingAllocator::set_device_may_run_communication_kernels(bool value) {
  std::lock_guard<std::mutex> lock(mutex_);
  communication_kernels_ = value;
}

bool CachingAllocator::device_may_run_communication_kernels() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return communication_kernels_;
}

size_t CachingAllocator::cached_bytes_locked() const {
  size_t bytes = 0;
  for (const auto& [key, ptrs] : cache_) bytes += key.second * ptrs.size();
  return bytes;
}

std::shared_ptr<CachingAllocator> make_cpu_allocator(size_t limit_bytes) {
  return std::make_shared<CachingAllocator>(std::make_unique<CpuAllocatorBackend>(), limit_bytes);
}

std::shared_ptr<CachingAllocator> make_cpu_allocator(std::shared_ptr<MemoryBudget> budget,
                                                     std::string name) {
  return std::make_shared<CachingAllocator>(std::make_unique<CpuAllocatorBackend>(),
                                            std::move(budget), std::move(name));
}

}  // namespace conveyor
