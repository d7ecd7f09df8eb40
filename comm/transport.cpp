#include "comm/transport.h"

namespace conveyor::comm {

TransportAborted::TransportAborted(int rank, const std::string& reason)
    : TransportError("rank " + std::to_string(rank) + ": pipeline aborted: " + reason),
      reason_(reason) {}

void Transport::check_peer(int peer, const char* action) const {
  if (peer < 0 || peer >= size() || peer == rank())
    throw TransportError("rank " + std::to_string(rank()) + ": cannot " + action + " rank " +
                         std::to_string(peer) + " (ranks are 0.." + std::to_string(size() - 1) +
                         ")");
}

void Transport::check_group(const std::vector<int>& group) const {
  bool ascending = true, member = false;
  for (size_t i = 0; i < group.size(); ++i) {
    ascending =
        ascending && group[i] >= 0 && group[i] < size() && (i == 0 || group[i - 1] < group[i]);
    member = member || group[i] == rank();
  }
  if (!ascending || !member) {
    std::string listed;
    for (int g : group) listed += (listed.empty() ? "" : ",") + std::to_string(g);
    throw TransportError("rank " + std::to_string(rank()) +
                         ": a group sum needs ascending ranks in 0.." + std::to_string(size() - 1) +
                         " that include this rank, got {" + listed + "}");
  }
}

std::unique_ptr<PendingGroupSum> Transport::start_group_sum(std::vector<float>&,
                                                            const std::vector<int>&) {
  throw TransportError(
      "this transport has no group sum, which data parallelism needs to add gradients over "
      "replicas; use the in-process or the MPI transport (--transport inproc or mpi)");
}

}  // namespace conveyor::comm
