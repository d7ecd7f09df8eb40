#include "engine/schedule/measured_timing.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace conveyor::schedule {
namespace {

void check_parallel(const Schedule& schedule,
                    const std::vector<std::vector<ActionTiming>>& timing) {
  if (static_cast<int>(timing.size()) != schedule.num_ranks())
    throw std::invalid_argument("the measured timeline has " + std::to_string(timing.size()) +
                                " ranks, the schedule " + std::to_string(schedule.num_ranks()));
  for (int r = 0; r < schedule.num_ranks(); ++r)
    if (timing[r].size() != schedule.ranks[r].size())
      throw std::invalid_argument("the measured timeline of rank " + std::to_string(r) + " has " +
                                  std::to_string(timing[r].size()) + " actions, the schedule " +
                                  std::to_string(schedule.ranks[r].size()));
}

}  // namespace

CostModel measured_costs(const Schedule& sched,
                         const std::vector<std::vector<ActionTiming>>& timing) {
  check_parallel(sched, timing);
  const int stages = sched.num_stages();
  std::vector<double> f(stages, 0), b(stages, 0), i(stages, 0), w(stages, 0);
  std::vector<int> nf(stages, 0), nb(stages, 0), ni(stages, 0), nw(stages, 0);
  double comm = 0, reduce = 0;
  int ncomm = 0, nreduce = 0;
  for (int r = 0; r < sched.num_ranks(); ++r)
    for (size_t k = 0; k < sched.ranks[r].size(); ++k) {
      const Action& a = sched.ranks[r][k];
      const double d = timing[r][k].end - timing[r][k].start;
      switch (a.kind) {
        case ActionKind::kForward:
          f[a.stage] += d, ++nf[a.stage];
          break;
        case ActionKind::kBackward:
          b[a.stage] += d, ++nb[a.stage];
          break;
        case ActionKind::kBackwardInput:
          i[a.stage] += d, ++ni[a.stage];
          break;
        case ActionKind::kBackwardWeight:
          w[a.stage] += d, ++nw[a.stage];
          break;
        case ActionKind::kAllReduceGrad:
          reduce += d, ++nreduce;
          break;
        default:
          break;  // transfers: below, per message
      }
    }
  // A transfer's time is that of its message, from when both its send and its receive had
  // started (the simulator's rendezvous) to when both had ended. A receive's own duration
  // would not do: it is posted early and its wait for the sender's compute is in it, which
  // the simulator, charging it as latency on top of that wait, would count twice. A message
  // is one send and one receive (message_key).
  std::vector<const ActionTiming*> sent(2 * static_cast<size_t>(stages) * sched.num_microbatches,
                                        nullptr);
  auto slot = [&](const Action& a) -> const ActionTiming** {
    const MessageKey key = message_key(a);
    if (key.producer_stage < 0 || key.producer_stage >= stages || key.microbatch < 0 ||
        key.microbatch >= sched.num_microbatches)
      return nullptr;
    return &sent[static_cast<size_t>(message_index(key, stages, sched.num_microbatches))];
  };
  for (int r = 0; r < sched.num_ranks(); ++r)
    for (size_t k = 0; k < sched.ranks[r].size(); ++k)
      if (is_send(sched.ranks[r][k].kind))
        if (const ActionTiming** s = slot(sched.ranks[r][k])) *s = &timing[r][k];
  for (int r = 0; r < sched.num_ranks(); ++r)
    for (size_t k = 0; k < sched.ranks[r].size(); ++k) {
      if (!is_recv(sched.ranks[r][k].kind)) continue;
      const ActionTiming& recv = timing[r][k];
      const ActionTiming** s = slot(sched.ranks[r][k]);
      const ActionTiming* send = s ? *s : nullptr;
      comm += send ? std::max(send->end, recv.end) - std::max(send->start, recv.start)
                   : recv.end - recv.start;
      ++ncomm;
    }
  CostModel costs;
  costs.forward.assign(stages, 0);
  costs.backward_input.assign(stages, 0);
  costs.backward_weight.assign(stages, 0);
  const bool split = sched.splits_backward();
  if (!split) costs.backward.assign(stages, 0);
  for (int s = 0; s < stages; ++s) {
    costs.forward[s] = nf[s] ? f[s] / nf[s] : 0;
    if (split) {
      costs.backward_input[s] = ni[s] ? i[s] / ni[s] : 0;
      costs.backward_weight[s] = nw[s] ? w[s] / nw[s] : 0;
    } else {
      costs.backward[s] = nb[s] ? b[s] / nb[s] : 0;
    }
  }
  costs.latency = ncomm ? comm / ncomm : 0;
  costs.reduce_latency = nreduce ? reduce / nreduce : 0;
  return costs;
}

