#include "engine/core/device.h"

#include <charconv>
#include <stdexcept>

#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include "engine/core/cuda_device_guard.h"
#endif

namespace conveyor {

std::string Device::to_string() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

Device parse_device(const std::string& text) {
  if (text == "cpu") return Device::cpu();
  if (text == "cuda") return Device::cuda(0);
  const std::string prefix = "cuda:";
  if (text.rfind(prefix, 0) == 0 && text.size() > prefix.size()) {
    const char* first = text.data() + prefix.size();
    const char* last = text.data() + text.size();
    // Digits only, as every number of the command line: from_chars would take "-0".
    int index = -1;
    const auto [end, err] = std::from_chars(first, last, index);
    if (*first >= '0' && *first <= '9' && err == std::errc() && end == last)
      return Device::cuda(index);
  }
  throw std::invalid_argument("unknown device '" + text +
                              "': expected 'cpu', 'cuda' or 'cuda:N' with N >= 0");
}

int cuda_device_count() {
#ifdef CONVEYOR_WITH_CUDA
  // Computed once: the set of visible devices does not change during a run. A missing driver
  // or device is an answer (0), not an error.
  static const int count = [] {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear it so that later calls do not see it
      return 0;
    }
    return n;
  }();
  return count;
#else
  return 0;
#endif
}

std::string cuda_device_uuid(int index) {
#ifdef CONVEYOR_WITH_CUDA
  cudaDeviceProp prop{};
  const cudaError_t err = cudaGetDeviceProperties(&prop, index);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error("cudaGetDeviceProperties(cuda:" + std::to_string(index) +
                             ") failed: " + cudaGetErrorString(err));
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string text = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) text += '-';
    const auto byte = static_cast<unsigned char>(prop.uuid.bytes[i]);
    text += kHex[byte >> 4];
    text += kHex[byte & 15];
  }
  return text;
#else
  throw std::invalid_argument("cuda:" + std::to_string(index) +
                              " has no identity in a build without CUDA");
#endif
}

CudaMemoryInfo cuda_memory_info(int index) {
  CudaMemoryInfo info;
#ifdef CONVEYOR_WITH_CUDA
  detail::CudaDeviceGuard guard(index);
  if (cudaMemGetInfo(&info.free_bytes, &info.total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return {};
  }
#else
  (void)index;
#endif
  return info;
}

bool built_with_cuda() {
#ifdef CONVEYOR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace conveyor
