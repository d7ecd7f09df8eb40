#include "comm/launch_environment.h"

#include <cstdlib>
#include <optional>

#include "comm/transport.h"

#ifdef CONVEYOR_WITH_MPI
#include <mpi.h>
#endif

namespace conveyor::comm {
namespace {

// The variable's value when it is a whole number of at least `least`.
std::optional<int> number_from(const char* name, long least) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || n < least || n > 1000000000L) return std::nullopt;
  return static_cast<int>(n);
}

std::string shown(const char* name, int value) {
  return std::string(name) + "=" + std::to_string(value);
}

}  // namespace

LaunchEnvironment launch_environment() {
  LaunchEnvironment out;
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"})
    if (const auto n = number_from(name, 1)) {
      out.processes = *n;
      out.source = shown(name, *n);
      return out;
    }
  const auto pmix_rank = number_from("PMIX_RANK", 0);
  const auto slurm_rank = number_from("SLURM_PROCID", 0);
  if (const auto n = number_from("SLURM_NTASKS", 1)) {
    if (pmix_rank) {
      out.processes = *n;
      out.source = shown("SLURM_NTASKS", *n) + " with " + shown("PMIX_RANK", *pmix_rank);
      return out;
    }
    if (slurm_rank && *slurm_rank > 0) {
      out.processes = *n;
      out.source = shown("SLURM_NTASKS", *n) + " with " + shown("SLURM_PROCID", *slurm_rank);
      return out;
    }
  }
  if (pmix_rank && *pmix_rank > 0) {
    out.processes = *pmix_rank + 1;
    out.at_least = true;
    out.source = shown("PMIX_RANK", *pmix_rank);
  }
  return out;
}

int launched_process_count() { return launch_environment().processes; }

int node_local_rank() {
  // SLURM_LOCALID also reaches processes that mpirun starts inside an allocation, where it
  // is the batch script's, so Slurm's counts only in a step of its own.
  const bool slurm_step =
      std::getenv("SLURM_STEP_NUM_TASKS") != nullptr || std::getenv("PMIX_RANK") != nullptr;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (std::string(name) == "SLURM_LOCALID" && !slurm_step) continue;
    if (const auto n = number_from(name, 0)) return *n;
  }
#ifdef CONVEYOR_WITH_MPI
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  if (initialised && !finalised) {
    MPI_Comm node = MPI_COMM_NULL;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) !=
        MPI_SUCCESS)
      throw TransportError(
          "MPI_Comm_split_type failed, so this process cannot tell its rank on its node; name "
          "its GPU with --device cuda:N");
    int rank = 0;
    MPI_Comm_rank(node, &rank);
    MPI_Comm_free(&node);
    return rank;
  }
#endif
  return 0;
}

}  // namespace conveyor::comm
