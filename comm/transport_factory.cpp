#include "comm/transport_factory.h"

#include <set>
#include <stdexcept>

#include "comm/in_process.h"
#include "comm/mpi_transport.h"
#include "comm/nccl.h"
#include "engine/core/enum_value.h"
#include "engine/core/number_text.h"

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
        "the MPI transport carries CPU ranks only; GPU ranks across processes go over NCCL "
        "bootstrapped over MPI (TransportKind::kNccl or TransportKind::kAuto), or run on the CPU "
        "(Device::cpu())");
  return TransportKind::kMpi;
}

bool all_cuda(const std::vector<Device>& devices) {
  for (const Device& d : devices)
    if (!d.is_cuda()) return false;
  return true;
}

// Processes on several nodes may use the same device index, so distinctness is NCCL's to
// check (it refuses two ranks of one communicator on one GPU).
TransportKind check_nccl_over_mpi(const std::vector<Device>& devices) {
#ifndef CONVEYOR_WITH_CUDA
  throw std::invalid_argument(
      "this build has no NCCL, so ranks cannot talk over NCCL across processes; rebuild with "
      "the CUDA toolkit and NCCL, or run CPU ranks over MPI (Device::cpu() with "
      "TransportKind::kMpi)");
#endif
  if (!mpi_built())
    throw std::invalid_argument(
        "NCCL across processes is bootstrapped over MPI, which is not in this build (install "
        "libopenmpi-dev and reconfigure)");
  if (!all_cuda(devices))
    throw std::invalid_argument(
        "NCCL across processes carries CUDA ranks only; use CUDA devices (Device::cuda()), or "
        "CPU ranks (Device::cpu()) with the MPI transport");
  return TransportKind::kNcclOverMpi;
}

}  // namespace

const char* transport_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kInProcess:
      return "inproc";
    case TransportKind::kNccl:
    case TransportKind::kNcclOverMpi:
      return "nccl";
    case TransportKind::kMpi:
      return "mpi";
  }
  return "unknown";
}

void check_transport_kind(TransportKind kind, const std::string& field) {
  check_enum_value(kind,
                   {TransportKind::kAuto, TransportKind::kInProcess, TransportKind::kNccl,
                    TransportKind::kMpi, TransportKind::kNcclOverMpi},
                   field, "TransportKind::kAuto, kInProcess, kNccl, kMpi or kNcclOverMpi");
}

bool spans_processes(TransportKind kind) {
  return kind == TransportKind::kMpi || kind == TransportKind::kNcclOverMpi;
}

bool one_rank_per_process(TransportKind requested) {
  switch (requested) {
    case TransportKind::kMpi:
    case TransportKind::kNcclOverMpi:
      return true;
    case TransportKind::kAuto:
      return launched_process_count() > 1;
    case TransportKind::kNccl:  // asked for under a launcher, even of one process
      return launched_process_count() > 0;
    case TransportKind::kInProcess:
      return false;
  }
  return false;
}

namespace {

std::string process_count_text(int ranks, int processes, const std::string& made_of) {
  return (made_of.empty() ? "the pipeline has " + counted(ranks, "rank")
                          : "the run has " + std::to_string(ranks) + " ranks (" + made_of + ")") +
         " but MPI started " + counted(processes, "process", "processes") +
         "; start one process per rank (mpirun -np " + std::to_string(ranks) + ")";
}

}  // namespace

ProcessCountMismatch::ProcessCountMismatch(int ranks, int processes, const std::string& made_of)
    : std::invalid_argument(process_count_text(ranks, processes, made_of)),
      ranks_(ranks),
      processes_(processes) {}

TransportKind choose_transport(TransportKind requested, const std::vector<Device>& devices) {
  const bool distinct_gpus = one_gpu_per_rank(devices);
  switch (requested) {
    case TransportKind::kInProcess:
      return TransportKind::kInProcess;
    case TransportKind::kMpi:
      return check_mpi(devices);
    case TransportKind::kAuto:
      // Started among other processes: the ranks are the processes, over MPI for CPU ranks
      // and over NCCL bootstrapped over MPI for CUDA ranks.
      if (launched_process_count() > 1)
        return all_cpu(devices) ? check_mpi(devices) : check_nccl_over_mpi(devices);
      return devices.size() > 1 && distinct_gpus && nccl_available() ? TransportKind::kNccl
                                                                     : TransportKind::kInProcess;
    case TransportKind::kNcclOverMpi:
      return check_nccl_over_mpi(devices);
    case TransportKind::kNccl:
      if (launched_process_count() > 0) return check_nccl_over_mpi(devices);
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
                           std::chrono::milliseconds timeout,
                           const std::vector<std::vector<int>>& groups) {
  check_timeout(timeout, "the transport timeout");
  Transports out;
  out.kind = choose_transport(requested, devices);
  if (out.kind == TransportKind::kMpi) {
    out.per_rank.push_back(make_mpi_transport(timeout));
    const int processes = out.per_rank[0]->size();
    if (processes != static_cast<int>(devices.size()))
      throw ProcessCountMismatch(static_cast<int>(devices.size()), processes);
    return out;
  }
  if (out.kind == TransportKind::kNccl || out.kind == TransportKind::kNcclOverMpi) {
#ifdef CONVEYOR_WITH_CUDA
    std::vector<int> indices;
    for (const Device& d : devices) indices.push_back(d.index);
    if (out.kind == TransportKind::kNccl)
      out.per_rank = make_nccl_transports(indices, timeout, groups);
    else
      out.per_rank.push_back(make_nccl_transport_over_mpi(indices, timeout, groups));
#endif
    return out;
  }
  auto hub = InProcessHub::create(static_cast<int>(devices.size()), timeout);
  for (int r = 0; r < hub->size(); ++r) out.per_rank.push_back(hub->endpoint(r));
  return out;
}

}  // namespace conveyor::comm
