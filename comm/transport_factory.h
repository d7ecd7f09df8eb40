#pragma once
// Chooses how pipeline ranks exchange tensors and builds one transport per rank.
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/transport.h"
#include "engine/core/device.h"

namespace conveyor::comm {

// kAuto: when the launcher (mpirun, srun) started this process among several, one rank per
// process, over NCCL bootstrapped over MPI for CUDA ranks and over MPI for CPU ranks; else
// NCCL when there are several ranks, every rank has a GPU of its own and NCCL is usable;
// in-process otherwise (CPU ranks, or ranks sharing a GPU on their own streams).
// kNccl: threads of one process; under a launcher (even of one process), one rank per
// process (kNcclOverMpi).
// kMpi: one rank per process, CPU ranks only.
// kNcclOverMpi: what kNccl and kAuto resolve to for CUDA ranks across processes.
enum class TransportKind { kAuto, kInProcess, kNccl, kMpi, kNcclOverMpi };

// The name of `kind` as the command line spells it: auto, inproc, nccl, mpi (kNcclOverMpi
// is nccl too: the command line asks for NCCL, the launcher makes it span processes).
const char* transport_name(TransportKind kind);

// Throws std::invalid_argument unless `kind` is one of the enum's values (one made by a cast
// may not be), naming it as `field` ("ExecutorOptions::transport").
void check_transport_kind(TransportKind kind, const std::string& field);

// True for kinds that connect processes, each holding one rank, rather than the ranks of
// one process.
bool spans_processes(TransportKind kind);

// True when `requested` makes each process hold one rank of its own: MPI, NCCL under a
// launcher, and auto when the launcher started several processes. Such a process knows only its own
// rank's device.
bool one_rank_per_process(TransportKind requested);

// Thrown by make_transports when MPI started another number of processes than the pipeline
// has ranks: every process reaches it, with the same sentence, so a launcher's output can
// show it once.
class ProcessCountMismatch : public std::invalid_argument {
 public:
  // `made_of`: what the ranks are, said after their count ("1 pipeline rank x 2 data-parallel
  // replicas"); empty for the ranks of one pipeline.
  ProcessCountMismatch(int ranks, int processes, const std::string& made_of = "");
  int ranks() const { return ranks_; }
  int processes() const { return processes_; }

 private:
  int ranks_ = 0;
  int processes_ = 0;
};

struct Transports {
  std::vector<std::unique_ptr<Transport>> per_rank;  // rank r's endpoint at [r]
  TransportKind kind = TransportKind::kInProcess;    // what kAuto resolved to
};

// The kind `requested` resolves to for ranks on `devices`. Throws std::invalid_argument when
// NCCL is asked for ranks that do not each have a CUDA device of their own (across processes:
// that are not all on CUDA devices), or by a build without NCCL; and when MPI is needed (for
// the MPI transport or NCCL's bootstrap) by a build without MPI, or MPI is asked for ranks
// that are not all on the CPU.
TransportKind choose_transport(TransportKind requested, const std::vector<Device>& devices);

// One transport per rank r on devices[r], of the chosen kind; `timeout` bounds every wait
// for a peer; `groups`: the groups of ranks that will make group calls (data parallelism's
// replica groups), which NCCL makes a communicator for each of at creation (the other
// transports need nothing made in advance). Call from one thread. For a kind that spans processes,
// only this process's endpoint: per_rank holds it alone, at [0], and its rank() is the rank the
// process holds (MPI must be initialised, and have as many processes as `devices` has ranks); over
// NCCL it runs on devices[its rank], every process making its communicators at the same time.
// Throws ProcessCountMismatch when MPI has another number of processes than `devices` ranks.
// Throws std::invalid_argument for a `timeout` outside 1 ms to kMaxTimeoutMs (check_timeout).
Transports make_transports(TransportKind requested, const std::vector<Device>& devices,
                           std::chrono::milliseconds timeout,
                           const std::vector<std::vector<int>>& groups = {});

}  // namespace conveyor::comm
