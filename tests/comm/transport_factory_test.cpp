// Choosing and building transports: the in-process transport for CPU ranks and for ranks
// sharing a GPU, NCCL only for one GPU per rank, and clear errors for impossible requests.
#include "comm/transport_factory.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/in_process.h"
#include "comm/launch_environment.h"
#include "comm/mpi_transport.h"
#include "comm/nccl.h"
#include "engine/core/device_context.h"
#include "support/test_util.h"

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;

// Sets an environment variable for the scope, as a launcher would, and restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The count MPI started against the ranks, in words a user reads as written: one rank, one
// process.
TEST(TransportFactory, AProcessCountMismatchSaysBothCountsInTheirNumber) {
  EXPECT_STREQ(ProcessCountMismatch(1, 2).what(),
               "the pipeline has 1 rank but MPI started 2 processes; start one process per rank "
               "(mpirun -np 1)");
  EXPECT_STREQ(ProcessCountMismatch(2, 1).what(),
               "the pipeline has 2 ranks but MPI started 1 process; start one process per rank "
               "(mpirun -np 2)");
}

TEST(TransportFactory, AutoChoosesInProcessUnlessEveryRankHasAGpuOfItsOwn) {
  const Device cpu = Device::cpu();
  EXPECT_EQ(choose_transport(TransportKind::kAuto, {cpu}), TransportKind::kInProcess);
  EXPECT_EQ(choose_transport(TransportKind::kAuto, {cpu, cpu, cpu}), TransportKind::kInProcess);
  // Ranks sharing a GPU, or a CPU rank among GPU ranks.
  const Device gpu0 = Device::cuda(0), gpu1 = Device::cuda(1);
  EXPECT_EQ(choose_transport(TransportKind::kAuto, {gpu0, gpu0}), TransportKind::kInProcess);
  EXPECT_EQ(choose_transport(TransportKind::kAuto, {gpu0, cpu}), TransportKind::kInProcess);
  // One rank needs no transfers: no NCCL communicators for it.
  EXPECT_EQ(choose_transport(TransportKind::kAuto, {gpu0}), TransportKind::kInProcess);
  EXPECT_EQ(choose_transport(TransportKind::kAuto, {gpu0, gpu1}),
            nccl_available() ? TransportKind::kNccl : TransportKind::kInProcess);
  EXPECT_EQ(choose_transport(TransportKind::kInProcess, {gpu0, gpu1}), TransportKind::kInProcess);
}