namespace {

double earliest_start(const std::vector<std::vector<ActionTiming>>& timing) {
  double first = INFINITY;
  for (const auto& rank : timing)
    for (const auto& t : rank) first = std::min(first, t.start);
  return std::isfinite(first) ? first : 0;
}

// The timeline shifted so that `first` is at 0.
SimResult summarize_from(const Schedule& sched, std::vector<std::vector<ActionTiming>> timing,
                         double first) {
  check_parallel(sched, timing);
  SimResult out;
  double last = 0;
  for (const auto& rank : timing)
    for (const auto& t : rank) last = std::max(last, t.end);
  for (auto& rank : timing)
    for (auto& t : rank) t.start -= first, t.end -= first;
  out.makespan = last - first;
  double idle = 0;
  for (int r = 0; r < sched.num_ranks(); ++r) {
    RankStats stats;
    for (size_t k = 0; k < sched.ranks[r].size(); ++k) {
      if (is_compute(sched.ranks[r][k].kind)) stats.busy += timing[r][k].end - timing[r][k].start;
      stats.end = std::max(stats.end, timing[r][k].end);
    }
    stats.idle = out.makespan - stats.busy;
    idle += stats.idle;
    out.ranks.push_back(stats);
  }
  out.bubble_fraction = out.makespan > 0 ? idle / (sched.num_ranks() * out.makespan) : 0;
  out.timing = std::move(timing);
  return out;
}

}  // namespace

SimResult summarize_timing(const Schedule& sched, std::vector<std::vector<ActionTiming>> timing) {
  const double first = earliest_start(timing);
  return summarize_from(sched, std::move(timing), first);
}

std::vector<std::vector<ActionTiming>> replica_timeline(
    const Schedule& sched, const std::vector<std::vector<ActionTiming>>& world, int replica) {
  const auto p = static_cast<size_t>(sched.num_ranks());
  if (replica < 0 || replica >= sched.replicas ||
      world.size() != p * static_cast<size_t>(sched.replicas))
    throw std::invalid_argument("the measured timeline has " + std::to_string(world.size()) +
                                " ranks, the schedule " + std::to_string(p) + " x " +
                                std::to_string(sched.replicas) + " replicas; replica " +
                                std::to_string(replica) + " was asked for");
  const auto begin = world.begin() + static_cast<std::ptrdiff_t>(p * replica);
  return {begin, begin + static_cast<std::ptrdiff_t>(p)};
}

std::vector<SimResult> summarize_replicas(const Schedule& sched,
                                          const std::vector<std::vector<ActionTiming>>& world) {
  const double first = earliest_start(world);
  std::vector<SimResult> out;
  for (int d = 0; d < sched.replicas; ++d)
    out.push_back(summarize_from(sched, replica_timeline(sched, world, d), first));
  return out;
}

