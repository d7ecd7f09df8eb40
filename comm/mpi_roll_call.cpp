// mpi_roll_call (comm/mpi_transport.h): every process of MPI_COMM_WORLD meets at rank 0
// before a step that waits for all of them, so that one that does not come is named.
#include <memory>
#include <string>
#include <vector>

#include "comm/mpi_transport.h"
#include "comm/poll.h"

#ifdef CONVEYOR_WITH_MPI
#include "comm/mpi_endpoint.h"
#endif

namespace conveyor::comm {

#ifndef CONVEYOR_WITH_MPI

void mpi_roll_call(const std::string&, std::chrono::milliseconds) {}

#else

using detail::drop;
using detail::kRollCallTag;

namespace {

// Rank 0's answer to a roll call: every process came, or some did not.
constexpr unsigned char kAllHere = 0, kSomeMissing = 1;
const unsigned char kAnswers[2] = {kAllHere, kSomeMissing};  // static: sends may outlive a call

}  // namespace

void mpi_roll_call(const std::string& what, std::chrono::milliseconds timeout) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (size == 1) return;
  if (rank == 0) {
    // Rank 0 decides: it waits `timeout` for the others, then answers every one that came.
    // A request MPI_Test finds done becomes MPI_REQUEST_NULL, so what is left names who has
    // not come.
    std::vector<MPI_Request> here(static_cast<size_t>(size), MPI_REQUEST_NULL);
    for (int r = 1; r < size; ++r)
      MPI_Irecv(nullptr, 0, MPI_BYTE, r, kRollCallTag, MPI_COMM_WORLD, &here[r]);
    const bool all = poll_until(PollClock::now() + timeout, [&] {
      bool every = true;
      for (int r = 1; r < size; ++r) {
        int done = 0;
        if (here[r] != MPI_REQUEST_NULL) MPI_Test(&here[r], &done, MPI_STATUS_IGNORE);
        every = every && here[r] == MPI_REQUEST_NULL;
      }
      return every;
    });
    std::vector<int> missing;
    for (int r = 1; r < size; ++r) {
      if (here[r] != MPI_REQUEST_NULL) {
        missing.push_back(r);
        drop(here[r]);
        continue;
      }
      MPI_Request sent = MPI_REQUEST_NULL;
      MPI_Isend(&kAnswers[all ? kAllHere : kSomeMissing], 1, MPI_BYTE, r, kRollCallTag,
                MPI_COMM_WORLD, &sent);
      MPI_Request_free(&sent);
    }
    if (!all)
      throw TransportError("rank 0: rank(s) " + rank_list(missing) + " did not reach " + what +
                           " within " + std::to_string(timeout.count()) +
                           " ms (stopped, hung, or slower than the transport timeout allows)");
    return;
  }
  // The others wait twice as long, so that rank 0, which started its wait at most `timeout`
  // after them unless it is the one late, always answers first and names who was missing.
  MPI_Request sent = MPI_REQUEST_NULL, answer = MPI_REQUEST_NULL;
  MPI_Isend(nullptr, 0, MPI_BYTE, 0, kRollCallTag, MPI_COMM_WORLD, &sent);
  MPI_Request_free(&sent);
  auto verdict = std::make_unique<unsigned char>(kAllHere);
  MPI_Irecv(verdict.get(), 1, MPI_BYTE, 0, kRollCallTag, MPI_COMM_WORLD, &answer);
  const bool answered = poll_until(PollClock::now() + 2 * timeout, [&] {
    int done = 0;
    MPI_Test(&answer, &done, MPI_STATUS_IGNORE);
    return done != 0;
  });
  if (!answered) {
    drop(answer);
    (void)verdict.release();  // left to MPI with the request, should the cancel not take
    throw TransportError(
        "rank " + std::to_string(rank) + ": no word from rank 0 at " + what + " within " +
        std::to_string(2 * timeout.count()) +
        " ms (rank 0 is stopped, hung, or slower than the transport timeout allows)");
  }
  if (*verdict != kAllHere)
    throw TransportError("rank " + std::to_string(rank) + ": another process did not reach " +
                         what + " within " + std::to_string(timeout.count()) +
                         " ms (rank 0's error names it)");
}

#endif

}  // namespace conveyor::comm
