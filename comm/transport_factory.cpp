#include "comm/transport_factory.h"

#include <set>
#include <stdexcept>

#include "comm/in_process.h"
#include "comm/mpi_transport.h"
#include "comm/nccl.h"

namespace conveyor::comm {
namespace {

bool one_gpu_per_rank(const std::vector<Device>& devices) {
  std::set<int> seen;
  for (const Device& d : devices)
    if (!d.is_cuda() || !seen.insert(d.index).second) return false;
  return true;
}

bool all_cpu(const std::vector<Device>& devices) {
  for (const Device& d : devices)
    if (!d.is_cpu()) return false;
  return true;
}

TransportKind check_mpi(const std::vector<Device>& devices) {
  if (!mpi_built())
    throw std::invalid_argument(
        "the MPI transport is not in this build (install libopenmpi-dev and reconfigure)" +
        std::string(launched_process_count() > 1
                        ? ", yet the launcher started " + std::to_string(launched_process_count()) +
                              " processes of it"
                        : ""));
  if (!all_cpu(devices))
    throw std::invalid_argument(
        "the MPI transport carries CPU ranks only; GPU ranks across processes need NCCL "
        "bootstrapped over MPI, which is not built yet (use --device cpu)");
  return TransportKind::kMpi;
}

}  // namespace

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kInProcess:
      return "inproc";
    case TransportKind::kNccl:
      return "nccl";
    case TransportKind::kMpi:
      return "mpi";
  }
  return "unknown";
}

bool spans_processes(TransportKind kind) { return kind == TransportKind::kMpi; }

TransportKind choose_transport(TransportKind requested, const std::vector<Device>& devices) {
  const bool distinct_gpus = one_gpu_per_rank(devices);
  switch (requested) {
    case TransportKind::kInProcess:
      return TransportKind::kInProcess;
    case TransportKind::kMpi:
      return check_mpi(devices);
    case TransportKind::kAuto:
      // Started among other processes: the ranks are the processes, whatever the devices.
      if (launched_process_count() > 1) return check_mpi(devices);
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
  if (out.kind == TransportKind::kMpi) {
    out.per_rank.push_back(make_mpi_transport(timeout));
    const int processes = out.per_rank[0]->size();
    if (processes != static_cast<int>(devices.size()))
      throw std::invalid_argument("the pipeline has " + std::to_string(devices.size()) +
                                  " ranks but MPI started " + std::to_string(processes) +
                                  " processes; start one process per rank (mpirun -np " +
                                  std::to_string(devices.size()) + ")");
    return out;
  }
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
