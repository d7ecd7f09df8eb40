#include "engine/pipeline/rank_progress.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "comm/transport.h"
#include "engine/schedule/ascii.h"

namespace conveyor {
namespace {

using Phase = RankProgress::Phase;

std::string head_text(const std::vector<schedule::Action>& list, size_t head) {
  if (head >= list.size()) return "done";
  return std::to_string(head) + " (" + schedule::to_string(list[head]) + ")";
}

// What the rank waits on, in words.
std::string waits_on(const schedule::Schedule& schedule, const RankPosition& rank) {
  const auto& list = schedule.ranks[rank.pipeline_rank];
  const RankProgress& p = rank.progress;
  const auto action = [&] {
    return "action " + std::to_string(p.action) + " (" + schedule::to_string(list[p.action]) + ")";
  };
  const int first_of_replica = rank.replica * schedule.num_ranks();
  switch (p.phase) {
    case Phase::kNotStarted:
      return "had not started the step";
    case Phase::kRunning:
      return "running " + action();
    case Phase::kWaitingForReceive:
      return "at " + action() + ", waiting for a message from rank " +
             std::to_string(first_of_replica + list[p.action].peer);
    case Phase::kWaitingForSum: {
      std::string others;
      for (int r : rank.replica_group)
        if (r != rank.index) others += (others.empty() ? "" : ", ") + std::to_string(r);
      return "at " + action() + ", waiting for the gradient sum with rank(s) " + others;
    }
    case Phase::kEndOfStep:
      return "past its last action, in the end of the step (transfers, the all-reduce of "
             "losses and norms over all ranks, the update; across processes, the sum of memory "
             "peaks)";
    case Phase::kDone:
      return "done with the step";
  }
  return "";
}

}  // namespace

std::vector<std::byte> encode_position(const RankPosition& position) {
  const RankProgress& p = position.progress;
  std::vector<int64_t> fields = {position.index,
                                 position.pipeline_rank,
                                 position.replica,
                                 static_cast<int64_t>(p.phase),
                                 static_cast<int64_t>(p.action),
                                 static_cast<int64_t>(p.compute),
                                 static_cast<int64_t>(p.send),
                                 static_cast<int64_t>(p.recv),
                                 static_cast<int64_t>(p.reduce)};
  fields.insert(fields.end(), position.replica_group.begin(), position.replica_group.end());
  std::vector<std::byte> bytes(fields.size() * sizeof(int64_t));
  std::memcpy(bytes.data(), fields.data(), bytes.size());
  return bytes;
}

std::optional<RankPosition> decode_position(const std::vector<std::byte>& bytes,
                                            const schedule::Schedule& schedule, int world) {
  constexpr size_t kFixed = 9;
  if (bytes.size() % sizeof(int64_t) != 0 || bytes.size() < kFixed * sizeof(int64_t))
    return std::nullopt;
  std::vector<int64_t> f(bytes.size() / sizeof(int64_t));
  std::memcpy(f.data(), bytes.data(), bytes.size());
  const auto in = [](int64_t v, int64_t end) { return v >= 0 && v < end; };
  if (!in(f[0], world) || !in(f[1], schedule.num_ranks()) || !in(f[2], schedule.replicas) ||
      !in(f[3], static_cast<int64_t>(Phase::kDone) + 1))
    return std::nullopt;
  const auto size = static_cast<int64_t>(schedule.ranks[f[1]].size());
  // A rank at an action names one of its list; stream heads may stand at the list's end.
  const auto phase = static_cast<Phase>(f[3]);
  const bool at_action = phase == Phase::kRunning || phase == Phase::kWaitingForReceive ||
                         phase == Phase::kWaitingForSum;
  if (!in(f[4], at_action ? size : size + 1)) return std::nullopt;
  for (size_t i = 5; i < kFixed; ++i)
    if (!in(f[i], size + 1)) return std::nullopt;
  RankPosition out;
  out.index = static_cast<int>(f[0]);
  out.pipeline_rank = static_cast<int>(f[1]);
  out.replica = static_cast<int>(f[2]);
  out.progress = {phase,
                  static_cast<size_t>(f[4]),
                  static_cast<size_t>(f[5]),
                  static_cast<size_t>(f[6]),
                  static_cast<size_t>(f[7]),
                  static_cast<size_t>(f[8])};
  for (size_t i = kFixed; i < f.size(); ++i) {
    if (!in(f[i], world)) return std::nullopt;
    out.replica_group.push_back(static_cast<int>(f[i]));
  }
  return out;
}

std::string format_positions(const schedule::Schedule& schedule,
                             const std::vector<RankPosition>& known, int focus, int world) {
  // The marks of the focus rank's replica, the focus rank first (the grid centres on it).
  const int p = schedule.num_ranks();
  std::vector<schedule::GridMark> marks;
  const int replica = focus / p;
  std::vector<const RankPosition*> order;
  for (const RankPosition& r : known)
    if (r.index == focus)
      order.insert(order.begin(), &r);
    else if (r.replica == replica)
      order.push_back(&r);
  for (const RankPosition* r : order) {
    const RankProgress& progress = r->progress;
    const auto& list = schedule.ranks[r->pipeline_rank];
    if (list.empty()) continue;
    // A rank past its actions is drawn at its last one, unmarked cells being ambiguous.
    size_t at = progress.action;
    if (progress.phase == Phase::kEndOfStep || progress.phase == Phase::kDone) at = list.size() - 1;
    if (progress.phase == Phase::kNotStarted) at = 0;
    marks.push_back({r->pipeline_rank, static_cast<int>(std::min(at, list.size() - 1))});
  }
  std::string out = "where the ranks stood";
  if (schedule.replicas > 1) out += " (replica " + std::to_string(replica) + "'s rows)";
  out += ", >>marked<<:\n" + schedule::format_step_grid(schedule, marks, 12, 16);
  // One line for each of the kMaxListed known ranks nearest the focus by index, in rank order:
  // a run of a thousand ranks would otherwise bury the grid and the first error under them.
  constexpr size_t kMaxListed = 16;
  std::vector<int> by_distance;
  for (const RankPosition& r : known) by_distance.push_back(r.index);
  std::stable_sort(by_distance.begin(), by_distance.end(),
                   [&](int a, int b) { return std::abs(a - focus) < std::abs(b - focus); });
  if (by_distance.size() > kMaxListed) by_distance.resize(kMaxListed);
  std::vector<int> named, unlisted;
  for (const RankPosition& r : known) {
    named.push_back(r.index);
    if (std::find(by_distance.begin(), by_distance.end(), r.index) == by_distance.end()) {
      unlisted.push_back(r.index);
      continue;
    }
    const auto& list = schedule.ranks[r.pipeline_rank];
    const RankProgress& pr = r.progress;
    out += "rank " + std::to_string(r.index);
    if (schedule.replicas > 1)
      out += " (row r" + std::to_string(r.pipeline_rank) + ", replica " +
             std::to_string(r.replica) + ")";
    out += ": " + waits_on(schedule, r) + "; heads: compute " + head_text(list, pr.compute) +
           ", send " + head_text(list, pr.send) + ", receive " + head_text(list, pr.recv);
    if (schedule.replicas > 1) out += ", sum " + head_text(list, pr.reduce);
    out += "\n";
  }
  if (!unlisted.empty())
    out += "rank(s) " + comm::rank_list(unlisted) + ": known here, not listed (the " +
           std::to_string(kMaxListed) + " nearest rank " + std::to_string(focus) + " are)\n";
  if (static_cast<int>(named.size()) < world) {
    std::vector<int> others;
    for (int r = 0; r < world; ++r)
      if (std::find(named.begin(), named.end(), r) == named.end()) others.push_back(r);
    out += "rank(s) " + comm::rank_list(others) +
           ": held by other processes, positions not known here (dead or stopped ranks "
           "cannot report; rank 0's process gathers those that can)\n";
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace conveyor
