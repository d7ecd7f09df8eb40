#pragma once
// Chooses how pipeline ranks exchange tensors and builds one transport per rank.
#include <chrono>
#include <memory>
#include <vector>

#include "comm/transport.h"
#include "engine/core/device.h"

namespace conveyor::comm {

// kAuto: MPI when the launcher (mpirun, srun) started this process among several; else NCCL
// when there are several ranks, every rank has a GPU of its own and NCCL is usable;
// in-process otherwise (CPU ranks, or ranks sharing a GPU on their own streams).
// kMpi: one rank per process, CPU ranks only (GPU processes need NCCL bootstrapped over MPI,
// which is not built yet).
enum class TransportKind { kAuto, kInProcess, kNccl, kMpi };

// The name of `kind` as the command line spells it: auto, inproc, nccl, mpi.
const char* transport_name(TransportKind kind);

// True for kinds that connect processes, each holding one rank, rather than the ranks of
// one process.
bool spans_processes(TransportKind kind);

struct Transports {
  std::vector<std::unique_ptr<Transport>> per_rank;  // rank r's endpoint at [r]
  TransportKind kind = TransportKind::kInProcess;    // what kAuto resolved to
};

// The kind `requested` resolves to for ranks on `devices`. Throws std::invalid_argument when
// NCCL is asked for ranks that do not each have a CUDA device of their own, or by a build
// without NCCL; and when MPI is asked for (or chosen by kAuto) by a build without MPI, or for
// ranks that are not all on the CPU.
TransportKind choose_transport(TransportKind requested, const std::vector<Device>& devices);

// One transport per rank r on devices[r], of the chosen kind; `timeout` bounds every wait
// for a peer. Call from one thread. For a kind that spans processes, only this process's
// endpoint: per_rank holds it alone, at [0], and its rank() is the rank the process holds
// (MPI must be initialised, and have as many processes as `devices` has ranks).
Transports make_transports(TransportKind requested, const std::vector<Device>& devices,
                           std::chrono::milliseconds timeout);

}  // namespace conveyor::comm
