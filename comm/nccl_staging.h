#pragma once
// The device and pinned host buffers of an NCCL transport's group calls in flight, a slot
// per call (NcclTransport, comm/nccl.h). Only comm/nccl*.cpp include this.
#ifdef CONVEYOR_WITH_CUDA
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/stream.h"
#include "kernels/cuda_check.h"

namespace conveyor::comm::detail {

// The buffers of one group call in flight: device staging, pinned host memory (so that the
// copies stay asynchronous), and an event recorded on the group stream after the call's
// last work, which says when the buffers are the host's again.
struct NcclStagingSlot {
  float* device = nullptr;
  size_t device_floats = 0;
  float* host = nullptr;
  size_t host_floats = 0;
  std::unique_ptr<Event> done;
  bool held = false;  // by a call not finished yet

  // Not held, and the group stream has passed the work of its last call (one whose handle
  // was dropped unfinished may still be running). An event that cannot be asked is busy.
  bool available() const {
    if (held) return false;
    try {
      return done->query();
    } catch (...) {
      return false;
    }
  }
  bool fits(size_t device_need, size_t host_need) const {
    return device_floats >= device_need && host_floats >= host_need;
  }
};

// Every group call in flight has a slot of its own, so that a call never overwrites the
// staging of one started before it: the pool grows to the most calls a rank has had in flight
// at once and reuses them. Nothing is freed before the transport goes, because cudaFree and
// cudaFreeHost can wait for the whole device, where NCCL kernels of the pipeline's links may
// be waiting for a peer that waits for this rank; buffers outgrown are kept until then too.
struct NcclStaging {
  std::vector<std::unique_ptr<NcclStagingSlot>> slots;
  std::vector<float*> retired_device, retired_host;

  // An available slot with at least these sizes (one that fits first, else one grown, else a
  // new one), held until its call finishes or is dropped. With the transport's device current.
  NcclStagingSlot& acquire(Device device, size_t device_need, size_t host_need) {
    NcclStagingSlot* pick = nullptr;
    for (const auto& slot : slots) {
      if (!slot->available()) continue;
      if (slot->fits(device_need, host_need)) {
        pick = slot.get();
        break;
      }
      if (!pick) pick = slot.get();
    }
    if (!pick) {
      slots.push_back(std::make_unique<NcclStagingSlot>());
      pick = slots.back().get();
      pick->done = std::make_unique<Event>(device, /*timing=*/false);
    }
    grow(*pick, device_need, host_need);
    pick->held = true;
    return *pick;
  }

  // With the transport's device current, and no work left on its group stream.
  void release() noexcept {
    for (const auto& slot : slots) {
      if (slot->device) retired_device.push_back(slot->device);
      if (slot->host) retired_host.push_back(slot->host);
    }
    slots.clear();
    for (float* d : retired_device) (void)cudaFree(d);
    for (float* h : retired_host) (void)cudaFreeHost(h);
    retired_device.clear();
    retired_host.clear();
  }

 private:
  void grow(NcclStagingSlot& slot, size_t device_need, size_t host_need) {
    if (device_need > slot.device_floats) {
      float* grown = nullptr;
      CONVEYOR_CUDA_CHECK(cudaMalloc(&grown, device_need * sizeof(float)));
      if (slot.device) retired_device.push_back(slot.device);
      slot.device = grown;
      slot.device_floats = device_need;
    }
    if (host_need > slot.host_floats) {
      float* grown = nullptr;
      CONVEYOR_CUDA_CHECK(cudaMallocHost(&grown, host_need * sizeof(float)));
      if (slot.host) retired_host.push_back(slot.host);
      slot.host = grown;
      slot.host_floats = host_need;
    }
  }
};

}  // namespace conveyor::comm::detail

#endif  // CONVEYOR_WITH_CUDA
