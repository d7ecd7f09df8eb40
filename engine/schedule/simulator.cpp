#include "engine/schedule/simulator.h"

#include <algorithm>
#include <limits>
#include <tuple>

namespace conveyor::schedule {
namespace {

double per_stage(const std::vector<double>& v, int stage, double fallback = 0.0) {
  if (v.empty()) return fallback;
  if (v.size() == 1) return v[0];
  return stage < static_cast<int>(v.size()) ? v[stage] : fallback;
}

// Position of every action, by (kind, stage, mb), in the list of the rank that owns it.
class ActionIndex {
 public:
  explicit ActionIndex(const Schedule& s) : stages_(s.num_stages()), mbs_(s.num_microbatches) {
    if (static_cast<size_t>(stages_) * static_cast<size_t>(mbs_) > (size_t{1} << 25))
      throw ScheduleError("stages x micro-batches is larger than supported (33554432)");
    index_.assign(static_cast<size_t>(8) * stages_ * mbs_, -1);
    for (const auto& list : s.ranks)
      for (int i = 0; i < static_cast<int>(list.size()); ++i) {
        const auto& a = list[i];
        if (a.stage < stages_ && a.microbatch < mbs_)
          index_[key(a.kind, a.stage, a.microbatch)] = i;
      }
  }
  int at(ActionKind kind, int stage, int mb) const {
    if (stage < 0 || stage >= stages_ || mb < 0 || mb >= mbs_) return -1;
    return index_[key(kind, stage, mb)];
  }

