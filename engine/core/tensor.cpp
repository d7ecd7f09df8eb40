#include "engine/core/tensor.h"

#include <bit>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "engine/core/number_text.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "engine/core/cuda_device_guard.h"
#include "kernels/cuda_check.h"
#endif

namespace conveyor {
namespace {

// a + b written out exactly: the end of a range a caller gave may lie past int64_t.
std::string exact_sum(int64_t a, int64_t b) {
  __int128 sum = static_cast<__int128>(a) + b;
  const bool negative = sum < 0;
  std::string digits;
  do {
    const int digit = static_cast<int>(sum % 10);
    digits.insert(digits.begin(), static_cast<char>('0' + (negative ? -digit : digit)));
    sum /= 10;
  } while (sum != 0);
  return negative ? "-" + digits : digits;
}

}  // namespace

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kI32:
      return 4;
  }
  throw std::invalid_argument("unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
  }
  return "unknown";
}

std::string shape_to_string(const Shape& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

int64_t shape_numel(const Shape& shape) {
  // The bytes of the elements, at most 4 each, must fit the int64_t and size_t that count
  // them (Tensor::nbytes, the allocator, the memory estimates): 2^62 floats were 0 bytes,
  // a tensor with no storage that its first write ran past.
  constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max() / 4;
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0)
      throw std::invalid_argument("shape " + shape_to_string(shape) + " has a negative dimension");
    if (d != 0 && numel > kMaxElements / d)
      throw std::invalid_argument("shape " + shape_to_string(shape) +
                                  " has too many elements for a tensor (at most " +
                                  std::to_string(kMaxElements) + ")");
    numel *= d;
  }
  return numel;
}

// --------------------------------------------------------------------------------- Storage

Storage::Storage(std::shared_ptr<CachingAllocator> allocator, size_t bytes, void* stream)
    : allocator_(std::move(allocator)), bytes_(bytes) {
  if (!allocator_) throw std::invalid_argument("Storage: allocator is null");
  data_ = allocator_->allocate(bytes, stream);
}

Storage::~Storage() {
  try {
    allocator_->deallocate(data_);
  } catch (...) {
    // A destructor must not throw; deallocate only fails when CUDA is already broken.
  }
}

// ---------------------------------------------------------------------------------- Tensor

Tensor Tensor::empty(const Shape& shape, DType dtype,
                     const std::shared_ptr<CachingAllocator>& allocator, void* stream) {
  Tensor t;
  t.numel_ = shape_numel(shape);
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(allocator, t.nbytes(), stream);
  return t;
}

int64_t Tensor::dim(int i) const {
  const int r = rank();
  const int j = i < 0 ? i + r : i;
  if (j >= 0 && j < r) return shape_[j];
  // "Dimensions", not "rank": in this project a rank is a pipeline's.
  std::string allowed;
  if (r == 1)
    allowed = " (give 0 or -1)";
  else if (r > 1)
    allowed = " (give 0 to " + std::to_string(r - 1) + ", or -" + std::to_string(r) +
              " to -1 from the last)";
  throw std::out_of_range("Tensor::dim(" + std::to_string(i) + ") is out of range for " +
                          describe() + " with " + counted(r, "dimension") + allowed);
}

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

