#pragma once
// A tensor is (storage, offset, shape, dtype, device), always contiguous (row-major); views
// share the storage at an element offset. Storage comes from a caching allocator and goes
// back to it when the last tensor referring to it is gone.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/allocator.h"
#include "engine/core/device.h"

namespace conveyor {

enum class DType : uint8_t { kF32, kBF16, kI32 };
size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// C++ type of each dtype for data<T>(): float, uint16_t (bf16 bits), int32_t.
template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::kF32;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::kBF16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::kI32;
}

using Shape = std::vector<int64_t>;
std::string shape_to_string(const Shape& shape);  // "[4, 8]"
int64_t shape_numel(const Shape& shape);          // throws on a negative dimension

// One allocation: returned to its allocator when destroyed.
class Storage {
 public:
  Storage(std::shared_ptr<CachingAllocator> allocator, size_t bytes, void* stream);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return allocator_->device(); }
  CachingAllocator& allocator() const { return *allocator_; }

 private:
  std::shared_ptr<CachingAllocator> allocator_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class Tensor {
 public:
  Tensor() = default;  // undefined: no storage
  // Uninitialised memory for `shape` from `allocator`, for use on `stream` (native handle).
  static Tensor empty(const Shape& shape, DType dtype,
                      const std::shared_ptr<CachingAllocator>& allocator, void* stream = nullptr);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  // Size of dimension i; negative i counts from the end. Throws when out of range.
  int64_t dim(int i) const;
  int64_t numel() const { return numel_; }
  DType dtype() const { return dtype_; }
  Device device() const;
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  int64_t offset() const { return offset_; }

  void* raw() const;
  // Typed pointer; throws when T does not match the dtype.
  template <class T>
  T* data() const {
    check_dtype_is(dtype_of<T>());
    return static_cast<T*>(raw());
  }

  // A view of `shape` starting `offset` elements into this tensor; throws when it does not fit.
  Tensor view(int64_t offset, const Shape& shape) const;
  // Rows [begin, begin + count) along dimension 0.
  Tensor slice_rows(int64_t begin, int64_t count) const;
  // Same elements, another shape of equal numel.
  Tensor reshape(const Shape& shape) const;

  std::string describe() const;  // e.g. "f32[4, 8] on cpu"
  const std::shared_ptr<Storage>& storage() const { return storage_; }

 private:
  void check_dtype_is(DType expected) const;

  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kF32;
};

// Checks that throw std::invalid_argument with a sentence naming `what`, the expectation and
// what was seen.
void check_defined(const Tensor& t, std::string_view what);
void check_shape(const Tensor& t, const Shape& expected, std::string_view what);
void check_dtype(const Tensor& t, DType expected, std::string_view what);
void check_device(const Tensor& t, Device expected, std::string_view what);

// Copies src into dst (same numel and dtype; any pair of devices), enqueued on `stream`
// (native handle; null = default / synchronous). Host<->device copies are synchronous.
void copy_tensor(const Tensor& dst, const Tensor& src, void* stream = nullptr);
// Host vectors <-> tensors (any device); these synchronise. Without a stream (native handle)
// every device involved is waited for, all of its streams; with one, the copy is ordered on
// that stream and only it is waited for, which a rank whose other streams may hold transfers
// waiting on a peer (NCCL) needs, since a wait for those could wait on this rank itself.
// `bytes` must be the tensor's nbytes(), and the host pointer non-null unless it is 0
// (std::invalid_argument otherwise).
std::vector<float> to_vector_f32(const Tensor& t);
std::vector<int32_t> to_vector_i32(const Tensor& t);
void copy_from_host(const Tensor& dst, const void* src, size_t bytes, void* stream = nullptr);
void copy_to_host(void* dst, const Tensor& src, size_t bytes, void* stream = nullptr);

// Marks that `stream` (native handle) also uses t's storage, so that its memory is not handed
// out again until that stream has passed the point where the storage is freed (see
// CachingAllocator::record_stream). Needed when a tensor made for one stream is used on another.
void record_stream(const Tensor& t, void* stream);

// Round-to-nearest-even fp32 -> bf16 and exact bf16 -> fp32.
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);

}  // namespace conveyor
