#include "engine/schedule/simulator.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>

#include "engine/schedule/action_index.h"

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

// What other actions wait on, by (stage, micro-batch): whether the forward, the backward that
// produces the input gradient (B or I), and the received activation and gradient are done
// and, in a timed run, when they ended. Tables by (stage, micro-batch) rather than by list
// position: a dependency is then found without an index lookup, and an untimed run keeps one
// bit per entry, so the whole state of a large run stays in cache.
template <bool kTimed>
class Completions {
 public:
  enum Kind { kForwardDone, kGradientDone, kActivationIn, kGradientIn, kKinds };

  Completions(int stages, int microbatches) : stages_(stages), mbs_(microbatches) {
    const size_t cells = table_cells(stages, microbatches);
    if constexpr (kTimed)
      end_.assign(kKinds * cells, kNotDone);
    else
      done_.assign((kKinds * cells + 63) / 64, 0);
  }

  bool done(Kind kind, int stage, int mb) const {
    const size_t c = cell(kind, stage, mb);
    if constexpr (kTimed) return end_[c] != kNotDone;
    return (done_[c / 64] >> (c % 64)) & 1;
  }
  double end(Kind kind, int stage, int mb) const {
    if constexpr (kTimed) return end_[cell(kind, stage, mb)];
    return 0.0;
  }
  void mark(Kind kind, int stage, int mb, double end) {
    const size_t c = cell(kind, stage, mb);
    if constexpr (kTimed)
      end_[c] = end;
    else
      done_[c / 64] |= uint64_t{1} << (c % 64);
  }