TEST(TransportFactory, NcclWithoutOneGpuPerRankIsAClearError) {
  const Device cpu = Device::cpu(), gpu0 = Device::cuda(0);
  for (const auto& devices : {std::vector<Device>{cpu, cpu}, std::vector<Device>{gpu0, gpu0},
                              std::vector<Device>{gpu0, cpu}}) {
    try {
      choose_transport(TransportKind::kNccl, devices);
      FAIL() << "NCCL accepted for " << devices.size() << " ranks without a GPU each";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("needs one CUDA device per rank"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(make_transports(TransportKind::kNccl, devices, 1000ms), std::invalid_argument);
  }
}

TEST(TransportFactory, InProcessTransportsAreWiredRankByRankWithTheTimeout) {
  const std::vector<Device> devices(3, Device::cpu());
  Transports made = make_transports(TransportKind::kAuto, devices, 50ms);
  EXPECT_EQ(made.kind, TransportKind::kInProcess);
  ASSERT_EQ(made.per_rank.size(), 3u);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(made.per_rank[r]->rank(), r);
    EXPECT_EQ(made.per_rank[r]->size(), 3);
  }
  DeviceContext ctx(Device::cpu());
  const auto values = testing::random_floats(7, 21);
  Tensor sent = ctx.empty({7});
  copy_from_host(sent, values.data(), values.size() * sizeof(float));
  made.per_rank[2]->send(sent, 0, ctx.compute_stream());
  Tensor got = ctx.empty({7});
  made.per_rank[0]->recv(got, 2, ctx.compute_stream());
  EXPECT_EQ(to_vector_f32(got), values);
  // The timeout reaches the hub: a receive with no sender fails after 50 ms.
  try {
    made.per_rank[1]->recv(got, 0, ctx.compute_stream());
    FAIL() << "receive with no sender returned";
  } catch (const TransportError& e) {
    EXPECT_NE(std::string(e.what()).find("within 50 ms"), std::string::npos) << e.what();
  }
}

// Deadlines are now() + timeout: a timeout past the bound overflowed the clock's nanoseconds
// into a deadline already past, and one below 1 ms failed every wait at once.
TEST(TransportFactory, ATimeoutOutsideOneMsToTheBoundIsRefusedByEveryTransport) {
  auto refusal = [](const std::function<void()>& make) {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  const std::vector<Device> cpus(2, Device::cpu());
  const std::string range = " must be from 1 ms to 1000000000 ms (10^6 s), got ";
  EXPECT_EQ(refusal([&] { make_transports(TransportKind::kAuto, cpus, 0ms); }),
            "the transport timeout" + range + "0 ms");
  EXPECT_EQ(refusal([&] { make_transports(TransportKind::kInProcess, cpus, -1ms); }),
            "the transport timeout" + range + "-1 ms");
  const auto huge = std::chrono::milliseconds::max();
  EXPECT_EQ(refusal([&] { make_transports(TransportKind::kAuto, cpus, huge); }),
            "the transport timeout" + range + std::to_string(huge.count()) + " ms");
  EXPECT_EQ(refusal([&] { InProcessHub::create(2, std::chrono::milliseconds(kMaxTimeoutMs + 1)); }),
            "the in-process transport's timeout" + range + "1000000001 ms");
  if (mpi_built())  // refused before it asks whether MPI is initialised
    EXPECT_EQ(refusal([&] { make_mpi_transport(0ms); }),
              "the MPI transport's timeout" + range + "0 ms");
  EXPECT_EQ(refusal([&] {
              make_transports(TransportKind::kAuto, cpus, std::chrono::milliseconds(kMaxTimeoutMs));
            }),
            "(accepted)");
}

TEST(TransportFactory, MpiIsForCpuRanksAndOnlyWhereTheBuildHasIt) {
  const Device cpu = Device::cpu(), gpu0 = Device::cuda(0), gpu1 = Device::cuda(1);
  // Not started by a launcher (ctest runs this binary alone): auto never picks MPI.
  ASSERT_LE(launched_process_count(), 1);
  EXPECT_NE(choose_transport(TransportKind::kAuto, {cpu, cpu}), TransportKind::kMpi);
  try {
    choose_transport(TransportKind::kMpi, {gpu0, gpu1});
    FAIL() << "MPI accepted for GPU ranks";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(mpi_built() ? "CPU ranks only" : "not in this build"), std::string::npos)
        << what;
  }
  if (mpi_built()) {
    EXPECT_EQ(choose_transport(TransportKind::kMpi, {cpu, cpu}), TransportKind::kMpi);
    EXPECT_TRUE(spans_processes(TransportKind::kMpi));
    EXPECT_FALSE(spans_processes(TransportKind::kInProcess));
    // The program, not the library, initialises MPI: the transport says so instead of
    // initialising it behind the program's back.
    try {
      make_transports(TransportKind::kMpi, {cpu, cpu}, 1000ms);
      FAIL() << "an MPI transport was made without MPI_Init";
    } catch (const TransportError& e) {
      EXPECT_NE(std::string(e.what()).find("MPI_Init_thread"), std::string::npos) << e.what();
    }
  } else {
    EXPECT_THROW(choose_transport(TransportKind::kMpi, {cpu, cpu}), std::invalid_argument);
  }
  EXPECT_STREQ(transport_name(TransportKind::kMpi), "mpi");
  EXPECT_STREQ(transport_name(TransportKind::kInProcess), "inproc");
}

TEST(TransportFactory, UnderALauncherCudaRanksGoOverNcclBootstrappedOverMpi) {
  const Device cpu = Device::cpu(), gpu0 = Device::cuda(0);
  ASSERT_LE(launched_process_count(), 1);
  EXPECT_TRUE(one_rank_per_process(TransportKind::kMpi));
  EXPECT_FALSE(one_rank_per_process(TransportKind::kAuto));
  EXPECT_FALSE(one_rank_per_process(TransportKind::kNccl));
  EXPECT_TRUE(spans_processes(TransportKind::kNcclOverMpi));
  EXPECT_FALSE(spans_processes(TransportKind::kNccl));
  EXPECT_STREQ(transport_name(TransportKind::kNcclOverMpi), "nccl");

  ScopedEnv launcher("OMPI_COMM_WORLD_SIZE", "2");
  ASSERT_EQ(launched_process_count(), 2);
  EXPECT_TRUE(one_rank_per_process(TransportKind::kAuto));
  EXPECT_TRUE(one_rank_per_process(TransportKind::kNccl));
  EXPECT_FALSE(one_rank_per_process(TransportKind::kInProcess));
  EXPECT_EQ(choose_transport(TransportKind::kInProcess, {gpu0, gpu0}), TransportKind::kInProcess);
#ifdef CONVEYOR_WITH_CUDA
  const bool nccl_over_mpi_built = mpi_built();
#else
  const bool nccl_over_mpi_built = false;
#endif
  // Processes on different nodes may have the same device index: no distinctness check here.
  for (TransportKind kind : {TransportKind::kAuto, TransportKind::kNccl}) {
    if (nccl_over_mpi_built) {
      EXPECT_EQ(choose_transport(kind, {gpu0, gpu0}), TransportKind::kNcclOverMpi);
    } else {
      EXPECT_THROW(choose_transport(kind, {gpu0, gpu0}), std::invalid_argument);
    }
  }
  if (mpi_built())
    EXPECT_EQ(choose_transport(TransportKind::kAuto, {cpu, cpu}), TransportKind::kMpi);
  if (nccl_over_mpi_built) {
    try {
      choose_transport(TransportKind::kNccl, {cpu, cpu});
      FAIL() << "NCCL across processes accepted for CPU ranks";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("carries CUDA ranks only"), std::string::npos)
          << e.what();
    }
    // The program, not the library, initialises MPI, which carries the unique ids.
    try {
      make_transports(TransportKind::kNccl, {gpu0, gpu0}, 1000ms);
      FAIL() << "NCCL over MPI was set up without MPI_Init";
    } catch (const TransportError& e) {
      EXPECT_NE(std::string(e.what()).find("MPI_Init_thread"), std::string::npos) << e.what();
    }
  }
}