 private:
  size_t key(ActionKind k, int s, int mb) const {
    return (static_cast<size_t>(k) * stages_ + s) * mbs_ + mb;
  }
  int stages_, mbs_;
  std::vector<int> index_;
};

}  // namespace

CostModel CostModel::uniform(double f, double i, double w, double comm) {
  CostModel c;
  c.forward = {f};
  c.backward_input = {i};
  c.backward_weight = {w};
  c.latency = comm;
  return c;
}

double CostModel::cost(const Action& a) const {
  const int s = a.stage;
  switch (a.kind) {
    case ActionKind::kForward:
      return per_stage(forward, s);
    case ActionKind::kBackward:
      return backward.empty() ? per_stage(backward_input, s) + per_stage(backward_weight, s)
                              : per_stage(backward, s);
    case ActionKind::kBackwardInput:
      return per_stage(backward_input, s);
    case ActionKind::kBackwardWeight:
      return per_stage(backward_weight, s);
    default: {
      // The boundary tensor between stage b and b+1 (activation one way, gradient the other).
      const int boundary = (a.kind == ActionKind::kSendAct)    ? s
                           : (a.kind == ActionKind::kRecvAct)  ? s - 1
                           : (a.kind == ActionKind::kSendGrad) ? s - 1
                                                               : s;
      const double bytes = per_stage(message_bytes, boundary);
      return latency + (bandwidth > 0 ? bytes / bandwidth : 0.0);
    }
  }
}

SimResult simulate(const Schedule& schedule, const CostModel& costs) {
  const Placement& pl = schedule.placement;
  const int R = static_cast<int>(schedule.ranks.size());
  const ActionIndex index(schedule);
  constexpr double kUnset = -1.0;

  SimResult result;
  result.timing.resize(R);
  std::vector<std::vector<bool>> done(R);
  // Stream heads: positions in each rank's list of the next compute / send / receive.
  std::vector<int> compute_head(R, 0), send_head(R, 0), recv_head(R, 0);
  std::vector<double> compute_free(R, 0), send_free(R, 0), recv_free(R, 0);
  size_t remaining = 0;
  for (int r = 0; r < R; ++r) {
    result.timing[r].assign(schedule.ranks[r].size(), {kUnset, kUnset});
    done[r].assign(schedule.ranks[r].size(), false);
    remaining += schedule.ranks[r].size();
  }
  auto skip_to = [&](int r, int* head, auto pred) {
    const auto& list = schedule.ranks[r];
    while (*head < static_cast<int>(list.size()) && !pred(list[*head].kind)) ++*head;
  };
  auto missing = [&](int r, int i, const std::string& what) {
    return ScheduleError("rank " + std::to_string(r) + ", position " + std::to_string(i) + ", " +
                         to_string(schedule.ranks[r][i]) + ": " + what +
                         " is missing (validate the schedule first)");
  };
  // Data inputs of a compute action, as positions in the same rank's list.
  auto inputs = [&](int r, int i, int deps[2]) {
    const Action& a = schedule.ranks[r][i];
    const int s = a.stage, k = a.microbatch;
    deps[0] = deps[1] = -2;  // -2: no dependency
    if (a.kind == ActionKind::kForward) {
      if (s > 0)
        deps[0] = pl.rank_of(s - 1) == r ? index.at(ActionKind::kForward, s - 1, k)
                                         : index.at(ActionKind::kRecvAct, s, k);
    } else if (a.kind == ActionKind::kBackwardWeight) {
      deps[0] = index.at(ActionKind::kBackwardInput, s, k);
    } else {
      deps[0] = index.at(ActionKind::kForward, s, k);
      if (s + 1 < pl.num_stages()) {
        if (pl.rank_of(s + 1) == r) {
          const int b = index.at(ActionKind::kBackward, s + 1, k);
          deps[1] = b >= 0 ? b : index.at(ActionKind::kBackwardInput, s + 1, k);
        } else {
          deps[1] = index.at(ActionKind::kRecvGrad, s, k);
        }
      }
    }
  };
  auto producer_of_send = [&](const Action& a) {
    if (a.kind == ActionKind::kSendAct)
      return index.at(ActionKind::kForward, a.stage, a.microbatch);
    const int b = index.at(ActionKind::kBackward, a.stage, a.microbatch);
    return b >= 0 ? b : index.at(ActionKind::kBackwardInput, a.stage, a.microbatch);
  };
  auto matching_recv = [&](const Action& a) {
    return a.kind == ActionKind::kSendAct
               ? index.at(ActionKind::kRecvAct, a.stage + 1, a.microbatch)
               : index.at(ActionKind::kRecvGrad, a.stage - 1, a.microbatch);
  };

  bool progress = true;
  while (remaining > 0 && progress) {
    progress = false;
    for (int r = 0; r < R; ++r) {
      const auto& list = schedule.ranks[r];
      // Compute stream.
      for (;;) {
        skip_to(r, &compute_head[r], is_compute);
        const int i = compute_head[r];
        if (i >= static_cast<int>(list.size())) break;
        int deps[2];
        inputs(r, i, deps);
        double ready = compute_free[r];
        bool blocked = false;
        for (int d : deps) {
          if (d == -2) continue;
          if (d < 0) throw missing(r, i, "an input of this action");
          if (!done[r][d]) {
            blocked = true;
            break;
          }
          ready = std::max(ready, result.timing[r][d].end);
        }
        if (blocked) break;
        result.timing[r][i] = {ready, ready + costs.cost(list[i])};
        compute_free[r] = result.timing[r][i].end;
        done[r][i] = true;
        --remaining, ++compute_head[r], progress = true;
      }
      // Send stream: a send starts with its matching receive at the head of the peer's
      // receive stream.
      for (;;) {
        skip_to(r, &send_head[r], is_send);
        const int i = send_head[r];
        if (i >= static_cast<int>(list.size())) break;
        const Action& a = list[i];
        const int producer = producer_of_send(a);
        if (producer < 0) throw missing(r, i, "the compute producing this message");
        if (!done[r][producer]) break;
        const int dst = a.peer;
        if (dst < 0 || dst >= R) throw missing(r, i, "the peer rank");
        const int j = matching_recv(a);
        if (j < 0) throw missing(r, i, "the matching receive");
        skip_to(dst, &recv_head[dst], is_recv);
        if (recv_head[dst] != j) break;
        const double start =
            std::max({result.timing[r][producer].end, send_free[r], recv_free[dst]});
        const double end = start + costs.cost(a);
        result.timing[r][i] = {start, end};
        result.timing[dst][j] = {start, end};
        send_free[r] = recv_free[dst] = end;
        done[r][i] = done[dst][j] = true;
        remaining -= 2, ++send_head[r], ++recv_head[dst], progress = true;
      }
    }
  }
  if (remaining > 0) {
    std::vector<StuckAction> stuck;
    std::string msg = "deadlock: the run cannot finish;";
    for (int r = 0; r < R; ++r) {
      const auto& list = schedule.ranks[r];
      for (int* head : {&compute_head[r], &send_head[r], &recv_head[r]}) {
        if (head == &compute_head[r]) skip_to(r, head, is_compute);
        if (head == &send_head[r]) skip_to(r, head, is_send);
        if (head == &recv_head[r]) skip_to(r, head, is_recv);
        if (*head >= static_cast<int>(list.size())) continue;
        const Action& a = list[*head];
        std::string why =
            is_compute(a.kind) ? "waits for its input"
            : is_send(a.kind)
                ? "waits for rank " + std::to_string(a.peer) + " to post the matching receive"
                : "waits for rank " + std::to_string(a.peer) + " to send";
        stuck.push_back({r, *head, why});
      }
    }
    std::sort(stuck.begin(), stuck.end(), [](const StuckAction& x, const StuckAction& y) {
      return std::tie(x.rank, x.index) < std::tie(y.rank, y.index);
    });
    stuck.erase(std::unique(stuck.begin(), stuck.end(),
                            [](const StuckAction& x, const StuckAction& y) {
                              return x.rank == y.rank && x.index == y.index;
                            }),
                stuck.end());
    for (size_t n = 0; n < stuck.size() && n < 6; ++n)
      msg += " rank " + std::to_string(stuck[n].rank) + " position " +
             std::to_string(stuck[n].index) + " " +
             to_string(schedule.ranks[stuck[n].rank][stuck[n].index]) + " " + stuck[n].waiting_for +
             (n + 1 < stuck.size() && n < 5 ? ";" : "");
    throw DeadlockError(msg, std::move(stuck));
  }

  // Summary.
  result.ranks.resize(R);
  const auto memory = in_flight_per_rank(schedule, costs.activation_bytes);
  for (int r = 0; r < R; ++r) {
    auto& st = result.ranks[r];
    for (size_t i = 0; i < schedule.ranks[r].size(); ++i) {
      const auto& t = result.timing[r][i];
      st.end = std::max(st.end, t.end);
      if (is_compute(schedule.ranks[r][i].kind)) st.busy += t.end - t.start;
    }
    st.memory = memory[r];
    result.makespan = std::max(result.makespan, st.end);
  }
  double total_idle = 0;
  for (auto& st : result.ranks) st.idle = result.makespan - st.busy, total_idle += st.idle;
  // idle / (R * makespan) rather than 1 - busy / (...): one rounding, so integer costs give
  // the correctly rounded closed form.
  result.bubble_fraction =
      result.makespan > 0 ? total_idle / (static_cast<double>(R) * result.makespan) : 0.0;
  return result;
}

}  // namespace conveyor::schedule