void* Tensor::raw() const {
  if (!storage_) throw std::invalid_argument("raw(): the tensor is undefined (has no storage)");
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::view(int64_t offset, const Shape& shape) const {
  check_defined(*this, "view");
  const int64_t n = shape_numel(shape);
  if (offset < 0 || offset > numel_ || n > numel_ - offset)
    throw std::out_of_range("view of shape " + shape_to_string(shape) + " (" + std::to_string(n) +
                            " elements) at offset " + std::to_string(offset) + " does not fit in " +
                            describe() + " (" + std::to_string(numel_) + " elements)");
  Tensor t = *this;
  t.offset_ = offset_ + offset;
  t.shape_ = shape;
  t.numel_ = n;
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t count) const {
  check_defined(*this, "slice_rows");
  if (rank() == 0)
    throw std::invalid_argument("slice_rows: " + describe() + " is a scalar and has no rows");
  const int64_t rows = shape_[0];
  if (begin < 0 || count < 0 || begin > rows || count > rows - begin)
    throw std::out_of_range("slice_rows(" + std::to_string(begin) + ", " + std::to_string(count) +
                            "): rows [" + std::to_string(begin) + ", " + exact_sum(begin, count) +
                            ") are not within the " + std::to_string(rows) + " rows of " +
                            describe());
  Shape shape = shape_;
  shape[0] = 1;
  const int64_t row_numel = shape_numel(shape);
  shape[0] = count;
  return view(begin * row_numel, shape);
}

Tensor Tensor::reshape(const Shape& shape) const {
  check_defined(*this, "reshape");
  // One dimension may be -1: it is inferred from the others.
  Shape resolved = shape;
  int infer = -1;
  int64_t known = 1;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == -1 && infer < 0) {
      infer = static_cast<int>(i);
    } else {
      if (resolved[i] < 0)
        throw std::invalid_argument("reshape of " + describe() + " to " + shape_to_string(shape) +
                                    ": dimensions must be >= 0, with at most one -1");
      known *= resolved[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel_ % known != 0)
      throw std::invalid_argument("reshape of " + describe() + " to " + shape_to_string(shape) +
                                  ": cannot infer the -1 dimension from " + std::to_string(numel_) +
                                  " elements");
    resolved[infer] = numel_ / known;
  }
  if (shape_numel(resolved) != numel_)
    throw std::invalid_argument("reshape of " + describe() + " to " + shape_to_string(shape) +
                                ": element counts differ (" + std::to_string(numel_) + " vs " +
                                std::to_string(shape_numel(resolved)) + ")");
  return view(0, resolved);
}

std::string Tensor::describe() const {
  if (!storage_) return "undefined tensor";
  return std::string(dtype_name(dtype_)) + shape_to_string(shape_) + " on " + device().to_string();
}

void Tensor::check_dtype_is(DType expected) const {
  if (dtype_ != expected)
    throw std::invalid_argument(std::string("data<T>(): T is ") + dtype_name(expected) +
                                " but the tensor is " + describe());
}

// ---------------------------------------------------------------------------------- Checks

void check_defined(const Tensor& t, std::string_view what) {
  if (!t.defined())
    throw std::invalid_argument(std::string(what) +
                                ": expected a defined tensor, got an undefined one");
}

void check_shape(const Tensor& t, const Shape& expected, std::string_view what) {
  check_defined(t, what);
  if (t.shape() != expected)
    throw std::invalid_argument(std::string(what) + ": expected shape " +
                                shape_to_string(expected) + ", got " + shape_to_string(t.shape()));
}

void check_dtype(const Tensor& t, DType expected, std::string_view what) {
  check_defined(t, what);
  if (t.dtype() != expected)
    throw std::invalid_argument(std::string(what) + ": expected dtype " + dtype_name(expected) +
                                ", got " + dtype_name(t.dtype()) + " (" + t.describe() + ")");
}

void check_device(const Tensor& t, Device expected, std::string_view what) {
  check_defined(t, what);
  if (!(t.device() == expected))
    throw std::invalid_argument(std::string(what) + ": expected a tensor on " +
                                expected.to_string() + ", got one on " + t.device().to_string() +
                                " (" + t.describe() + ")");
}

// ---------------------------------------------------------------------------------- Copies

namespace {

#ifdef CONVEYOR_WITH_CUDA
void synchronize_device(Device device) {
  if (!device.is_cuda()) return;
  detail::CudaDeviceGuard guard(device.index);
  CONVEYOR_CUDA_CHECK(cudaDeviceSynchronize());
}
#endif

// Copies `bytes` between any two devices. With a stream, the copy is enqueued on it (and
// waited for when host memory is involved); without one it is ordered after, and finished
// before returning, all work on the devices involved: our streams are non-blocking, so the
// legacy default stream alone would not order the copy after their kernels.
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                void* stream) {
  if (bytes == 0 || dst == src) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memmove(dst, src, bytes);  // views of one storage may overlap
    return;
  }
