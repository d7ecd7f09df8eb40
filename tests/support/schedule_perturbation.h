#pragma once
// Random perturbations of a schedule, for the tests that check the validator against what
// runs (the simulator, the executor): actions moved within and across ranks, sends and
// receives swapped, actions dropped or duplicated.
#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "engine/schedule/schedule.h"

namespace conveyor::testing {

enum class Perturbation {
  kMoveWithinRank,
  kMoveAcrossRanks,
  kSwapSendAndReceive,
  kSwapReceives,
  kDrop,
  kDuplicate,
};
constexpr Perturbation kAllPerturbations[] = {Perturbation::kMoveWithinRank,
                                              Perturbation::kMoveAcrossRanks,
                                              Perturbation::kSwapSendAndReceive,
                                              Perturbation::kSwapReceives,
                                              Perturbation::kDrop,
                                              Perturbation::kDuplicate};

inline const char* perturbation_name(Perturbation p) {
  switch (p) {
    case Perturbation::kMoveWithinRank:
      return "move within a rank";
    case Perturbation::kMoveAcrossRanks:
      return "move across ranks";
    case Perturbation::kSwapSendAndReceive:
      return "swap a send and a receive";
    case Perturbation::kSwapReceives:
      return "swap two receives";
    case Perturbation::kDrop:
      return "drop one";
    case Perturbation::kDuplicate:
      return "duplicate one";
  }
  return "?";
}

inline int uniform(std::mt19937_64& rng, int low, int high) {  // [low, high]
  return std::uniform_int_distribution<int>(low, high)(rng);
}

// Positions in `list` of the actions `pick` selects.
template <class Pick>
std::vector<int> positions(const std::vector<schedule::Action>& list, Pick pick) {
  std::vector<int> out;
  for (int i = 0; i < static_cast<int>(list.size()); ++i)
    if (pick(list[i])) out.push_back(i);
  return out;
}

// Applies one perturbation of `kind` to `s` at random. Returns false, leaving `s` as it was,
// when `s` has nothing it applies to (no rank with two receives, say).
inline bool perturb(schedule::Schedule& s, Perturbation kind, std::mt19937_64& rng) {
  const int p = s.num_ranks();
  auto random_rank = [&](auto fits) {
    std::vector<int> ranks;
    for (int r = 0; r < p; ++r)
      if (fits(s.ranks[r])) ranks.push_back(r);
    return ranks.empty() ? -1 : ranks[uniform(rng, 0, static_cast<int>(ranks.size()) - 1)];
  };
  auto pick = [&](const std::vector<int>& from) {
    return from[uniform(rng, 0, static_cast<int>(from.size()) - 1)];
  };
  auto is_send = [](const schedule::Action& a) { return schedule::is_send(a.kind); };
  auto is_recv = [](const schedule::Action& a) { return schedule::is_recv(a.kind); };
  switch (kind) {
    case Perturbation::kMoveWithinRank: {
      const int r = random_rank([](const auto& list) { return list.size() >= 2; });
      if (r < 0) return false;
      auto& list = s.ranks[r];
      const int last = static_cast<int>(list.size()) - 1;
      const int from = uniform(rng, 0, last);
      // Half the moves go a few places only: most far ones break an order rule.
      int to = uniform(rng, 0, 1) ? uniform(rng, std::max(0, from - 3), std::min(last, from + 3))
                                  : uniform(rng, 0, last);
      if (to == from) to = from == last ? from - 1 : from + 1;  // somewhere else
      const schedule::Action a = list[from];
      list.erase(list.begin() + from);
      list.insert(list.begin() + to, a);
      return true;
    }
    case Perturbation::kMoveAcrossRanks: {
      if (p < 2) return false;
      const int r = random_rank([](const auto& list) { return !list.empty(); });
      if (r < 0) return false;
      int dst = uniform(rng, 0, p - 2);
      if (dst >= r) ++dst;
      const int from = uniform(rng, 0, static_cast<int>(s.ranks[r].size()) - 1);
      const schedule::Action a = s.ranks[r][from];
      s.ranks[r].erase(s.ranks[r].begin() + from);
      auto& target = s.ranks[dst];
      target.insert(target.begin() + uniform(rng, 0, static_cast<int>(target.size())), a);
      return true;
    }
    case Perturbation::kSwapSendAndReceive: {
      const int r = random_rank([&](const auto& list) {
        return !positions(list, is_send).empty() && !positions(list, is_recv).empty();
      });
      if (r < 0) return false;
      auto& list = s.ranks[r];
      std::swap(list[pick(positions(list, is_send))], list[pick(positions(list, is_recv))]);
      return true;
    }
    case Perturbation::kSwapReceives: {
      const int r =
          random_rank([&](const auto& list) { return positions(list, is_recv).size() >= 2; });
      if (r < 0) return false;
      auto& list = s.ranks[r];
      const auto recvs = positions(list, is_recv);
      // Half the swaps are of neighbours in the receive stream, the others of any two.
      const int last = static_cast<int>(recvs.size()) - 1;
      const int a = uniform(rng, 0, last);
      int b = uniform(rng, 0, 1) ? a + 1 : uniform(rng, 0, last);
      if (b > last || b == a) b = a == 0 ? 1 : a - 1;
      std::swap(list[recvs[a]], list[recvs[b]]);
      return true;
    }
    case Perturbation::kDrop: {
      const int r = random_rank([](const auto& list) { return !list.empty(); });
      if (r < 0) return false;
      auto& list = s.ranks[r];
      list.erase(list.begin() + uniform(rng, 0, static_cast<int>(list.size()) - 1));
      return true;
    }
    case Perturbation::kDuplicate: {
      const int r = random_rank([](const auto& list) { return !list.empty(); });
      if (r < 0) return false;
      auto& list = s.ranks[r];
      const schedule::Action a = list[uniform(rng, 0, static_cast<int>(list.size()) - 1)];
      list.insert(list.begin() + uniform(rng, 0, static_cast<int>(list.size())), a);
      return true;
    }
  }
  return false;
}

}  // namespace conveyor::testing
