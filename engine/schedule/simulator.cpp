#include "engine/schedule/simulator.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <tuple>

namespace conveyor::schedule {
namespace {

double per_stage(const std::vector<double>& v, int stage, double fallback = 0.0) {
  if (v.empty()) return fallback;
  if (v.size() == 1) return v[0];
  return stage < static_cast<int>(v.size()) ? v[stage] : fallback;
}

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
    case ActionKind::kAllReduceGrad:
      return reduce_latency +
             (reduce_bandwidth > 0 ? per_stage(gradient_bytes, s) / reduce_bandwidth : 0.0);
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

namespace {

// The execution model (docs/execution-model.md): every rank runs three in-order streams —
// compute, send, receive — over its list. A compute waits for its inputs; a send waits for
// the compute that produced its tensor; a transfer happens when the send is at the head of
// its sender's send stream and the matching receive at the head of the receiver's receive
// stream (rendezvous). Nothing else orders actions.
//
// Ranks are visited from a work list: a rank runs until none of its streams can move, and a
// rank is put back on the list only when a transfer may have unblocked it. Each visit thus
// makes progress, so the cost is linear in the number of actions, where sweeping all ranks
// until nothing moves costs ranks x sweeps. Times follow from the stream order and the data
// dependencies alone, so the visiting order changes no result.
template <bool kTimed>
class StreamRun {
 public:
  StreamRun(const Schedule& s, const ActionIndex& index, const CostModel* costs,
            std::vector<std::vector<ActionTiming>>* timing)
      : s_(s), index_(index), costs_(costs), timing_(timing), ranks_(s.ranks.size()) {
    const size_t R = ranks_;
    compute_head_.assign(R, 0), send_head_.assign(R, 0), recv_head_.assign(R, 0);
    reduce_head_.assign(R, 0), reduces_.resize(R);
    if constexpr (kTimed) {
      compute_free_.assign(R, 0), send_free_.assign(R, 0), recv_free_.assign(R, 0);
      reduce_free_.assign(R, 0);
      timing_->resize(R);
    }
    for (size_t r = 0; r < R; ++r) find_reduces(static_cast<int>(r));
    queued_.assign(R, 1);
    for (size_t r = 0; r < R; ++r) {
      remaining_ += s.ranks[r].size();
      if constexpr (kTimed) (*timing_)[r].assign(s.ranks[r].size(), {kUnset, kUnset});
      work_.push_back(static_cast<int>(r));
    }
  }

  void run() {
    while (!work_.empty()) {
      const int r = work_.back();
      work_.pop_back();
      queued_[r] = 0;
      visit(r);
    }
    if (remaining_ > 0) throw deadlock();
  }

 private:
  static constexpr double kUnset = -1.0;

  int size(int r) const { return static_cast<int>(s_.ranks[r].size()); }
  const Action& action(int r, int i) const { return s_.ranks[r][i]; }

  template <class Pred>
  int& head(std::vector<int>& heads, int r, Pred pred) {
    int& h = heads[r];
    while (h < size(r) && !pred(action(r, h).kind)) ++h;
    return h;
  }
  int& compute_head(int r) { return head(compute_head_, r, is_compute); }
  int& send_head(int r) { return head(send_head_, r, is_send); }
  int& recv_head(int r) { return head(recv_head_, r, is_recv); }

  // An action has run when the head of its stream is past it: each stream runs its kind in
  // list order.
  double end_of(int r, int i) const {
    if constexpr (kTimed) return (*timing_)[r][i].end;
    return 0.0;
  }

  // The rank's all-reduces in list order, each with the position of the last weight-gradient
  // action of its stage before it (-1: none), the compute it waits for.
  void find_reduces(int r) {
    std::vector<std::pair<int, int>> last_weight_grad;  // (stage, position), few stages
    for (int i = 0; i < size(r); ++i) {
      const Action& a = action(r, i);
      if (is_weight_grad(a.kind)) {
        auto it = std::find_if(last_weight_grad.begin(), last_weight_grad.end(),
                               [&](const auto& e) { return e.first == a.stage; });
        if (it == last_weight_grad.end())
          last_weight_grad.emplace_back(a.stage, i);
        else
          it->second = i;
      } else if (is_reduce(a.kind)) {
        int dep = -1;
        for (const auto& [stage, at] : last_weight_grad)
          if (stage == a.stage) dep = at;
        reduces_[r].emplace_back(i, dep);
      }
    }
  }

