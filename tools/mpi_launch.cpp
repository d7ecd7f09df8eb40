#include "tools/mpi_launch.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <stdexcept>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "comm/launch_environment.h"
#include "comm/mpi_transport.h"
#include "engine/core/device.h"
#include "engine/pipeline/executor.h"
#include "tools/cli_common.h"

#ifdef CONVEYOR_WITH_MPI
#include <mpi.h>
#endif

namespace conveyor::cli {
namespace {

uint64_t hash_bytes(const void* data, size_t bytes) {
  return static_cast<uint64_t>(XXH3_64bits(data, bytes));
}

#ifdef CONVEYOR_WITH_MPI
void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw std::runtime_error(std::string(call) + " failed: " + std::string(text, length));
}

// Every rank's `text`, by rank.
std::vector<std::string> all_gather_text(const std::string& text, int ranks) {
  const int length = static_cast<int>(text.size());
  std::vector<int> lengths(ranks), offsets(ranks);
  check_mpi(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD),
            "MPI_Allgather");
  int total = 0;
  for (int r = 0; r < ranks; ++r) offsets[r] = total, total += lengths[r];
  std::string all(static_cast<size_t>(total), '\0');
  check_mpi(MPI_Allgatherv(text.data(), length, MPI_CHAR, all.data(), lengths.data(),
                           offsets.data(), MPI_CHAR, MPI_COMM_WORLD),
            "MPI_Allgatherv");
  std::vector<std::string> out;
  for (int r = 0; r < ranks; ++r) out.push_back(all.substr(offsets[r], lengths[r]));
  return out;
}

#ifdef OMPI_MAJOR_VERSION
// True when this OpenMPI has a component that reaches srun through Slurm's PMI-1 or PMI-2
// library (s1, s2: OpenMPI 2 to 4 built --with-pmi). MPI_T may start before MPI_Init, and
// OpenMPI's registers every component's variables (pmix_<component>_...), which names them.
bool openmpi_has_slurm_pmi() {
#if OMPI_MAJOR_VERSION >= 5
  return false;  // PMIx is its only way to a launcher
#else
  int provided = 0;
  if (MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return true;  // unknown
  int count = 0;
  MPI_T_cvar_get_num(&count);
  bool found = false;
  for (int i = 0; i < count && !found; ++i) {
    char name[256];
    int name_length = sizeof name, description_length = 0, verbosity = 0, bind = 0, scope = 0;
    MPI_Datatype type;
    MPI_T_enum values;
    if (MPI_T_cvar_get_info(i, name, &name_length, &verbosity, &type, &values, nullptr,
                            &description_length, &bind, &scope) != MPI_SUCCESS)
      continue;
    const std::string n(name);
    found = n.rfind("pmix_s1_", 0) == 0 || n.rfind("pmix_s2_", 0) == 0;
  }
  MPI_T_finalize();
  return found;
#endif
}
#endif

// Before MPI_Init: under srun, OpenMPI's MPI_Init reaches srun through the PMIx server that
// srun --mpi=pmix starts for the step, or through Slurm's PMI libraries (openmpi_has_slurm_pmi).
// Without either it does not start alone, as it does outside Slurm: it prints a help text
// that blames its build ("OMPI was not built with SLURM's PMI support") and ends the process
// with status 1, before check_mpi_sees_the_launch could name the flag. OpenMPI takes a process
// for one srun started when SLURM_NODELIST and SLURM_STEP_ID are set; so does this check.
// Every task of the step is refused alike, which the one srun numbers 0 says.
void refuse_openmpi_without_pmix_under_srun(const comm::LaunchEnvironment& launch) {
#ifdef OMPI_MAJOR_VERSION
  if (std::getenv("SLURM_NODELIST") == nullptr || std::getenv("SLURM_STEP_ID") == nullptr ||
      std::getenv("PMIX_RANK") != nullptr || openmpi_has_slurm_pmi())
    return;
  const char* plugin = std::getenv("SLURM_MPI_TYPE");
  std::string started = "(SLURM_STEP_ID=" + escaped_for_message(std::getenv("SLURM_STEP_ID")) + ")";
  if (launch.processes > 1)
    started = "as one of " + std::to_string(launch.processes) + " (" + launch.source + ")";
  throw ErrorOfEveryProcess(
      "srun started this process " + started + " " +
          (plugin != nullptr && std::string(plugin) != "none"
               ? "with its " + escaped_for_message(plugin) + " plugin (SLURM_MPI_TYPE), not PMIx"
               : std::string("without an MPI plugin (--mpi=none)")) +
          ", and this OpenMPI " + std::to_string(OMPI_MAJOR_VERSION) + "." +
          std::to_string(OMPI_MINOR_VERSION) + "." + std::to_string(OMPI_RELEASE_VERSION) +
          " reaches srun only through PMIx: its MPI_Init would end the process; give srun "
          "--mpi=pmix (srun --mpi=list shows what the cluster offers), or start the job with "
          "OpenMPI's own mpirun",
      kExitUsage);
#else
  (void)launch;
#endif
}
#endif

}  // namespace

