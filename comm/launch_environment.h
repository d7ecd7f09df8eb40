#pragma once
// What the launcher that started this process (OpenMPI's mpirun, Slurm's srun, MPICH's
// Hydra) says about the job, read from the environment it sets before the program runs, so
// that the program knows whether it is one rank of several processes before MPI_Init, and in
// a build without MPI (which then refuses instead of running every copy as the whole job).
#include <string>

namespace conveyor::comm {

struct LaunchEnvironment {
  // How many processes the launcher started, this one among them; 0 when no launcher says
  // this process is part of a job (a plain process, also one inside a Slurm allocation).
  int processes = 0;
  // True when only a lower bound is known: a PMIx launch that names this process's rank but
  // not the size of its job.
  bool at_least = false;
  // The variables that said so, as "NAME=value", for messages.
  std::string source;
};

// Read in this order, the first that applies winning:
//   OMPI_COMM_WORLD_SIZE   OpenMPI's mpirun (and prterun)
//   PMI_SIZE               MPICH/Hydra's mpiexec, srun --mpi=pmi2
//   SLURM_STEP_NUM_TASKS   any srun step (srun sets it, sbatch and salloc do not)
//   SLURM_NTASKS           only beside PMIX_RANK (srun --mpi=pmix) or a SLURM_PROCID above 0:
//                          alone it is the allocation's size, also seen by the batch script
//   PMIX_RANK + 1          a PMIx rank above 0 with no size: at least that many
// A variable read here that is set but not a whole number in range (a count from 1, a rank
// from 0, at most 1e9) throws std::invalid_argument naming it and its value: taken as unset,
// it would have each process of a launch train the whole job alone.
LaunchEnvironment launch_environment();

// launch_environment().processes.
int launched_process_count();

// This process's rank among the processes of its launch, as the launcher numbers them:
// OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID inside an srun step, PMIX_RANK; 0 when no
// launcher says (a plain process) or the value is not a rank. What says which process of a
// launch speaks for all before MPI starts.
int launched_process_rank();

// This process's rank among the processes of its node: OMPI_COMM_WORLD_LOCAL_RANK under
// OpenMPI's mpirun, MPI_LOCALRANKID under Hydra, SLURM_LOCALID inside an srun step; else
// from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) when MPI is initialised (a collective: every
// process must ask), else 0. GPU processes take the GPU of this number modulo the devices
// they see, so the processes of one node never share one.
int node_local_rank();

}  // namespace conveyor::comm