TEST(TransportFactory, TheNodeLocalRankComesFromTheLauncher) {
  {
    ScopedEnv local("OMPI_COMM_WORLD_LOCAL_RANK", "3");
    EXPECT_EQ(node_local_rank(), 3);
  }
  {
    ScopedEnv local("MPI_LOCALRANKID", "2");  // MPICH/Hydra
    EXPECT_EQ(node_local_rank(), 2);
  }
  {
    // srun (any plugin): the task's rank on its node.
    ScopedEnv step("SLURM_STEP_NUM_TASKS", "8");
    ScopedEnv local("SLURM_LOCALID", "5");
    EXPECT_EQ(node_local_rank(), 5);
    // mpirun inside the step: its own count wins.
    ScopedEnv ompi("OMPI_COMM_WORLD_LOCAL_RANK", "1");
    EXPECT_EQ(node_local_rank(), 1);
  }
  {
    // The batch script's SLURM_LOCALID, inherited by a process no srun started, says nothing
    // of that process's place.
    ScopedEnv local("SLURM_LOCALID", "5");
    EXPECT_EQ(node_local_rank(), 0);
  }
  ScopedEnv bad("OMPI_COMM_WORLD_LOCAL_RANK", "x");
  // Neither a number from the launcher nor MPI initialised: the only process of its node.
  EXPECT_EQ(node_local_rank(), 0);
}

