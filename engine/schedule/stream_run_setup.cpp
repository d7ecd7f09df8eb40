// Setting a stream run (stream_run.h) up and reading it out: the lists checked against the
// schedule's bounds and indexed (their all-reduces, and the last use of each activation for the
// memory count), each cost asked once per kind where it can be, and after the run each rank's
// summary, or the message of a run that cannot finish.
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/schedule/stream_run.h"

namespace conveyor::schedule::detail {

template <bool kTimed>
StreamRun<kTimed>::StreamRun(const Schedule& s, const CostModel* costs,
                             std::vector<std::vector<ActionTiming>>* timing, bool checked,
                             std::vector<ReplayStep>* trace)
    : s_(s),
      trace_(trace),
      costs_(costs),
      ranks_(static_cast<int>(s.ranks.size())),
      stages_(s.num_stages()),
      mbs_(s.num_microbatches),
      done_(stages_, mbs_) {
  owner_.resize(stages_);
  for (int st = 0; st < stages_; ++st) owner_[st] = s.placement.rank_of(st);
  if constexpr (kTimed) {
    timing->resize(ranks_);
    for (int k = 0; k < kActionKinds; ++k) {
      const Action a{static_cast<ActionKind>(k), 0, 0, -1};
      if (cost_is_per_kind(*costs, a.kind)) kind_cost_[k] = costs->cost(a);
    }
    // The memory count keys a rank's activations by (chunk, micro-batch), as
    // in_flight_per_rank does; with one list per rank of the placement that is one entry
    // per (stage, micro-batch) cell. Other schedules are counted after the run.
    if (!checked && ranks_ == s.placement.num_ranks && stages_ > 0) {
      chunk_.resize(stages_);
      activation_bytes_.resize(stages_);
      for (int st = 0; st < stages_; ++st) {
        chunk_[st] = s.placement.chunk_of(st);
        activation_bytes_[st] = per_stage(costs->activation_bytes, st);
      }
      last_use_.assign(table_cells(stages_, mbs_), -1);
    }
  }
  streams_.resize(ranks_);
  for (int r = 0; r < ranks_; ++r) {
    Streams& q = streams_[r];
    q.actions = s.ranks[r].data();
    q.size = static_cast<int>(s.ranks[r].size());
    if (!last_use_.empty())
      q.last_use = &last_use_[static_cast<size_t>(r) * s.placement.chunks * mbs_];
    prepare(r, checked);
    q.compute = seek(q, 0, is_compute);
    q.send = seek(q, 0, is_send);
    q.recv = seek(q, 0, is_recv);
  }
  queued_.assign(ranks_, 1);
  if (trace_) {
    done_.trace_markers();
    first_.assign(ranks_ + 1, 0);
    for (int r = 0; r < ranks_; ++r)
      first_[r + 1] = first_[r] + static_cast<int>(s.ranks[r].size());
    last_.assign(4 * ranks_, -1);
  }
  for (int r = 0; r < ranks_; ++r) {
    remaining_ += s.ranks[r].size();
    if constexpr (kTimed) {
      (*timing)[r].assign(s.ranks[r].size(), {kUnset, kUnset});
      streams_[r].timing = (*timing)[r].data();
    }
    work_.push_back(r);
  }
}

template <bool kTimed>
bool StreamRun<kTimed>::summarize(std::vector<RankStats>* ranks) const {
  for (int r = 0; r < ranks_; ++r) {
    const Streams& q = streams_[r];
    (*ranks)[r].busy = q.busy, (*ranks)[r].reduce = q.reduce_time, (*ranks)[r].end = q.end;
    if (q.last_use) (*ranks)[r].memory = q.memory.peak;
  }
  return !last_use_.empty();
}

// Whether CostModel::cost(a) is the same for every stage of a's kind (no per-stage vector
// it reads has more than one entry): then it is asked once per kind, not once per action.
template <bool kTimed>
bool StreamRun<kTimed>::cost_is_per_kind(const CostModel& c, ActionKind kind) {
  auto one = [](const std::vector<double>& v) { return v.size() <= 1; };
  switch (kind) {
    case ActionKind::kForward:
      return one(c.forward);
    case ActionKind::kBackward:
      return c.backward.empty() ? one(c.backward_input) && one(c.backward_weight) : one(c.backward);
    case ActionKind::kBackwardInput:
      return one(c.backward_input);
    case ActionKind::kBackwardWeight:
      return one(c.backward_weight);
    case ActionKind::kAllReduceGrad:
      return one(c.gradient_bytes);
    default:
      return one(c.message_bytes);
  }
}

// Schedules that did not pass validate() may name stages, micro-batches or peers that do
// not exist; they get an error, not an out-of-range read. Checked once, before the run, so
// that the run itself reads each action only to move it. Also lists the rank's all-reduces.
// A checked schedule skips the pass: it has all-reduces only with replicas > 1.
template <bool kTimed>
void StreamRun<kTimed>::prepare(int r, bool checked) {
  const Streams& q = streams_[r];
  streams_[r].reduce = streams_[r].reduce_end = static_cast<int>(reduces_.size());
  if (checked) {
    if (s_.replicas > 1) find_reduces(r);
    return;
  }
  // Few branches, so that the pass over every action is cheap; the first bad action is
  // only looked for when there is one. The same pass finds the last use of each
  // activation for the memory count (one pass over the lists instead of three). The bounds
  // are copied first, since the table's writes could alias the members.
  const Bounds bounds{stages_, mbs_, ranks_};
  int* const last_use = q.last_use;
  const int* const chunk = chunk_.data();
  bool all_in_range = true, reduces = false;
  for (int i = 0; i < q.size; ++i) {
    const Action& a = q.actions[i];
    const bool ok = bounds.hold(a);
    all_in_range &= ok;
    reduces |= is_reduce(a.kind);
    if (last_use && ok && is_compute(a.kind) && a.kind != ActionKind::kForward) {
      // The last use of an activation: its last B or W, or its first I when there is
      // neither (in_flight_per_rank's rule).
      int& last = last_use[static_cast<size_t>(chunk[a.stage]) * bounds.mbs + a.microbatch];
      if (a.kind != ActionKind::kBackwardInput || last < 0) last = i;
    }
  }
  for (int i = 0; !all_in_range && i < q.size; ++i)
    if (!bounds.hold(q.actions[i]))
      throw ScheduleError("rank " + std::to_string(r) + ", position " + std::to_string(i) + ", " +
                          to_string(q.actions[i]) +
                          ": stage, micro-batch or peer out of range (validate the schedule "
                          "first)");
  if (reduces) find_reduces(r);
}

// The rank's all-reduces in list order, each with the position of the last weight-gradient
// action of its stage before it (-1: none), the compute it waits for.
template <bool kTimed>
void StreamRun<kTimed>::find_reduces(int r) {
  Streams& q = streams_[r];
  std::vector<std::pair<int, int>> last_weight_grad;  // (stage, position), few stages
  for (int i = 0; i < q.size; ++i) {
    const Action& a = q.actions[i];
    if (is_weight_grad(a.kind)) {
      auto it = std::find_if(last_weight_grad.begin(), last_weight_grad.end(),
                             [&](const auto& e) { return e.first == a.stage; });
      if (it == last_weight_grad.end())
        last_weight_grad.emplace_back(a.stage, i);
      else
        it->second = i;
    } else if (is_reduce(a.kind)) {
      if (static_cast<int>(reduce_buckets_.size()) <= a.stage)
        reduce_buckets_.resize(a.stage + 1, 0);
      ++reduce_buckets_[a.stage];
      int dep = -1;
      for (const auto& [stage, at] : last_weight_grad)
        if (stage == a.stage) dep = at;
      reduces_.emplace_back(i, dep);
    }
  }
  q.reduce_end = static_cast<int>(reduces_.size());
}

// A stuck send waits for its tensor when the compute that makes it has not run, which the
// message names, since the receiver may well be at that receive already; else for the
// receiver to reach its receive.
template <bool kTimed>
std::string StreamRun<kTimed>::send_waits_for(int r, int h) const {
  const Streams& q = streams_[r];
  const Action& a = q.actions[h];
  const bool act = a.kind == ActionKind::kSendAct;
  if (done_.done(cell(a), act ? Done::kForwardDone : Done::kGradientDone))
    return "waits for rank " + std::to_string(a.peer) + " to post the matching receive";
  // The producer stands before the send and has not run: between the compute head and it.
  for (int i = q.compute; i < h; ++i) {
    const Action& p = q.actions[i];
    const bool makes =
        act ? p.kind == ActionKind::kForward
            : p.kind == ActionKind::kBackward || p.kind == ActionKind::kBackwardInput;
    if (makes && p.stage == a.stage && p.microbatch == a.microbatch)
      return "waits for its tensor from " + to_string(p) + " (position " + std::to_string(i) +
             "), which has not run";
  }
  return "waits for its tensor, which no compute before it has made";
}

template <bool kTimed>
DeadlockError StreamRun<kTimed>::deadlock() {
  std::vector<StuckAction> stuck;
  std::string msg = "deadlock: the run cannot finish;";
  for (int r = 0; r < ranks_; ++r) {
    const Streams& q = streams_[r];
    for (int h : {q.compute, q.send, q.recv, reduce_position(r)}) {
      if (h >= q.size) continue;
      const Action& a = q.actions[h];
      std::string why = is_compute(a.kind)  ? "waits for its input"
                        : is_reduce(a.kind) ? "waits for the weight gradients of its stage"
                        : is_send(a.kind)   ? send_waits_for(r, h)
                                          : "waits for rank " + std::to_string(a.peer) + " to send";
      stuck.push_back({r, h, why});
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
           to_string(s_.ranks[stuck[n].rank][stuck[n].index]) + " " + stuck[n].waiting_for +
           (n + 1 < stuck.size() && n < 5 ? ";" : "");
  return DeadlockError(msg, std::move(stuck));
}

// The members defined in stream_run.cpp are instantiated there.
template class StreamRun<false>;
template class StreamRun<true>;

}  // namespace conveyor::schedule::detail
