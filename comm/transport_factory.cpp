#include "comm/transport_factory.h"

#include <set>
#include <stdexcept>

#include "comm/in_process.h"
#include "comm/nccl.h"

namespace conveyor::comm {
namespace {

bool one_gpu_per_rank(const std::vector<Device>& devices) {
  std::set<int> seen;
  for (const Device& d : devices)
    if (!d.is_cuda() || !seen.insert(d.index).second) return false;
  return true;
}

}  // namespace

TransportKind choose_transport(TransportKind requested, const std::vector<Device>& devices) {
  const bool distinct_gpus = one_gpu_per_rank(devices);
  switch (requested) {
    case TransportKind::kInProcess:
      return TransportKind::kInProcess;
    case TransportKind::kAuto:
      return devices.size() > 1 && distinct_gpus && nccl_available() ? TransportKind::kNccl
                                                                     : TransportKind::kInProcess;
    case TransportKind::kNccl:
      if (!distinct_gpus)
        throw std::invalid_argument("the NCCL transport needs one CUDA device per rank");
#ifndef CONVEYOR_WITH_CUDA
      throw std::invalid_argument("this build has no NCCL; use the in-process transport");
#endif
      return TransportKind::kNccl;
  }
  throw std::invalid_argument("unknown transport kind " +
                              std::to_string(static_cast<int>(requested)));
}

Transports make_transports(TransportKind requested, const std::vector<Device>& devices,
                           std::chrono::milliseconds timeout) {
  Transports out;
  out.kind = choose_transport(requested, devices);
  if (out.kind == TransportKind::kNccl) {
#ifdef CONVEYOR_WITH_CUDA
    std::vector<int> indices;
    for (const Device& d : devices) indices.push_back(d.index);
    out.per_rank = make_nccl_transports(indices, timeout);
#endif
    return out;
  }
  auto hub = InProcessHub::create(static_cast<int>(devices.size()), timeout);
  for (int r = 0; r < hub->size(); ++r) out.per_rank.push_back(hub->endpoint(r));
  return out;
}

}  // namespace conveyor::comm