void refuse_on_every_rank(const MpiSession& session, const std::string& message) {
  if (session.active()) throw ErrorOfEveryProcess(message, kExitUsage);
  throw UsageError(message);
}

ConfigField file_field(const std::string& name, const std::string& path) {
  if (path.empty()) return {name, ""};
  std::string digest;
  std::error_code error;
  // A FIFO or a device would never end; the data source refuses them with its own sentence.
  if (!std::filesystem::is_regular_file(path, error)) {
    digest = error ? std::string("cannot be opened: ") + error.message() : "not a regular file";
  } else if (std::FILE* file = std::fopen(path.c_str(), "rb")) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    std::vector<char> piece(1 << 20);
    size_t got = 0;
    while ((got = std::fread(piece.data(), 1, piece.size(), file)) > 0)
      XXH3_64bits_update(&state, piece.data(), got);
    const bool failed = std::ferror(file) != 0;
    std::fclose(file);
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(XXH3_64bits_digest(&state)));
    digest = failed ? "a read error" : std::string("contents XXH3 ") + hex;
  } else {
    digest = std::string("cannot be opened: ") + std::strerror(errno);
  }
  return {name, digest, escaped_for_message(path) + ", " + digest};
}

MpiSession::MpiSession(bool wanted, std::chrono::milliseconds timeout) : timeout_(timeout) {
  if (!wanted) return;
  // Read before MPI_Init, which may rewrite the launcher's variables (OpenMPI's singleton
  // start sets its own PMIx rank).
  const comm::LaunchEnvironment launch = comm::launch_environment();
#ifdef CONVEYOR_WITH_MPI
  refuse_openmpi_without_pmix_under_srun(launch);
  int provided = MPI_THREAD_SINGLE;
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
  active_ = true;
  if (provided < MPI_THREAD_SERIALIZED)
    throw std::runtime_error(
        "MPI gives thread level " + std::to_string(provided) +
        ", below MPI_THREAD_SERIALIZED, which the executor needs; use an MPI built with thread "
        "support");
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  check_mpi_sees_the_launch(launch, size_);
#else
  throw UsageError(
      "this build has no MPI, so it cannot run as one rank of several processes" +
      (launch.processes > 1 ? " (the launcher says " + launch.source + ")" : std::string()) +
      "; install libopenmpi-dev and reconfigure, or run one process without mpirun or srun");
#endif
}

void check_mpi_sees_the_launch(const comm::LaunchEnvironment& launch, int mpi_processes) {
  if (launch.processes <= 1) return;
  if (launch.at_least ? mpi_processes >= launch.processes : mpi_processes == launch.processes)
    return;
  throw UsageError(
      "the launcher started this process as one of " +
      std::string(launch.at_least ? "at least " : "") + std::to_string(launch.processes) + " (" +
      launch.source + ") but MPI sees " + std::to_string(mpi_processes) +
      ", so MPI did not reach the launcher and each process would train the whole job alone; "
      "under srun give the MPI plugin your MPI was built for (--mpi=pmix for Debian's OpenMPI), "
      "or start the job with that MPI's own mpirun");
}

void MpiSession::meet_at_the_end() const {
  if (active_) comm::mpi_roll_call("the end of the run", timeout_);
}

MpiSession::~MpiSession() {
#ifdef CONVEYOR_WITH_MPI
  // On the way out of a failure, no MPI_Finalize: it waits for every rank, and the rank that
  // failed may be gone or hung. The process exits non-zero without it and mpirun ends the job.
  if (active_ && std::uncaught_exceptions() == 0) MPI_Finalize();
#endif
}