 private:
  static constexpr double kNotDone = -1.0;
  size_t cell(Kind kind, int stage, int mb) const {
    return (static_cast<size_t>(kind) * stages_ + stage) * mbs_ + mb;
  }
  int stages_, mbs_;
  std::vector<double> end_;
  std::vector<uint64_t> done_;
};

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
  using Done = Completions<kTimed>;

 public:
  StreamRun(const Schedule& s, const CostModel* costs,
            std::vector<std::vector<ActionTiming>>* timing)
      : s_(s),
        costs_(costs),
        timing_(timing),
        ranks_(static_cast<int>(s.ranks.size())),
        stages_(s.num_stages()),
        mbs_(s.num_microbatches),
        done_(stages_, mbs_) {
    owner_.resize(stages_);
    for (int st = 0; st < stages_; ++st) owner_[st] = s.placement.rank_of(st);
    const size_t R = ranks_;
    compute_head_.assign(R, 0), send_head_.assign(R, 0), recv_head_.assign(R, 0);
    reduce_head_.assign(R, 0), reduces_.resize(R);
    if constexpr (kTimed) {
      compute_free_.assign(R, 0), send_free_.assign(R, 0), recv_free_.assign(R, 0);
      reduce_free_.assign(R, 0);
      timing_->resize(R);
    }
    for (size_t r = 0; r < R; ++r) {
      check_ranges(static_cast<int>(r));
      find_reduces(static_cast<int>(r));
    }
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

  int reduce_position(int r) const {
    const size_t h = reduce_head_[r];
    return h < reduces_[r].size() ? reduces_[r][h].first : size(r);
  }

  // Schedules that did not pass validate() may name stages, micro-batches or peers that do
  // not exist; they get an error, not an out-of-range read. Checked once, before the run, so
  // that the run itself reads each action only to move it.
  void check_ranges(int r) const {
    for (int i = 0; i < size(r); ++i) {
      const Action& a = action(r, i);
      const bool peer_ok = !is_transfer(a.kind) || (a.peer >= 0 && a.peer < ranks_);
      if (a.stage < 0 || a.stage >= stages_ || a.microbatch < 0 || a.microbatch >= mbs_ || !peer_ok)
        throw ScheduleError("rank " + std::to_string(r) + ", position " + std::to_string(i) + ", " +
                            to_string(a) +
                            ": stage, micro-batch or peer out of range (validate the schedule "
                            "first)");
    }
  }

  // Whether the inputs of compute `a` on rank r are there, and when the last one ended.
  bool inputs_ready(int r, const Action& a, double* ready) const {
    const int st = a.stage, k = a.microbatch;
    auto need = [&](typename Done::Kind kind, int stage) {
      if (!done_.done(kind, stage, k)) return false;
      if constexpr (kTimed) *ready = std::max(*ready, done_.end(kind, stage, k));
      return true;
    };
    switch (a.kind) {
      case ActionKind::kForward:
        if (st == 0) return true;
        return owner_[st - 1] == r ? need(Done::kForwardDone, st - 1)
                                   : need(Done::kActivationIn, st);
      case ActionKind::kBackwardWeight:
        return need(Done::kGradientDone, st);
      default:  // B or I: the forward's activations and the output gradient
        if (!need(Done::kForwardDone, st)) return false;
        if (st + 1 == stages_) return true;
        return owner_[st + 1] == r ? need(Done::kGradientDone, st + 1)
                                   : need(Done::kGradientIn, st);
    }
  }

  // The receive at `dst`'s receive head, if it takes the message of send `a`.
  bool receives(int dst, int j, const Action& a) const {
    if (j >= size(dst)) return false;
    const Action& b = action(dst, j);
    return message_key(b) == message_key(a);
  }

  void wake(int r) {
    if (r < 0 || r >= ranks_ || queued_[r]) return;
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
        const Action& a = action(r, i);
        double ready = 0;
        if constexpr (kTimed) ready = compute_free_[r];
        if (!inputs_ready(r, a, &ready)) break;
        double end = 0;
        if constexpr (kTimed) {
          end = ready + costs_->cost(a);
          (*timing_)[r][i] = {ready, end};
          compute_free_[r] = end;
        }
        if (a.kind == ActionKind::kForward)
          done_.mark(Done::kForwardDone, a.stage, a.microbatch, end);
        else if (a.kind != ActionKind::kBackwardWeight)
          done_.mark(Done::kGradientDone, a.stage, a.microbatch, end);
        ++compute_head_[r], --remaining_, progress = true;
      }
      for (;;) {  // send stream, rendezvous with the receiver's receive stream
        const int i = send_head(r);
        if (i >= size(r)) break;
        const Action& a = action(r, i);
        const bool act = a.kind == ActionKind::kSendAct;
        const auto produced = act ? Done::kForwardDone : Done::kGradientDone;
        if (!done_.done(produced, a.stage, a.microbatch)) break;
        const int dst = a.peer;
        const int j = recv_head(dst);
        if (!receives(dst, j, a)) break;
        double end = 0;
        if constexpr (kTimed) {
          const double start = std::max(
              {done_.end(produced, a.stage, a.microbatch), send_free_[r], recv_free_[dst]});
          end = start + costs_->cost(a);
          (*timing_)[r][i] = (*timing_)[dst][j] = {start, end};
          send_free_[r] = recv_free_[dst] = end;
        }
        if (act)
          done_.mark(Done::kActivationIn, a.stage + 1, a.microbatch, end);
        else
          done_.mark(Done::kGradientIn, a.stage - 1, a.microbatch, end);
        ++send_head_[r], ++recv_head_[dst], remaining_ -= 2, progress = true;
        // The receiver's computes may now run, and the sender of its next receive may be
        // waiting for that receive to reach the head.
        if (dst != r) wake(dst);
        const int next = recv_head(dst);
        if (next < size(dst)) {
          const int sender = action(dst, next).peer;
          if (sender >= 0 && sender < ranks_ && sender != r) {
            const int h = send_head(sender);
            if (h < size(sender) && receives(dst, next, action(sender, h))) wake(sender);
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

  DeadlockError deadlock() {
    std::vector<StuckAction> stuck;
    std::string msg = "deadlock: the run cannot finish;";
    for (int r = 0; r < ranks_; ++r)
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
  const CostModel* costs_;
  std::vector<std::vector<ActionTiming>>* timing_;
  int ranks_, stages_, mbs_;
  Done done_;
  std::vector<int> owner_;  // rank of each stage
  std::vector<int> compute_head_, send_head_, recv_head_;
  std::vector<double> compute_free_, send_free_, recv_free_, reduce_free_;
  std::vector<std::vector<std::pair<int, int>>> reduces_;  // per rank: (position, its input)
  std::vector<size_t> reduce_head_;
  size_t remaining_ = 0;
  std::vector<int> work_;
  std::vector<char> queued_;
};

}  // namespace

void check_progress(const Schedule& schedule) {
  StreamRun<false>(schedule, nullptr, nullptr).run();
}

SimResult simulate(const Schedule& schedule, const CostModel& costs) {
  const int R = static_cast<int>(schedule.ranks.size());
  SimResult result;
  StreamRun<true>(schedule, &costs, &result.timing).run();

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
