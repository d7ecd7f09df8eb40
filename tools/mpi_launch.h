#pragma once
// `conveyor train` across processes: MPI start-up and shutdown, the check that every rank
// runs the same configuration, and what only makes sense over all ranks (the weights'
// checksum). Without MPI in the build, MpiSession is never active and the rest is local.
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/launch_environment.h"
#include "engine/core/device.h"

namespace conveyor {
class PipelineExecutor;
}

namespace conveyor::cli {

// MPI for the lifetime of the object, when `wanted`: MPI_Init_thread asking for
// MPI_THREAD_SERIALIZED (the executor calls MPI from one thread at a time), the level given
// checked, and as many processes as the launcher said (check_mpi_sees_the_launch); a task of
// an srun step that gave it no PMIx server is refused before MPI_Init when the MPI is an
// OpenMPI, whose MPI_Init would end it with a text of its own (exit status 1);
// MPI_Finalize at the end, unless an exception is leaving (a peer may be gone).
// `timeout` bounds the waits of the checks below for the other processes (the run's
// --timeout).
class MpiSession {
 public:
  MpiSession(bool wanted, std::chrono::milliseconds timeout);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  bool active() const { return active_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // At the end of a run that went well, before MPI_Finalize (which waits for every process):
  // a roll call, so that a process stopped or hung there ends the others with an error naming
  // it instead of holding them. Nothing to do when the session is not active.
  void meet_at_the_end() const;

 private:
  std::chrono::milliseconds timeout_;
  bool active_ = false;
  int rank_ = 0;
  int size_ = 1;
};

// Throws UsageError when the launcher said this process is one of several (`launch`) and MPI,
// now initialised, disagrees with `mpi_processes`: MPI then runs as a singleton (srun
// without the plugin of this MPI), and every process would train the whole job by itself.
void check_mpi_sees_the_launch(const comm::LaunchEnvironment& launch, int mpi_processes);

// Ends the run with `message` where every rank of the session reaches this same refusal: an
// ErrorOfEveryProcess of status 2, which rank 0 alone prints; without an active session, a
// UsageError.
[[noreturn]] void refuse_on_every_rank(const MpiSession& session, const std::string& message);

// A setting the ranks must agree on: `name` as the error names it, `value` what is compared
// (by hash), `shown` what the error shows of each rank's value (`value` when empty).
struct ConfigField {
  std::string name;
  std::string value;
  std::string shown = {};
};
// Every setting the ranks must agree on, in the order they are checked.
using ConfigFields = std::vector<ConfigField>;

// The field for the file at `path` (empty: none given), compared by its contents, so that one
// path naming different files on two nodes (or in two working directories) is refused, and
// copies of one file at different paths are not. The XXH3-64 is taken in pieces, for data
// files larger than memory; a file that cannot be read, or is not a regular file, compares as
// such without being read.
ConfigField file_field(const std::string& name, const std::string& path);

// Compares a hash of every field over all ranks of `session`; throws UsageError naming the
// first field that differs, with the value of each rank that differs from rank 0. Nothing to
// do when the session is not active. A process that does not come within the session's
// timeout ends it with an error (comm::mpi_roll_call), on rank 0 naming that process.
void check_same_configuration(const MpiSession& session, const ConfigFields& fields);

// Rank 0's `mine` on every rank of an active session (`mine` itself without one): what one
// process decides and all must follow, such as the plan of --partition auto, which each
// process profiles on its own device. A collective, bounded by the session's timeout as the
// configuration check is; `what` names it in a timeout's error.
std::string rank_zero_text(const MpiSession& session, const std::string& mine,
                           const std::string& what);

// Under an active session, a collective of every rank with the device it runs on: throws
// UsageError naming two CUDA ranks that would run on one GPU (the same device UUID, gathered
// from every rank), which NCCL refuses with an error that names neither the cause nor the
// way out. Ranks whose NCCL_HOSTID differs are hosts of their own to NCCL, which lets them
// share a GPU over sockets (how one GPU tests NCCL across processes), so they pass. Bounded
// by the session's timeout as the configuration check is.
void check_gpus_not_shared(const MpiSession& session, Device device);

// XXH3-64 over the XXH3-64 of every parameter's value bytes, in global parameter order,
// gathered from every rank (over MPI when the session is active): one number that says
// whether two runs ended with the same weights bit for bit. Bounded by the session's timeout
// as the configuration check is.
uint64_t weights_checksum(PipelineExecutor& executor, const MpiSession& session);

}  // namespace conveyor::cli