// Every launcher variable that launch_environment() reads, cleared for the scope, so that a
// test sets exactly the ones a launcher would.
class NoLauncher {
 public:
  NoLauncher() {
    for (const char* name :
         {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
          "SLURM_PROCID", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}) {
      if (const char* old = std::getenv(name)) saved_.emplace_back(name, old);
      unsetenv(name);
    }
  }
  ~NoLauncher() {
    for (const auto& [name, value] : saved_) setenv(name.c_str(), value.c_str(), 1);
  }

 private:
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST(TransportFactory, EveryLauncherSaysHowManyProcessesItStarted) {
  NoLauncher clean;
  EXPECT_EQ(launched_process_count(), 0);
  {
    ScopedEnv size("OMPI_COMM_WORLD_SIZE", "4");  // OpenMPI's mpirun
    EXPECT_EQ(launched_process_count(), 4);
    EXPECT_EQ(launch_environment().source, "OMPI_COMM_WORLD_SIZE=4");
  }
  {
    ScopedEnv size("PMI_SIZE", "3");  // Hydra, srun --mpi=pmi2
    EXPECT_EQ(launched_process_count(), 3);
  }
  {
    ScopedEnv size("SLURM_STEP_NUM_TASKS", "2");  // any srun step
    ScopedEnv all("SLURM_NTASKS", "8");           // the allocation's, not the step's
    EXPECT_EQ(launched_process_count(), 2);
  }
  {
    // srun --mpi=pmix as Slurm's PMIx plugin leaves it: no PMI_SIZE, the size only in
    // SLURM_NTASKS beside the PMIx rank.
    ScopedEnv rank("PMIX_RANK", "0");
    ScopedEnv ns("PMIX_NAMESPACE", "slurm.pmix.42.0");
    ScopedEnv procid("SLURM_PROCID", "0");
    ScopedEnv tasks("SLURM_NTASKS", "2");
    EXPECT_EQ(launched_process_count(), 2);
    EXPECT_TRUE(one_rank_per_process(TransportKind::kAuto));
    EXPECT_TRUE(one_rank_per_process(TransportKind::kNccl));
    if (mpi_built())
      EXPECT_EQ(choose_transport(TransportKind::kAuto, {Device::cpu(), Device::cpu()}),
                TransportKind::kMpi);
  }
  {
    // A task above 0 of a step that names no size otherwise.
    ScopedEnv procid("SLURM_PROCID", "1");
    ScopedEnv tasks("SLURM_NTASKS", "2");
    EXPECT_EQ(launched_process_count(), 2);
  }
  {
    // A PMIx rank with no size anywhere: at least one more process than that rank.
    ScopedEnv rank("PMIX_RANK", "2");
    EXPECT_EQ(launched_process_count(), 3);
    EXPECT_TRUE(launch_environment().at_least);
  }
  {
    // The batch script of an sbatch --ntasks 4 allocation, and a plain process it starts:
    // one process, which must run every rank itself.
    ScopedEnv tasks("SLURM_NTASKS", "4");
    ScopedEnv procid("SLURM_PROCID", "0");
    ScopedEnv local("SLURM_LOCALID", "0");
    EXPECT_EQ(launched_process_count(), 0);
    EXPECT_FALSE(one_rank_per_process(TransportKind::kAuto));
    EXPECT_EQ(choose_transport(TransportKind::kAuto, {Device::cpu(), Device::cpu()}),
              TransportKind::kInProcess);
  }
}

TEST(TransportFactory, EveryLauncherSaysWhichProcessThisIs) {
  NoLauncher clean;
  EXPECT_EQ(launched_process_rank(), 0);
  const std::vector<std::pair<const char*, int>> launchers = {
      {"OMPI_COMM_WORLD_RANK", 3},  // OpenMPI's mpirun
      {"PMI_RANK", 2},              // Hydra, srun --mpi=pmi2
      {"PMIX_RANK", 1}};            // srun --mpi=pmix
  for (const auto& [name, rank] : launchers) {
    ScopedEnv set(name, std::to_string(rank).c_str());
    EXPECT_EQ(launched_process_rank(), rank) << name;
  }
  {
    // A task of an srun step, and the batch script's number outside one.
    ScopedEnv procid("SLURM_PROCID", "5");
    EXPECT_EQ(launched_process_rank(), 0);
    ScopedEnv step("SLURM_STEP_NUM_TASKS", "8");
    EXPECT_EQ(launched_process_rank(), 5);
  }
  // A value that is not a rank speaks as the first process (at worst, a refusal said twice).
  ScopedEnv bad("OMPI_COMM_WORLD_RANK", "x");
  EXPECT_EQ(launched_process_rank(), 0);
}

// Compares the start of a message, which goes on to say what to do.
#define EXPECT_PREFIX(text, prefix) \
  EXPECT_EQ(std::string(text).substr(0, std::string(prefix).size()), std::string(prefix))

// A launcher variable that is set but damaged is refused, not read as "no launcher": that
// would have every process of the job train the whole job alone.
TEST(TransportFactory, AMalformedLauncherVariableIsRefusedByName) {
  NoLauncher clean;
  const std::vector<std::pair<const char*, const char*>> counts = {
      {"OMPI_COMM_WORLD_SIZE", "2x"},
      {"PMI_SIZE", "0"},
      {"SLURM_STEP_NUM_TASKS", "abc"},
      {"SLURM_STEP_NUM_TASKS", "-3"},
      {"SLURM_STEP_NUM_TASKS", "99999999999"},
      {"SLURM_STEP_NUM_TASKS", "1000000001"},
      {"SLURM_STEP_NUM_TASKS", ""},
      {"SLURM_STEP_NUM_TASKS", " 4"},
      {"SLURM_STEP_NUM_TASKS", "+4"},
      {"SLURM_NTASKS", "four"}};
  for (const auto& [name, value] : counts) {
    ScopedEnv bad(name, value);
    try {
      launch_environment();
      ADD_FAILURE() << name << "='" << value << "' was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_PREFIX(e.what(), (std::string(name) + " is '" + value +
                               "', not a process count (a whole number "
                               "from 1 to 1000000000)"));
    }
  }
  for (const char* name : {"PMIX_RANK", "SLURM_PROCID"}) {
    ScopedEnv bad(name, "-1");
    try {
      launch_environment();
      ADD_FAILURE() << name << "=-1 was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_PREFIX(e.what(), (std::string(name) + " is '-1', not a process rank (a whole "
                                                   "number from 0 to 999999999)"));
    }
  }
  {
    // The largest count and rank are still read.
    ScopedEnv size("SLURM_STEP_NUM_TASKS", "1000000000");
    EXPECT_EQ(launched_process_count(), 1000000000);
  }
  {
    ScopedEnv rank("PMIX_RANK", "999999999");
    EXPECT_EQ(launched_process_count(), 1000000000);
  }
  {
    // A control character is shown escaped, so the sentence stays on one line.
    ScopedEnv bad("PMI_SIZE", "4\n");
    EXPECT_THROW(
        {
          try {
            launch_environment();
          } catch (const std::invalid_argument& e) {
            EXPECT_PREFIX(e.what(), ("PMI_SIZE is '4\\x0a', not a process"));
            throw;
          }
        },
        std::invalid_argument);
  }
}

}  // namespace
}  // namespace conveyor::comm