#ifdef CONVEYOR_WITH_CUDA
  const Device device = dst_device.is_cuda() ? dst_device : src_device;
  const bool host_involved = dst_device.is_cpu() || src_device.is_cpu();
  if (stream != nullptr) {
    detail::CudaDeviceGuard guard(device.index);
    auto s = static_cast<cudaStream_t>(stream);
    CONVEYOR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
    if (host_involved) CONVEYOR_CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  synchronize_device(src_device);
  synchronize_device(dst_device);
  {
    detail::CudaDeviceGuard guard(device.index);
    CONVEYOR_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  }
  // cudaMemcpy may return before a device-side or pageable host-to-device copy has landed.
  synchronize_device(src_device);
  synchronize_device(dst_device);
#else
  throw std::runtime_error("copy between " + src_device.to_string() + " and " +
                           dst_device.to_string() +
                           ": this binary was built without the CUDA backend");
#endif
}

}  // namespace

void copy_tensor(const Tensor& dst, const Tensor& src, void* stream) {
  check_defined(dst, "copy_tensor destination");
  check_defined(src, "copy_tensor source");
  if (dst.dtype() != src.dtype() || dst.numel() != src.numel())
    throw std::invalid_argument("copy_tensor: destination " + dst.describe() + " and source " +
                                src.describe() + " must have the same dtype and element count");
  copy_bytes(dst.raw(), dst.device(), src.raw(), src.device(), src.nbytes(), stream);
}

void copy_from_host(const Tensor& dst, const void* src, size_t bytes, void* stream) {
  check_defined(dst, "copy_from_host destination");
  if (bytes != dst.nbytes())
    throw std::invalid_argument("copy_from_host: " + std::to_string(bytes) + " bytes given for " +
                                dst.describe() + " which holds " + std::to_string(dst.nbytes()) +
                                " bytes");
  if (src == nullptr && bytes > 0)
    throw std::invalid_argument("copy_from_host: the host source pointer is null for " +
                                std::to_string(bytes) + " bytes into " + dst.describe() +
                                "; give host memory holding them");
  copy_bytes(dst.raw(), dst.device(), src, Device::cpu(), bytes, stream);
}

void copy_to_host(void* dst, const Tensor& src, size_t bytes, void* stream) {
  check_defined(src, "copy_to_host source");
  if (bytes != src.nbytes())
    throw std::invalid_argument("copy_to_host: room for " + std::to_string(bytes) +
                                " bytes given for " + src.describe() + " which holds " +
                                std::to_string(src.nbytes()) + " bytes");
  if (dst == nullptr && bytes > 0)
    throw std::invalid_argument("copy_to_host: the host destination pointer is null for " +
                                std::to_string(bytes) + " bytes of " + src.describe() +
                                "; give host memory with room for them");
  copy_bytes(dst, Device::cpu(), src.raw(), src.device(), bytes, stream);
}

std::vector<float> to_vector_f32(const Tensor& t) {
  check_dtype(t, DType::kF32, "to_vector_f32");
  std::vector<float> out(static_cast<size_t>(t.numel()));
  copy_to_host(out.data(), t, t.nbytes());
  return out;
}

std::vector<int32_t> to_vector_i32(const Tensor& t) {
  check_dtype(t, DType::kI32, "to_vector_i32");
  std::vector<int32_t> out(static_cast<size_t>(t.numel()));
  copy_to_host(out.data(), t, t.nbytes());
  return out;
}

void record_stream(const Tensor& t, void* stream) {
  check_defined(t, "record_stream");
  t.storage()->allocator().record_stream(t.storage()->data(), stream);
}

// --------------------------------------------------------------------------------- bf16

uint16_t float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep the sign and the top of the payload and force a quiet bit, so that rounding
    // cannot carry a NaN into infinity.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit, then truncate.
  // Overflow past the largest finite bf16 correctly carries into infinity.
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

}  // namespace conveyor
