// The layout of an NCCL clique's communicators (nccl.h): the groups' checks, where each
// communicator finds its unique id, and which ones a rank takes part in. Built with or without
// CUDA: the MPI launcher hands out the ids by these slots.
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/nccl.h"

namespace conveyor::comm {

void detail::check_clique_rank(int rank, int ranks, const char* what) {
  if (ranks < 1)
    throw std::invalid_argument("an NCCL clique needs at least one rank, got " +
                                std::to_string(ranks));
  if (rank < 0 || rank >= ranks)
    throw std::invalid_argument(std::string(what) + " " + std::to_string(rank) +
                                " is out of range for " + std::to_string(ranks) + " rank(s)");
}

std::string detail::describe_group(const std::vector<int>& group) {
  std::string out = "{";
  for (size_t i = 0; i < group.size(); ++i) {
    if (i > 0) out += ',';
    out += std::to_string(group[i]);
  }
  out += '}';
  return out;
}

using detail::describe_group;

void check_nccl_groups(const NcclGroups& groups, int ranks) {
  detail::check_clique_rank(0, ranks, "rank");
  std::set<std::vector<int>> seen;
  for (const std::vector<int>& group : groups) {
    bool ok = group.size() >= 2;
    for (size_t i = 0; ok && i < group.size(); ++i)
      ok = group[i] >= 0 && group[i] < ranks && (i == 0 || group[i - 1] < group[i]);
    if (!ok)
      throw std::invalid_argument("an NCCL group needs at least two ascending ranks in 0.." +
                                  std::to_string(ranks - 1) + ", got " + describe_group(group));
    if (!seen.insert(group).second)
      throw std::invalid_argument("the NCCL group " + describe_group(group) +
                                  " is listed twice; list each group once");
  }
}

int find_nccl_group(const NcclGroups& groups, const std::vector<int>& group) {
  const auto at = std::find(groups.begin(), groups.end(), group);
  if (at != groups.end()) return static_cast<int>(at - groups.begin());
  std::string made;
  for (const auto& g : groups) made += (made.empty() ? "" : ", ") + describe_group(g);
  throw TransportError("the NCCL transport has no communicator for the group " +
                       describe_group(group) + "; it was made for " +
                       (made.empty() ? std::string("no groups") : "the groups " + made) +
                       " (pass every group that makes group calls when creating it)");
}

int nccl_slot_count(int ranks, int groups) {
  detail::check_clique_rank(0, ranks, "rank");
  if (groups < 0)
    throw std::invalid_argument("an NCCL clique cannot have " + std::to_string(groups) + " groups");
  return ranks * (ranks - 1) + 1 + groups;
}

int nccl_link_slot(int src, int dst, int ranks) {
  detail::check_clique_rank(src, ranks, "link source");
  detail::check_clique_rank(dst, ranks, "link destination");
  if (src == dst)
    throw std::invalid_argument("a link joins two ranks, got " + std::to_string(src) + " -> " +
                                std::to_string(dst));
  return src * (ranks - 1) + (dst < src ? dst : dst - 1);
}

int nccl_world_slot(int ranks) { return nccl_slot_count(ranks) - 1; }

int nccl_group_slot(int group, int ranks, int groups) {
  if (group < 0 || group >= groups)
    throw std::invalid_argument("group " + std::to_string(group) + " is out of range for " +
                                std::to_string(groups) + " group(s)");
  return nccl_slot_count(ranks) + group;
}

std::vector<NcclMembership> nccl_memberships(int rank, int ranks, const NcclGroups& groups) {
  detail::check_clique_rank(rank, ranks, "rank");
  check_nccl_groups(groups, ranks);
  std::vector<NcclMembership> out;
  out.push_back({nccl_world_slot(ranks), -1, -1, -1, ranks, rank});
  for (int src = 0; src < ranks; ++src)
    for (int dst = 0; dst < ranks; ++dst)
      if (src != dst && (src == rank || dst == rank))
        out.push_back({nccl_link_slot(src, dst, ranks), src, dst, -1, 2, rank == src ? 0 : 1});
  const int count = static_cast<int>(groups.size());
  for (int g = 0; g < count; ++g) {
    const auto& group = groups[g];
    const auto at = std::find(group.begin(), group.end(), rank);
    if (at != group.end())
      out.push_back({nccl_group_slot(g, ranks, count), -1, -1, g, static_cast<int>(group.size()),
                     static_cast<int>(at - group.begin())});
  }
  return out;
}

}  // namespace conveyor::comm
