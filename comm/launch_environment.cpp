#include "comm/launch_environment.h"

#include <cerrno>
#include <cstdlib>
#include <optional>
#include <stdexcept>

#include "comm/transport.h"

#ifdef CONVEYOR_WITH_MPI
#include <mpi.h>
#endif

namespace conveyor::comm {
namespace {

// Launchers write these numbers plainly; the cap keeps PMIX_RANK + 1 and every count in an int.
constexpr long kMaxProcesses = 1000000000L;

// A launcher's value as it may be echoed on one line.
std::string printable(const char* value) {
  std::string out;
  for (const char* c = value; *c != '\0'; ++c) {
    const auto b = static_cast<unsigned char>(*c);
    if (b >= 0x20 && b < 0x7f) {
      out += *c;
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += std::string("\\x") + kHex[b >> 4] + kHex[b & 15];
    }
  }
  return out;
}

// The variable's value, nothing when it is unset; set, it must be a whole number from `least`
// to kMaxProcesses. Ignoring a damaged value would run this process alone, and every process
// of the job would then train the whole job by itself.
std::optional<int> launcher_number(const char* name, long least, const char* what) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  bool digits = *value != '\0';
  for (const char* c = value; *c != '\0' && digits; ++c) digits = *c >= '0' && *c <= '9';
  errno = 0;
  const long n = digits ? std::strtol(value, nullptr, 10) : 0;
  const long most = least == 0 ? kMaxProcesses - 1 : kMaxProcesses;
  if (!digits || errno == ERANGE || n < least || n > most)
    throw std::invalid_argument(std::string(name) + " is '" + printable(value) + "', not a " +
                                what + " (a whole number from " + std::to_string(least) + " to " +
                                std::to_string(most) +
                                "); fix or unset it, as running alone would have every process "
                                "train the whole job");
  return static_cast<int>(n);
}

// A rank, or nothing for a value that is not one. A bad node-local rank falls back to asking
// MPI, as an absent one does, since at worst two processes then share a GPU; a bad launch rank
// makes the process speak as the first of its launch, at worst repeating a refusal.
std::optional<int> rank_from(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || n < 0 || n >= kMaxProcesses) return std::nullopt;
  return static_cast<int>(n);
}

std::string shown(const char* name, int value) {
  return std::string(name) + "=" + std::to_string(value);
}

}  // namespace

LaunchEnvironment launch_environment() {
  LaunchEnvironment out;
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"})
    if (const auto n = launcher_number(name, 1, "process count")) {
      out.processes = *n;
      out.source = shown(name, *n);
      return out;
    }
  const auto pmix_rank = launcher_number("PMIX_RANK", 0, "process rank");
  const auto slurm_rank = launcher_number("SLURM_PROCID", 0, "process rank");
  if (const auto n = launcher_number("SLURM_NTASKS", 1, "process count")) {
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

int launched_process_rank() {
  // As for the node-local rank, Slurm's number counts only inside a step of its own.
  const bool slurm_step =
      std::getenv("SLURM_STEP_NUM_TASKS") != nullptr || std::getenv("PMIX_RANK") != nullptr;
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID", "PMIX_RANK"}) {
    if (std::string(name) == "SLURM_PROCID" && !slurm_step) continue;
    if (const auto n = rank_from(name)) return *n;
  }
  return 0;
}

int node_local_rank() {
  // SLURM_LOCALID also reaches processes that mpirun starts inside an allocation, where it
  // is the batch script's, so Slurm's counts only in a step of its own.
  const bool slurm_step =
      std::getenv("SLURM_STEP_NUM_TASKS") != nullptr || std::getenv("PMIX_RANK") != nullptr;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    if (std::string(name) == "SLURM_LOCALID" && !slurm_step) continue;
    if (const auto n = rank_from(name)) return *n;
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
          "its GPU (Device::cuda(N))");
    int rank = 0;
    MPI_Comm_rank(node, &rank);
    MPI_Comm_free(&node);
    return rank;
  }
#endif
  return 0;
}

}  // namespace conveyor::comm
