#include "engine/core/cuda_device_guard.h"

#ifdef CONVEYOR_WITH_CUDA
#include <cuda.h>  // the driver's types only: its functions are reached through the runtime

namespace conveyor::detail {
namespace {

using DeviceGet = CUresult (*)(CUdevice*, int);
using PrimaryContextState = CUresult (*)(CUdevice, unsigned int*, int*);

struct DriverEntries {
  DeviceGet device_get = nullptr;
  PrimaryContextState primary_context_state = nullptr;
};

// Looked up once through the runtime, which has loaded the driver: the library does not link
// the driver itself, which machines without a GPU lack.
const DriverEntries& driver_entries() {
  static const DriverEntries entries = [] {
    DriverEntries e;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuDeviceGet", &fn, 12000, cudaEnableDefault, &found) ==
            cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      e.device_get = reinterpret_cast<DeviceGet>(fn);
    if (cudaGetDriverEntryPointByVersion("cuDevicePrimaryCtxGetState", &fn, 12000,
                                         cudaEnableDefault, &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      e.primary_context_state = reinterpret_cast<PrimaryContextState>(fn);
    return e;
  }();
  return entries;
}

}  // namespace

bool cuda_primary_context_active(int index) {
  const DriverEntries& driver = driver_entries();
  if (driver.device_get == nullptr || driver.primary_context_state == nullptr) return true;
  CUdevice device = 0;
  if (driver.device_get(&device, index) != CUDA_SUCCESS) return true;
  unsigned int flags = 0;
  int active = 0;
  if (driver.primary_context_state(device, &flags, &active) != CUDA_SUCCESS) return true;
  return active != 0;
}

}  // namespace conveyor::detail
#endif
