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

}  // namespace conveyor::comm
