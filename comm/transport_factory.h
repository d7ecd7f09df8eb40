#pragma once
// Chooses how pipeline ranks exchange tensors and builds one transport per rank.
#include <chrono>
#include <memory>
#include <vector>

#include "comm/transport.h"
#include "engine/core/device.h"

namespace conveyor::comm {

// kAuto: NCCL when there are several ranks, every rank has a GPU of its own and NCCL is
// usable; in-process otherwise (CPU ranks, or ranks sharing a GPU on their own streams).
enum class TransportKind { kAuto, kInProcess, kNccl };

struct Transports {
  std::vector<std::unique_ptr<Transport>> per_rank;  // rank r's endpoint at [r]
  TransportKind kind = TransportKind::kInProcess;    // what kAuto resolved to
};

// The kind `requested` resolves to for ranks on `devices`. Throws std::invalid_argument when
// NCCL is asked for ranks that do not each have a CUDA device of their own, or by a build
// without NCCL.
TransportKind choose_transport(TransportKind requested, const std::vector<Device>& devices);

// One transport per rank r on devices[r], of the chosen kind; `timeout` bounds every wait
// for a peer. Call from one thread.
Transports make_transports(TransportKind requested, const std::vector<Device>& devices,
                           std::chrono::milliseconds timeout);

}  // namespace conveyor::comm
