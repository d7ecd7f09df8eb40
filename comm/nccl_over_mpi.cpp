// NCCL communicators of ranks that are processes: rank 0 makes the unique ids, MPI carries
// them to every process, and each process makes its own rank's ends (comm/nccl.cpp).
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "comm/mpi_transport.h"
#include "comm/nccl.h"
#include "comm/poll.h"
#include "comm/report_channel.h"
#include "comm/transport_factory.h"

#ifdef CONVEYOR_WITH_CUDA
#include <nccl.h>

#include "comm/nccl_check.h"
#endif
#ifdef CONVEYOR_WITH_MPI
#include <mpi.h>
#endif

namespace conveyor::comm {

#ifdef CONVEYOR_WITH_CUDA

#ifndef CONVEYOR_WITH_MPI

std::unique_ptr<Transport> make_nccl_transport_over_mpi(const std::vector<int>&,
                                                        std::chrono::milliseconds,
                                                        const NcclGroups&) {
  throw std::invalid_argument(
      "this build has no MPI, so NCCL cannot be bootstrapped across processes (install "
      "libopenmpi-dev and reconfigure); run the ranks as threads of one process instead");
}

#else

namespace {

void check_mpi(int code, const char* call) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  throw TransportError(std::string(call) + " failed: " + std::string(text, length));
}

}  // namespace

std::unique_ptr<Transport> make_nccl_transport_over_mpi(
    const std::vector<int>& cuda_device_per_rank, std::chrono::milliseconds timeout,
    const NcclGroups& groups) {
  check_timeout(timeout, "the NCCL transport's timeout");
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised)
    throw TransportError(
        "NCCL over MPI needs MPI to be initialised first: the program must call MPI_Init_thread, "
        "asking for MPI_THREAD_SERIALIZED, before the trainer is built");
  int rank = 0, processes = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &processes), "MPI_Comm_size");
  const int ranks = static_cast<int>(cuda_device_per_rank.size());
  if (processes != ranks) throw ProcessCountMismatch(ranks, processes);
  // Every process checks the same groups, so a bad list fails on all of them before the
  // broadcast.
  check_nccl_groups(groups, ranks);
  // One byte saying whether rank 0 could make the ids, then the ids: a failure on rank 0
  // reaches every process instead of leaving them in the broadcast.
  const int slots = nccl_slot_count(ranks, static_cast<int>(groups.size()));
  // On the heap: left to MPI when the broadcast does not finish (below).
  auto message_owner = std::make_unique<std::vector<char> >(
      1 + static_cast<size_t>(slots) * sizeof(ncclUniqueId), 0);
  std::vector<char>& message = *message_owner;
  std::string failure;
  if (rank == 0) {
    try {
      for (int i = 0; i < slots; ++i) {
        ncclUniqueId id;
        CONVEYOR_NCCL_CHECK(ncclGetUniqueId(&id));
        std::memcpy(message.data() + 1 + i * sizeof(ncclUniqueId), id.internal, sizeof id);
      }
      message[0] = 1;
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  // Polled against the timeout: a process that never comes to the broadcast (stopped, or
  // stuck before it) ends the others' set-up with an error where MPI_Bcast would wait forever.
  // A collective cannot be cancelled, so the request is left behind then, and its buffer with
  // it (MPI may still write there), as the process is on its way out (it never finalises MPI
  // after a failure, which would wait for the request).
  MPI_Request request = MPI_REQUEST_NULL;
  check_mpi(MPI_Ibcast(message.data(), static_cast<int>(message.size()), MPI_BYTE, 0,
                       MPI_COMM_WORLD, &request),
            "MPI_Ibcast");
  const bool arrived = poll_until(PollClock::now() + timeout, [&] {
    int done = 0;
    check_mpi(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
    return done != 0;
  });
  if (!arrived) {
    (void)message_owner.release();
    throw TransportError(
        "rank " + std::to_string(rank) + ": the NCCL unique ids " +
        (rank == 0 ? "did not leave for every process" : "did not arrive from rank 0") +
        " within " + std::to_string(timeout.count()) +
        " ms (every process must come to its NCCL set-up)");
  }
  if (message[0] != 1)
    throw TransportError(rank == 0 ? failure
                                   : "rank 0 could not make the NCCL unique ids (its error says "
                                     "why)");
  std::vector<std::string> ids;
  for (int i = 0; i < slots; ++i)
    ids.emplace_back(message.data() + 1 + i * sizeof(ncclUniqueId), sizeof(ncclUniqueId));
  // After a failure each process's position goes to rank 0 over MPI (NCCL cannot carry it).
  std::unique_ptr<Transport> reports = make_mpi_transport(timeout);
  return with_reports_over(
      make_nccl_transport_from_ids(rank, ranks, cuda_device_per_rank[rank], ids, timeout, groups),
      std::move(reports));
}

#endif  // CONVEYOR_WITH_MPI

#endif  // CONVEYOR_WITH_CUDA

}  // namespace conveyor::comm