void check_same_configuration(const MpiSession& session, const ConfigFields& fields) {
  if (!session.active()) return;
#ifdef CONVEYOR_WITH_MPI
  // The collectives below wait for every process: only once all are known to be there.
  comm::mpi_roll_call("the configuration check", session.timeout());
  const int ranks = session.size();
  std::vector<uint64_t> mine;
  for (const ConfigField& field : fields)
    mine.push_back(hash_bytes(field.value.data(), field.value.size()));
  const int count = static_cast<int>(mine.size());
  std::vector<int> counts(ranks);
  check_mpi(MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD),
            "MPI_Allgather");
  for (int r = 0; r < ranks; ++r)
    if (counts[r] != count)
      throw UsageError("rank " + std::to_string(r) + " checks " + std::to_string(counts[r]) +
                       " configuration fields, rank " + std::to_string(session.rank()) +
                       " checks " + std::to_string(count) +
                       "; start every rank with the same conveyor binary");
  std::vector<uint64_t> all(static_cast<size_t>(count) * ranks);
  check_mpi(MPI_Allgather(mine.data(), count, MPI_UINT64_T, all.data(), count, MPI_UINT64_T,
                          MPI_COMM_WORLD),
            "MPI_Allgather");
  for (int i = 0; i < count; ++i) {
    bool same = true;
    for (int r = 1; r < ranks; ++r) same = same && all[r * count + i] == all[i];
    if (same) continue;
    // Every rank sees the same table, so all of them gather the values of this field.
    const ConfigField& field = fields[i];
    const std::vector<std::string> values =
        all_gather_text(field.shown.empty() ? field.value : field.shown, ranks);
    std::string differing;
    for (int r = 1; r < ranks; ++r)
      if (all[r * count + i] != all[i])
        differing += (differing.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) +
                     " has '" + escaped_for_message(values[r]) + "'";
    // Every rank builds this same sentence from the same table.
    refuse_on_every_rank(session, "the ranks disagree on " + field.name + ": rank 0 has '" +
                                      escaped_for_message(values[0]) + "', " + differing +
                                      "; start every rank with the same configuration");
  }
#endif
}

std::string rank_zero_text(const MpiSession& session, const std::string& mine,
                           const std::string& what) {
  if (!session.active()) return mine;
#ifdef CONVEYOR_WITH_MPI
  comm::mpi_roll_call(what, session.timeout());
  return all_gather_text(mine, session.size()).front();
#else
  (void)what;
  return mine;
#endif
}

void check_gpus_not_shared(const MpiSession& session, Device device) {
  if (!session.active()) return;
#ifdef CONVEYOR_WITH_MPI
  // What two ranks share exactly when NCCL would call them one GPU of one host: the device's
  // UUID and the host id NCCL was given (empty: the machine's own); then, after a line break,
  // the device as the rank knows it, for the message. CPU ranks share nothing.
  std::string mine = "cpu\ncpu";
  if (device.is_cuda()) {
    const char* host_id = std::getenv("NCCL_HOSTID");
    mine =
        cuda_device_uuid(device.index) + " " + (host_id ? host_id : "") + "\n" + device.to_string();
  }
  comm::mpi_roll_call("the GPU check", session.timeout());
  const std::vector<std::string> all = all_gather_text(mine, session.size());
  const auto key_of = [](const std::string& t) { return t.substr(0, t.find('\n')); };
  const auto device_of = [](const std::string& t) { return t.substr(t.find('\n') + 1); };
  for (int r = 0; r < session.size(); ++r)
    for (int s = r + 1; s < session.size(); ++s) {
      if (key_of(all[r]) == "cpu" || key_of(all[r]) != key_of(all[s])) continue;
      // Every rank gathered the same table and stops at this same pair, so one says it.
      refuse_on_every_rank(session,
                           "ranks " + std::to_string(r) + " and " + std::to_string(s) +
                               " would run on the same GPU (" + all[r].substr(0, all[r].find(' ')) +
                               ", their " + device_of(all[r]) + " and " + device_of(all[s]) +
                               "), and NCCL refuses two ranks on one GPU: start at most as many "
                               "processes on a node as it has GPUs, each taking the GPU of its "
                               "node-local rank or seeing only its own (CUDA_VISIBLE_DEVICES)");
    }
#else
  (void)device;
#endif
}

uint64_t weights_checksum(PipelineExecutor& executor, const MpiSession& session) {
  const std::vector<Parameter*> params = executor.parameters();
  std::vector<uint64_t> digests(params.size(), 0);
  std::vector<std::byte> bytes;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i] == nullptr) continue;  // held by another process
    const Tensor& value = params[i]->value;
    bytes.resize(value.nbytes());
    copy_to_host(bytes.data(), value, bytes.size());
    digests[i] = hash_bytes(bytes.data(), bytes.size());
  }
#ifdef CONVEYOR_WITH_MPI
  // Each slot has one contributor and zeros elsewhere, so OR gathers the digests exactly.
  if (session.active()) {
    comm::mpi_roll_call("the weights checksum", session.timeout());
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, digests.data(), static_cast<int>(digests.size()),
                            MPI_UINT64_T, MPI_BOR, MPI_COMM_WORLD),
              "MPI_Allreduce");
  }
#endif
  return hash_bytes(digests.data(), digests.size() * sizeof(uint64_t));
}

}  // namespace conveyor::cli
