#pragma once
// Where tensors live and kernels run: the CPU or CUDA device i.
#include <cstddef>
#include <cstdint>
#include <string>

namespace conveyor {

enum class DeviceKind : uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static Device cpu() { return {DeviceKind::kCpu, 0}; }
  static Device cuda(int index) { return {DeviceKind::kCuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::kCpu; }
  bool is_cuda() const { return kind == DeviceKind::kCuda; }
  std::string to_string() const;  // "cpu" or "cuda:0"
  friend bool operator==(const Device&, const Device&) = default;
};

// Parses "cpu", "cuda", "cuda:N"; throws std::invalid_argument otherwise.
Device parse_device(const std::string& text);

// Number of usable CUDA devices: 0 when built without CUDA, without a driver or without a
// device. Never throws.
int cuda_device_count();

// The identity of CUDA device `index` as nvidia-smi -L prints it ("GPU-" and the UUID's 32 hex
// digits in groups of 8-4-4-4-12), the same for every process that sees the device, whatever
// index CUDA_VISIBLE_DEVICES gives it there. Throws std::runtime_error when the device cannot
// be queried, std::invalid_argument in a build without CUDA.
std::string cuda_device_uuid(int index);

// The free and total bytes of CUDA device `index` (cudaMemGetInfo, with that device current),
// both 0 when unknown: a build without CUDA, or a query that failed (its error is cleared, so
// that the next kernel launch check does not throw it). Throws std::runtime_error only when
// the device cannot be made current.
struct CudaMemoryInfo {
  size_t free_bytes = 0, total_bytes = 0;
};
CudaMemoryInfo cuda_memory_info(int index);

// True when this binary was built with the CUDA backend.
bool built_with_cuda();

}  // namespace conveyor