std::vector<double> align_to_transfers(const Schedule& sched,
                                       std::vector<std::vector<ActionTiming>>& world) {
  const auto p = static_cast<size_t>(sched.num_ranks());
  for (int d = 0; d < sched.replicas; ++d) check_parallel(sched, replica_timeline(sched, world, d));
  // Each pair as (the later end's rank and action, the earlier start's): the end, moved with
  // its rank, may not come before the start, moved with its own.
  struct Pair {
    size_t end_rank, end_action, start_rank, start_action;
  };
  std::vector<Pair> pairs;
  const int stages = sched.num_stages(), m = sched.num_microbatches;
  std::vector<size_t> sender(2 * static_cast<size_t>(stages) * m), position(sender.size());
  for (size_t d = 0; d < static_cast<size_t>(sched.replicas); ++d) {
    std::fill(sender.begin(), sender.end(), SIZE_MAX);
    // The message a transfer carries, or SIZE_MAX for a compute or an all-reduce.
    auto slot = [&](const Action& a) -> size_t {
      if (!is_transfer(a.kind)) return SIZE_MAX;
      const MessageKey key = message_key(a);
      if (key.producer_stage < 0 || key.producer_stage >= stages || key.microbatch < 0 ||
          key.microbatch >= m)
        return SIZE_MAX;
      return static_cast<size_t>(message_index(key, stages, m));
    };
    for (size_t r = 0; r < p; ++r)
      for (size_t k = 0; k < sched.ranks[r].size(); ++k)
        if (const Action& a = sched.ranks[r][k]; is_send(a.kind) && slot(a) != SIZE_MAX)
          sender[slot(a)] = d * p + r, position[slot(a)] = k;
    for (size_t r = 0; r < p; ++r)
      for (size_t k = 0; k < sched.ranks[r].size(); ++k)
        if (const Action& a = sched.ranks[r][k];
            is_recv(a.kind) && slot(a) != SIZE_MAX && sender[slot(a)] != SIZE_MAX)
          pairs.push_back({d * p + r, k, sender[slot(a)], position[slot(a)]});
  }
  // A replica's rank runs the same actions as replica 0's: its k-th is an all-reduce of the
  // same gradients, which ends nowhere before it began everywhere.
  std::vector<std::pair<size_t, size_t>> reduces;
  for (size_t r = 0; r < p; ++r)
    for (size_t k = 0; k < sched.ranks[r].size(); ++k)
      if (is_reduce(sched.ranks[r][k].kind) && sched.replicas > 1) reduces.emplace_back(r, k);
  // The least shifts at or above zero that make every pair hold, as shortest paths are found
  // (Bellman-Ford): each pass raises the ends that come too early; one pass more than there
  // are ranks without settling means a cycle of contradicting pairs. The comparison is the
  // one applying the shifts makes, so that no end lands a rounding error before its start.
  std::vector<double> shift(world.size(), 0.0);
  bool settled = false;
  auto end_at_or_after = [&](size_t rank, size_t action, double start) {
    const double end = world[rank][action].end;
    if (end + shift[rank] >= start) return;
    double s = start - end;
    while (end + s < start) s = std::nextafter(s, INFINITY);
    shift[rank] = s;
    settled = false;
  };
  for (size_t pass = 0; pass <= world.size() && !settled; ++pass) {
    settled = true;
    for (const Pair& q : pairs)
      end_at_or_after(q.end_rank, q.end_action,
                      world[q.start_rank][q.start_action].start + shift[q.start_rank]);
    for (const auto& [r, k] : reduces) {
      double latest = -INFINITY;
      for (size_t d = 0; d < static_cast<size_t>(sched.replicas); ++d)
        latest = std::max(latest, world[d * p + r][k].start + shift[d * p + r]);
      for (size_t d = 0; d < static_cast<size_t>(sched.replicas); ++d)
        end_at_or_after(d * p + r, k, latest);
    }
  }
  if (!settled) return {};
  for (size_t r = 0; r < world.size(); ++r)
    for (ActionTiming& t : world[r]) t.start += shift[r], t.end += shift[r];
  return shift;
}

ReductionOverlap reduction_overlap(const Schedule& sched, const SimResult& result) {
  check_parallel(sched, result.timing);
  // The union of every rank's compute intervals, merged into disjoint ones in time order.
  std::vector<ActionTiming> busy;
  for (int r = 0; r < sched.num_ranks(); ++r)
    for (size_t k = 0; k < sched.ranks[r].size(); ++k)
      if (is_compute(sched.ranks[r][k].kind)) busy.push_back(result.timing[r][k]);
  std::sort(busy.begin(), busy.end(),
            [](const ActionTiming& a, const ActionTiming& b) { return a.start < b.start; });
  std::vector<ActionTiming> merged;
  for (const ActionTiming& t : busy) {
    if (!merged.empty() && t.start <= merged.back().end)
      merged.back().end = std::max(merged.back().end, t.end);
    else
      merged.push_back(t);
  }
  ReductionOverlap out;
  for (int r = 0; r < sched.num_ranks(); ++r)
    for (size_t k = 0; k < sched.ranks[r].size(); ++k) {
      if (!is_reduce(sched.ranks[r][k].kind)) continue;
      const ActionTiming& t = result.timing[r][k];
      out.reduce_time += t.end - t.start;
      // The first merged interval that ends after the all-reduce starts, and those after it
      // that start before it ends.
      auto it = std::upper_bound(merged.begin(), merged.end(), t.start,
                                 [](double x, const ActionTiming& m) { return x < m.end; });
      for (; it != merged.end() && it->start < t.end; ++it)
        out.hidden_time += std::min(t.end, it->end) - std::max(t.start, it->start);
    }
  return out;
}

}  // namespace conveyor::schedule
