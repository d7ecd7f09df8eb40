#pragma once
// MPI transport for CPU pipeline ranks that are processes, one rank per process, started by
// mpirun or srun. The program initialises MPI (MPI_Init_thread with MPI_THREAD_SERIALIZED or
// more: the executor calls from one thread at a time, not necessarily the main one) and
// finalises it after the transport is gone; the library never does.
//
// - Point-to-point: send() copies the tensor's bytes and posts MPI_Isend from that copy, so
//   the caller may reuse its tensor at once; recv() polls MPI_Improbe / MPI_Imrecv against
//   the deadline; try_recv() probes once. One tag carries every pipeline message, so each
//   link is FIFO by MPI's non-overtaking rule, as the validator assumes.
// - all_reduce_sum(): the value counts point to point (checked equal; a rank that does not
//   come is named), then every rank's values to every other point to point and the sum in
//   rank order on every rank, so the bits never depend on MPI's reduction algorithm, and a
//   rank that stops after its count is named alone (a collective would leave every waiting
//   rank looking alike).
// - start_group_sum / start_group_reduce_scatter / start_group_gather (data parallelism):
//   MPI_Isend / MPI_Irecv between the group's members on tags of their own, polled against
//   the deadline, the sums in group order here, never MPI's. A sum is a reduce-scatter, then
//   a gather of the summed ranges: about 2 (D - 1) / D of the values sent per member, not
//   (D - 1) times them. Several may be in flight, paired with the same calls of the other
//   members by their tags and start order (comm/mpi_group_calls.cpp), and every poll of the
//   transport moves all of them on.
// - abort(): sends the reason to every other rank on a tag of its own; their pending and
//   later calls throw TransportAborted with it. A wait that gives up aborts the same way.
//   MPI_Abort is never called: every rank ends with its own error.
// All traffic runs on a duplicate of MPI_COMM_WORLD with errors returned, not fatal.
#include <chrono>
#include <memory>
#include <string>

#include "comm/launch_environment.h"  // launched_process_count, node_local_rank
#include "comm/transport.h"

namespace conveyor::comm {

// True when this binary was built with MPI.
bool mpi_built();

// Returns once every process of MPI_COMM_WORLD has called it (the k-th call of each process
// meets the k-th of the others), before a step that only goes on when all of them are there
// (MPI_Comm_dup, a blocking collective): each process tells rank 0 it is there, and rank 0
// answers each once all are, or once `timeout` has passed. Then rank 0 throws TransportError
// naming the processes that did not reach `what` (e.g. "the MPI transport's set-up"), and the
// others that came throw one that points to rank 0's. A process that hears nothing from rank
// 0 within twice `timeout` (rank 0 decides first) throws one saying so. A process that is
// stopped, hung or slow would otherwise hold every other one inside the collective for good.
// Nothing to do in a build without MPI or with one process.
void mpi_roll_call(const std::string& what, std::chrono::milliseconds timeout);

// This process's endpoint over MPI_COMM_WORLD: its rank() is the MPI rank. Throws
// TransportError when MPI is not initialised or gives less than MPI_THREAD_SERIALIZED, and
// std::invalid_argument in a build without MPI or for a `timeout` outside 1 ms to
// kMaxTimeoutMs. `timeout` bounds every wait for a peer.
std::unique_ptr<Transport> make_mpi_transport(std::chrono::milliseconds timeout);

}  // namespace conveyor::comm
