#include "comm/transport.h"

namespace conveyor::comm {

void check_timeout(std::chrono::milliseconds timeout, const std::string& what) {
  if (timeout.count() < 1 || timeout.count() > kMaxTimeoutMs)
    throw std::invalid_argument(what + " must be from 1 ms to " + std::to_string(kMaxTimeoutMs) +
                                " ms (10^6 s), got " + std::to_string(timeout.count()) + " ms");
}

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
    for (int g : group) listed.append(listed.empty() ? "" : ",").append(std::to_string(g));
    throw TransportError("rank " + std::to_string(rank()) +
                         ": a group sum needs ascending ranks in 0.." + std::to_string(size() - 1) +
                         " that include this rank, got {" + listed + "}");
  }
}

void Transport::check_ranges(const std::vector<float>& values, const std::vector<int>& group,
                             const std::vector<size_t>& bounds, const char* what) const {
  check_group(group);
  bool ok =
      bounds.size() == group.size() + 1 && bounds.front() == 0 && bounds.back() == values.size();
  for (size_t i = 1; ok && i < bounds.size(); ++i) ok = bounds[i - 1] <= bounds[i];
  if (!ok)
    throw TransportError("rank " + std::to_string(rank()) + ": a " + what + " of " +
                         std::to_string(values.size()) + " values over " +
                         std::to_string(group.size()) + " members needs " +
                         std::to_string(group.size() + 1) + " ascending bounds from 0 to " +
                         std::to_string(values.size()) + ", got " + std::to_string(bounds.size()));
}

size_t Transport::position_in(const std::vector<int>& group) const {
  for (size_t i = 0; i < group.size(); ++i)
    if (group[i] == rank()) return i;
  return group.size();
}

std::unique_ptr<PendingGroupCall> Transport::start_group_gather(std::vector<float>&,
                                                                const std::vector<int>&,
                                                                const std::vector<size_t>&) {
  throw TransportError(
      "this transport has no group gather, which a sharded optimizer needs to share updated "
      "weights between replicas; use the in-process or the MPI transport");
}

std::unique_ptr<PendingGroupCall> Transport::start_group_reduce_scatter(
    std::vector<float>&, const std::vector<int>&, const std::vector<size_t>&) {
  throw TransportError(
      "this transport has no group reduce-scatter, which a sharded optimizer needs to sum "
      "each replica's range of the gradients; use the in-process or the MPI transport");
}

std::unique_ptr<PendingGroupCall> Transport::start_group_sum(std::vector<float>&,
                                                             const std::vector<int>&) {
  throw TransportError(
      "this transport has no group sum, which data parallelism needs to add gradients over "
      "replicas; use the in-process or the MPI transport (TransportKind::kInProcess or "
      "TransportKind::kMpi)");
}

std::map<int, std::vector<std::byte>> Transport::collect_failure_reports(
    const std::vector<std::byte>&, int, std::chrono::milliseconds) {
  return {};
}

std::string rank_list(const std::vector<int>& ranks) {
  constexpr size_t kShown = 16;
  std::string out;
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i)
    out += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) out += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return out;
}

}  // namespace conveyor::comm