  ScheduleError missing(int r, int i, const std::string& what) const {
    return ScheduleError("rank " + std::to_string(r) + ", position " + std::to_string(i) + ", " +
                         to_string(action(r, i)) + ": " + what +
                         " is missing (validate the schedule first)");
  }

  // Data inputs of a compute action, as positions in the same rank's list (-2: none), and
  // whether each is a receive (else a compute), so that checking them reads no action.
  void inputs(int r, const Action& a, int deps[2], bool received[2]) const {
    const Placement& pl = s_.placement;
    const int st = a.stage, k = a.microbatch;
    deps[0] = deps[1] = -2;
    received[0] = received[1] = false;
    if (a.kind == ActionKind::kForward) {
      if (st > 0) {
        received[0] = pl.rank_of(st - 1) != r;
        deps[0] = received[0] ? index_.at(ActionKind::kRecvAct, st, k)
                              : index_.at(ActionKind::kForward, st - 1, k);
      }
    } else if (a.kind == ActionKind::kBackwardWeight) {
      deps[0] = index_.at(ActionKind::kBackwardInput, st, k);
    } else {
      deps[0] = index_.at(ActionKind::kForward, st, k);
      if (st + 1 < pl.num_stages()) {
        if (pl.rank_of(st + 1) == r) {
          const int b = index_.at(ActionKind::kBackward, st + 1, k);
          deps[1] = b >= 0 ? b : index_.at(ActionKind::kBackwardInput, st + 1, k);
        } else {
          deps[1] = index_.at(ActionKind::kRecvGrad, st, k);
          received[1] = true;
        }
      }
    }
  }
  int producer_of_send(const Action& a) const {
    if (a.kind == ActionKind::kSendAct)
      return index_.at(ActionKind::kForward, a.stage, a.microbatch);
    const int b = index_.at(ActionKind::kBackward, a.stage, a.microbatch);
    return b >= 0 ? b : index_.at(ActionKind::kBackwardInput, a.stage, a.microbatch);
  }
  int matching_recv(const Action& a) const {
    return a.kind == ActionKind::kSendAct
               ? index_.at(ActionKind::kRecvAct, a.stage + 1, a.microbatch)
               : index_.at(ActionKind::kRecvGrad, a.stage - 1, a.microbatch);
  }

  void wake(int r) {
    if (r < 0 || r >= static_cast<int>(ranks_) || queued_[r]) return;
    queued_[r] = 1;
    work_.push_back(r);
  }

  // Runs rank r's streams until none can move.
  void visit(int r) {
    for (bool progress = true; progress;) {
      progress = false;
      for (;;) {  // compute stream
        const int i = compute_head(r);
        if (i >= size(r)) break;
        int deps[2];
        bool received[2];
        inputs(r, action(r, i), deps, received);
        double ready = 0;
        if constexpr (kTimed) ready = compute_free_[r];
        bool blocked = false;
        for (int n = 0; n < 2; ++n) {
          const int d = deps[n];
          if (d == -2) continue;
          if (d < 0) throw missing(r, i, "an input of this action");
          if ((received[n] ? recv_head_[r] : compute_head_[r]) <= d) {
            blocked = true;
            break;
          }
          if constexpr (kTimed) ready = std::max(ready, end_of(r, d));
        }
        if (blocked) break;
        if constexpr (kTimed) {
          (*timing_)[r][i] = {ready, ready + costs_->cost(action(r, i))};
          compute_free_[r] = (*timing_)[r][i].end;
        }
        ++compute_head_[r], --remaining_, progress = true;
      }
      for (;;) {  // send stream, rendezvous with the receiver's receive stream
        const int i = send_head(r);
        if (i >= size(r)) break;
        const Action& a = action(r, i);
        const int producer = producer_of_send(a);
        if (producer < 0) throw missing(r, i, "the compute producing this message");
        if (compute_head_[r] <= producer) break;
        const int dst = a.peer;
        if (dst < 0 || dst >= static_cast<int>(ranks_)) throw missing(r, i, "the peer rank");
        const int j = matching_recv(a);
        if (j < 0) throw missing(r, i, "the matching receive");
        if (recv_head(dst) != j) break;
        if constexpr (kTimed) {
          const double start = std::max({end_of(r, producer), send_free_[r], recv_free_[dst]});
          const double end = start + costs_->cost(a);
          (*timing_)[r][i] = (*timing_)[dst][j] = {start, end};
          send_free_[r] = recv_free_[dst] = end;
        }
        ++send_head_[r], ++recv_head_[dst], remaining_ -= 2, progress = true;
        // The receiver's computes may now run, and the sender of its next receive may be
        // waiting for that receive to reach the head.
        if (dst != r) wake(dst);
        const int next = recv_head(dst);
        if (next < size(dst)) {
          const int sender = action(dst, next).peer;
          if (sender >= 0 && sender < static_cast<int>(ranks_) && sender != r) {
            const int h = send_head(sender);
            if (h < size(sender) && matching_recv(action(sender, h)) == next) wake(sender);
          }
        }
      }
      // Reduction stream: an all-reduce waits only for its stage's weight gradients here, and
      // for the same point in every other replica, which runs the same list.
      for (auto& h = reduce_head_[r]; h < reduces_[r].size(); ++h) {
        const auto [i, dep] = reduces_[r][h];
        if (dep >= 0 && compute_head_[r] <= dep) break;
        if constexpr (kTimed) {
          const double start = std::max(reduce_free_[r], dep >= 0 ? end_of(r, dep) : 0.0);
          (*timing_)[r][i] = {start, start + costs_->cost(action(r, i))};
          reduce_free_[r] = (*timing_)[r][i].end;
        }
        --remaining_, progress = true;
      }
    }
  }

  int reduce_position(int r) const {
    const size_t h = reduce_head_[r];
    return h < reduces_[r].size() ? reduces_[r][h].first : size(r);
  }

  DeadlockError deadlock() {
    std::vector<StuckAction> stuck;
    std::string msg = "deadlock: the run cannot finish;";
    for (int r = 0; r < static_cast<int>(ranks_); ++r)
      for (int h : {compute_head(r), send_head(r), recv_head(r), reduce_position(r)}) {
        if (h >= size(r)) continue;
        const Action& a = action(r, h);
        std::string why =
            is_compute(a.kind)  ? "waits for its input"
            : is_reduce(a.kind) ? "waits for the weight gradients of its stage"
            : is_send(a.kind)
                ? "waits for rank " + std::to_string(a.peer) + " to post the matching receive"
                : "waits for rank " + std::to_string(a.peer) + " to send";
        stuck.push_back({r, h, why});
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
             to_string(action(stuck[n].rank, stuck[n].index)) + " " + stuck[n].waiting_for +
             (n + 1 < stuck.size() && n < 5 ? ";" : "");
    return DeadlockError(msg, std::move(stuck));
  }

  const Schedule& s_;
  const ActionIndex& index_;
  const CostModel* costs_;
  std::vector<std::vector<ActionTiming>>* timing_;
  size_t ranks_;
  std::vector<int> compute_head_, send_head_, recv_head_;
  std::vector<double> compute_free_, send_free_, recv_free_, reduce_free_;
  std::vector<std::vector<std::pair<int, int>>> reduces_;  // per rank: (position, its input)
  std::vector<size_t> reduce_head_;
  size_t remaining_ = 0;
  std::deque<int> work_;
  std::vector<char> queued_;
};

// The kinds the model looks up: inputs of computes, producers of sends, matching receives.
constexpr ActionIndex::KindSet kLookedUpKinds = {true, true,  true, false, false,
                                                 true, false, true, false};

}  // namespace

void check_progress(const Schedule& schedule, const ActionIndex& index) {
  StreamRun<false>(schedule, index, nullptr, nullptr).run();
}

SimResult simulate(const Schedule& schedule, const CostModel& costs) {
  const int R = static_cast<int>(schedule.ranks.size());
  SimResult result;
  {
    ActionIndex index(schedule.num_stages(), schedule.num_microbatches, kLookedUpKinds);
    index.insert_all(schedule);
    StreamRun<true>(schedule, index, &costs, &result.timing).run();
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
      if (is_reduce(schedule.ranks[r][i].kind)) st.reduce += t.end - t.start;
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
