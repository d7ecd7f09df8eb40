#include "engine/schedule/simulator.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "engine/schedule/action_index.h"
#include "engine/schedule/checked_progress.h"

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

double reduce_bucket_cost(double whole, double latency, int buckets) {
  return buckets > 1 ? latency + (whole - latency) / buckets : whole;
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

// What other actions wait on, by (stage, micro-batch) cell: whether the forward, the backward
// that produces the input gradient (B or I), and the received activation and gradient are done
// and, in a timed run, when they ended. Tables by cell rather than by list position: a
// dependency is then found without an index lookup. The four entries of a cell lie together,
// since an action reads and marks mostly its own cell; an untimed run keeps one byte per cell,
// so the whole state of a large run stays in cache.
template <bool kTimed>
class Completions {
 public:
  enum Kind { kForwardDone, kGradientDone, kActivationIn, kGradientIn, kKinds };

  Completions(int stages, int microbatches) {
    const size_t cells = table_cells(stages, microbatches);
    if constexpr (kTimed)
      end_.assign(kKinds * cells, kNotDone);
    else
      done_.assign(cells, 0);
  }

  bool done(size_t cell, Kind kind) const {
    if constexpr (kTimed) return end_[cell * kKinds + kind] != kNotDone;
    return (done_[cell] >> kind) & 1;
  }
  double end(size_t cell, Kind kind) const {
    if constexpr (kTimed) return end_[cell * kKinds + kind];
    return 0.0;
  }
  // Asks for the cache line of `cell` ahead of use (no effect beyond the table).
  void prefetch(size_t cell) const {
    if constexpr (kTimed) {
      if (cell * kKinds < end_.size()) __builtin_prefetch(&end_[cell * kKinds], 1);
    } else if (cell < done_.size()) {
      __builtin_prefetch(&done_[cell], 1);
    }
  }
  void mark(size_t cell, Kind kind, double end, int by = -1) {
    if constexpr (kTimed) {
      end_[cell * kKinds + kind] = end;
      if (!by_.empty()) by_[cell * kKinds + kind] = by;
    } else {
      done_[cell] |= uint8_t{1} << kind;
    }
  }
  // Which action (flat index) marked the entry; kept only after trace_markers().
  void trace_markers() { by_.assign(end_.size(), -1); }
  int by(size_t cell, Kind kind) const { return by_[cell * kKinds + kind]; }

 private:
  static constexpr double kNotDone = -1.0;
  std::vector<double> end_;
  std::vector<uint8_t> done_;
  std::vector<int> by_;
};

// Whether receive `recv` takes the message of send `send`: message_key(recv) ==
// message_key(send), spelled out for the one pairing the run asks about millions of times.
// SEND_ACT(s) goes to RECV_ACT(s+1), SEND_GRAD(s) to RECV_GRAD(s-1).
bool takes(const Action& recv, const Action& send) {
  const bool act = send.kind == ActionKind::kSendAct;
  return recv.kind == (act ? ActionKind::kRecvAct : ActionKind::kRecvGrad) &&
         recv.stage == send.stage + (act ? 1 : -1) && recv.microbatch == send.microbatch;
}

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
  // `checked`: the schedule has passed the structural checks of validate().
  StreamRun(const Schedule& s, const CostModel* costs,
            std::vector<std::vector<ActionTiming>>* timing, bool checked = false,
            std::vector<ReplayStep>* trace = nullptr)
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

  // Fills each rank's busy, reduce and end (a timed run that has finished), and its memory
  // when the run counted it. Whether it did.
  bool summarize(std::vector<RankStats>* ranks) const {
    for (int r = 0; r < ranks_; ++r) {
      const Streams& q = streams_[r];
      (*ranks)[r].busy = q.busy, (*ranks)[r].reduce = q.reduce_time, (*ranks)[r].end = q.end;
      if (q.last_use) (*ranks)[r].memory = q.memory.peak;
    }
    return !last_use_.empty();
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
  static constexpr int kActionKinds = static_cast<int>(ActionKind::kAllReduceGrad) + 1;

  // in_flight_per_rank's count of one rank, kept by the compute stream, which runs the
  // rank's computes in list order as that count does, with the same additions in the same
  // order.
  struct ActivationCount {
    int in_flight = 0, held = 0;
    double in_flight_bytes = 0, held_bytes = 0;
    InFlight peak;
  };

  // One rank's streams. Each head is the position of the stream's next action, kept on an
  // action of the stream (or at the list's end, when the stream is done), so a stream that
  // waits is asked about its head without a search.
  struct Streams {
    const Action* actions = nullptr;
    int size = 0;
    int compute = 0, send = 0, recv = 0;
    int reduce = 0, reduce_end = 0;  // the rank's all-reduces: reduces_[reduce, reduce_end)
    ActionTiming* timing = nullptr;
    double compute_free = 0, send_free = 0, recv_free = 0, reduce_free = 0;
    // The rank's summary, kept as it runs: the computes' and all-reduces' time, summed in
    // list order since each stream runs in list order, and the end of its last action.
    double busy = 0, reduce_time = 0, end = 0;
    // Position of the last use of each (chunk, micro-batch) of the rank's activations
    // (null: memory not counted in the run), and the count so far.
    int* last_use = nullptr;
    ActivationCount memory;
  };

  // The first position from i on whose action belongs to the stream `in`, or the list's end.
  template <class Pred>
  static int seek(const Streams& q, int i, Pred in) {
    while (i < q.size && !in(q.actions[i].kind)) ++i;
    return i;
  }

  // A large run is bound by memory: a rank's visits are far apart, so each would find the
  // next part of its list, its timings and its cells out of cache. Whenever a head moves on,
  // the cell its next action reads or marks is asked for, and a few cache lines of the list
  // and timings ahead of the compute head (the other heads run near it).
  static constexpr int kAhead = 16;  // actions: four cache lines of the list
  void prefetch_for(const Streams& q, int head) const {
    if (head < q.size) done_.prefetch(cell(q.actions[head]));
  }
  void prefetch_ahead(const Streams& q) const {
    prefetch_for(q, q.compute);
    if (q.compute + kAhead < q.size) {
      __builtin_prefetch(&q.actions[q.compute + kAhead]);
      if constexpr (kTimed) __builtin_prefetch(&q.timing[q.compute + kAhead], 1);
    }
  }

  size_t cell(const Action& a) const { return static_cast<size_t>(a.stage) * mbs_ + a.microbatch; }

  // Whether CostModel::cost(a) is the same for every stage of a's kind (no per-stage vector
  // it reads has more than one entry): then it is asked once per kind, not once per action.
  static bool cost_is_per_kind(const CostModel& c, ActionKind kind) {
    auto one = [](const std::vector<double>& v) { return v.size() <= 1; };
    switch (kind) {
      case ActionKind::kForward:
        return one(c.forward);
      case ActionKind::kBackward:
        return c.backward.empty() ? one(c.backward_input) && one(c.backward_weight)
                                  : one(c.backward);
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
  double cost(const Action& a) const {
    const auto& per_kind = kind_cost_[static_cast<int>(a.kind)];
    return per_kind ? *per_kind : costs_->cost(a);
  }
  // One bucket of k of a stage's all-reduce: the latency, and its k-th of the bytes.
  double reduce_cost(const Action& a) const {
    const double whole = cost(a), latency = costs_->reduce_latency;
    const int k = a.stage < static_cast<int>(reduce_buckets_.size()) ? reduce_buckets_[a.stage] : 1;
    return reduce_bucket_cost(whole, latency, k);
  }

  // Schedules that did not pass validate() may name stages, micro-batches or peers that do
  // not exist; they get an error, not an out-of-range read. Checked once, before the run, so
  // that the run itself reads each action only to move it. Also lists the rank's all-reduces.
  // A checked schedule skips the pass: it has all-reduces only with replicas > 1.
  void prepare(int r, bool checked) {
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
  // The fields' ranges, with one comparison per field: a negative value is a large unsigned
  // one.
  struct Bounds {
    unsigned stages, mbs, ranks;
    Bounds(int s, int m, int r)
        : stages(std::max(s, 0)), mbs(std::max(m, 0)), ranks(std::max(r, 0)) {}
    // An all-reduce's micro-batch is its bucket, kept in order by the validator.
    bool hold(const Action& a) const {
      return (static_cast<unsigned>(a.stage) < stages) &
             (is_reduce(a.kind) | (static_cast<unsigned>(a.microbatch) < mbs)) &
             (!is_transfer(a.kind) | (static_cast<unsigned>(a.peer) < ranks));
    }
  };

  // Counts compute `a` at position i of rank q's list.
  void count_activations(Streams& q, const Action& a, int i) const {
    const double b = activation_bytes_[a.stage];
    ActivationCount& m = q.memory;
    if (a.kind == ActionKind::kForward) {
      ++m.in_flight, ++m.held, m.in_flight_bytes += b, m.held_bytes += b;
      m.peak.peak_in_flight = std::max(m.peak.peak_in_flight, m.in_flight);
      m.peak.peak_held = std::max(m.peak.peak_held, m.held);
      m.peak.peak_in_flight_bytes = std::max(m.peak.peak_in_flight_bytes, m.in_flight_bytes);
      m.peak.peak_held_bytes = std::max(m.peak.peak_held_bytes, m.held_bytes);
      return;
    }
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput)
      --m.in_flight, m.in_flight_bytes -= b;
    if (q.last_use[static_cast<size_t>(chunk_[a.stage]) * mbs_ + a.microbatch] == i)
      --m.held, m.held_bytes -= b;
  }

  // The rank's all-reduces in list order, each with the position of the last weight-gradient
  // action of its stage before it (-1: none), the compute it waits for.
  void find_reduces(int r) {
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

  int reduce_position(int r) const {
    const Streams& q = streams_[r];
    return q.reduce < q.reduce_end ? reduces_[q.reduce].first : q.size;
  }

  // Whether the inputs of compute `a` (in cell c) on rank r are there, and when the last one
  // ended. The neighbour stages' cells are a row of mbs_ cells away.
  bool inputs_ready(int r, const Action& a, size_t c, double* ready) const {
    const int st = a.stage;
    auto need = [&](typename Done::Kind kind, size_t at) {
      if (!done_.done(at, kind)) return false;
      if constexpr (kTimed) {
        *ready = std::max(*ready, done_.end(at, kind));
        if (trace_) inputs_[inputs_[2]++] = done_.by(at, kind);
      }
      return true;
    };
    switch (a.kind) {
      case ActionKind::kForward:
        if (st == 0) return true;
        return owner_[st - 1] == r ? need(Done::kForwardDone, c - mbs_)
                                   : need(Done::kActivationIn, c);
      case ActionKind::kBackwardWeight:
        return need(Done::kGradientDone, c);
      default:  // B or I: the forward's activations and the output gradient
        if (!need(Done::kForwardDone, c)) return false;
        if (st + 1 == stages_) return true;
        return owner_[st + 1] == r ? need(Done::kGradientDone, c + mbs_)
                                   : need(Done::kGradientIn, c);
    }
  }

  void wake(int r) {
    if (r < 0 || r >= ranks_ || queued_[r]) return;
    queued_[r] = 1;
    work_.push_back(r);
  }

  // Runs rank r's streams until none can move. A compute can only be unblocked by a transfer
  // into its own cell and a send only by a compute (or by its receiver, which wakes this
  // rank), and the reduction stream waits only for computes: after the first round, a stream
  // is tried again only when the other one has moved in a way that may unblock it.
  void visit(int r) {
    for (bool first = true;; first = false) {
      const bool computed = run_computes(r);
      if (!computed && !first) break;
      const bool unblocked = run_sends(r);
      run_reduces(r);
      if (!unblocked) break;
    }
  }

  // Compute stream: runs computes while their inputs are there. Whether any ran.
  bool run_computes(int r) {
    Streams& q = streams_[r];
    bool moved = false;
    while (q.compute < q.size) {
      const Action& a = q.actions[q.compute];
      const size_t c = cell(a);
      double ready = 0;
      if constexpr (kTimed) ready = q.compute_free;
      inputs_ = {-1, -1, 0};
      if (!inputs_ready(r, a, c, &ready)) break;
      double end = 0;
      if constexpr (kTimed) {
        if (trace_) {
          int& prev = last_[4 * r];
          const int at = first_[r] + q.compute;
          trace_->push_back({at,
                             -1,
                             {prev, inputs_[0], inputs_[1]},
                             r,
                             -1,
                             a.kind,
                             a.stage,
                             ReplayStep::kCompute});
          prev = at;
        }
        end = ready + cost(a);
        q.timing[q.compute] = {ready, end};
        q.compute_free = end;
        q.busy += end - ready;
        q.end = std::max(q.end, end);
        if (q.last_use) count_activations(q, a, q.compute);
      }
      const int by = trace_ ? first_[r] + q.compute : -1;
      if (a.kind == ActionKind::kForward)
        done_.mark(c, Done::kForwardDone, end, by);
      else if (a.kind != ActionKind::kBackwardWeight)
        done_.mark(c, Done::kGradientDone, end, by);
      q.compute = seek(q, q.compute + 1, is_compute);
      prefetch_ahead(q);
      --remaining_, moved = true;
    }
    return moved;
  }

  // Send stream, in rendezvous with the receivers' receive streams. Whether a transfer brought
  // the input the compute head waits for.
  bool run_sends(int r) {
    Streams& q = streams_[r];
    // The one cell whose marks can unblock the compute head: its received input's.
    const size_t waits_on = q.compute < q.size ? cell(q.actions[q.compute]) : SIZE_MAX;
    bool unblocked = false;
    while (q.send < q.size) {
      const Action& a = q.actions[q.send];
      const size_t c = cell(a);
      const bool act = a.kind == ActionKind::kSendAct;
      const auto produced = act ? Done::kForwardDone : Done::kGradientDone;
      if (!done_.done(c, produced)) break;
      const int dst = a.peer;
      Streams& d = streams_[dst];
      if (d.recv >= d.size) break;
      const Action& b = d.actions[d.recv];
      if (!takes(b, a)) break;
      double end = 0;
      const int at_recv = trace_ ? first_[dst] + d.recv : -1;
      if constexpr (kTimed) {
        if (trace_) {
          int &sent = last_[4 * r + 1], &received = last_[4 * dst + 2];
          const int at = first_[r] + q.send;
          trace_->push_back({at,
                             at_recv,
                             {done_.by(c, produced), sent, received},
                             r,
                             dst,
                             a.kind,
                             a.stage,
                             ReplayStep::kTransfer});
          sent = at, received = at_recv;
        }
        const double start = std::max({done_.end(c, produced), q.send_free, d.recv_free});
        end = start + cost(a);
        q.timing[q.send] = d.timing[d.recv] = {start, end};
        q.send_free = d.recv_free = end;
        q.end = std::max(q.end, end);
        d.end = std::max(d.end, end);
      }
      const size_t marked = cell(b);
      done_.mark(marked, act ? Done::kActivationIn : Done::kGradientIn, end, at_recv);
      unblocked |= marked == waits_on;
      q.send = seek(q, q.send + 1, is_send);
      d.recv = seek(d, d.recv + 1, is_recv);
      prefetch_for(d, d.recv);
      remaining_ -= 2;
      // The receiver's computes may now run, and the sender of its next receive may be
      // waiting for that receive to reach the head.
      if (dst != r) wake(dst);
      if (d.recv < d.size) {
        const Action& next = d.actions[d.recv];
        const int sender = next.peer;
        if (sender >= 0 && sender < ranks_ && sender != r) {
          const Streams& w = streams_[sender];
          if (w.send < w.size && takes(next, w.actions[w.send])) wake(sender);
        }
      }
    }
    return unblocked;
  }

  // Reduction stream: an all-reduce waits only for its stage's weight gradients here, and for
  // the same point in every other replica, which runs the same list.
  void run_reduces(int r) {
    Streams& q = streams_[r];
    for (; q.reduce < q.reduce_end; ++q.reduce) {
      const auto [i, dep] = reduces_[q.reduce];
      if (dep >= 0 && q.compute <= dep) break;
      if constexpr (kTimed) {
        if (trace_) {
          int& prev = last_[4 * r + 3];
          const int at = first_[r] + i;
          trace_->push_back({at,
                             -1,
                             {prev, dep >= 0 ? first_[r] + dep : -1, -1},
                             r,
                             -1,
                             q.actions[i].kind,
                             q.actions[i].stage,
                             ReplayStep::kReduce});
          prev = at;
        }
        const double start = std::max(q.reduce_free, dep >= 0 ? q.timing[dep].end : 0.0);
        q.timing[i] = {start, start + reduce_cost(q.actions[i])};
        q.reduce_free = q.timing[i].end;
        q.reduce_time += q.timing[i].end - q.timing[i].start;
        q.end = std::max(q.end, q.timing[i].end);
      }
      --remaining_;
    }
  }

  DeadlockError deadlock() {
    std::vector<StuckAction> stuck;
    std::string msg = "deadlock: the run cannot finish;";
    for (int r = 0; r < ranks_; ++r) {
      const Streams& q = streams_[r];
      for (int h : {q.compute, q.send, q.recv, reduce_position(r)}) {
        if (h >= q.size) continue;
        const Action& a = q.actions[h];
        std::string why =
            is_compute(a.kind)  ? "waits for its input"
            : is_reduce(a.kind) ? "waits for the weight gradients of its stage"
            : is_send(a.kind)
                ? "waits for rank " + std::to_string(a.peer) + " to post the matching receive"
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

  const Schedule& s_;
  // When set, each action run is appended with the actions whose ends it waited on (flat
  // indices: first_[rank] + position), and last_ holds each rank's last compute, send,
  // receive and all-reduce; inputs_ collects a compute's inputs (two at most, and a count).
  std::vector<ReplayStep>* trace_;
  std::vector<int> first_, last_;
  mutable std::array<int, 3> inputs_{-1, -1, 0};
  const CostModel* costs_;
  int ranks_, stages_, mbs_;
  Done done_;
  std::vector<int> owner_;  // rank of each stage
  // For the memory count: each stage's chunk and bytes saved by its forward.
  std::vector<int> chunk_;
  std::vector<double> activation_bytes_;
  // Every rank's last-use table, rank after rank (empty: memory not counted in the run).
  std::vector<int> last_use_;
  std::vector<Streams> streams_;
  std::vector<std::pair<int, int>> reduces_;  // every rank's: (position, its input), by rank
  std::vector<int> reduce_buckets_;  // ALLREDUCE_GRADs per stage, on its rank (found there)
  std::array<std::optional<double>, kActionKinds> kind_cost_;
  size_t remaining_ = 0;
  std::vector<int> work_;
  std::vector<char> queued_;
};

}  // namespace

void check_progress(const Schedule& schedule) {
  StreamRun<false>(schedule, nullptr, nullptr).run();
}

void detail::check_progress_of_checked(const Schedule& schedule) {
  StreamRun<false>(schedule, nullptr, nullptr, /*checked=*/true).run();
}

namespace {

// Each rank's idle time and the bubble, from the makespan and the ranks' busy times: what
// simulate() and Replay report alike.
void set_idle_and_bubble(SimResult& result) {
  double total_idle = 0;
  for (auto& st : result.ranks) st.idle = result.makespan - st.busy, total_idle += st.idle;
  // idle / (R * makespan) rather than 1 - busy / (...): one rounding, so integer costs give
  // the correctly rounded closed form.
  const double ranks = static_cast<double>(result.ranks.size());
  result.bubble_fraction = result.makespan > 0 ? total_idle / (ranks * result.makespan) : 0.0;
}

// Every time and size of the model a finite number >= 0: a NaN would pass through max()
// unseen and a negative cost would run time backwards.
void check_costs(const CostModel& c) {
  auto check = [](const char* name, double v, size_t index, bool vector) {
    if (std::isfinite(v) && v >= 0) return;
    char value[32];
    std::snprintf(value, sizeof value, "%g", v);
    throw ScheduleError(std::string("cost model: ") + name +
                        (vector ? "[" + std::to_string(index) + "]" : std::string()) + " is " +
                        value + "; costs, sizes and bandwidths must be finite and >= 0");
  };
  const std::pair<const char*, const std::vector<double>*> vectors[] = {
      {"forward", &c.forward},
      {"backward_input", &c.backward_input},
      {"backward_weight", &c.backward_weight},
      {"backward", &c.backward},
      {"message_bytes", &c.message_bytes},
      {"activation_bytes", &c.activation_bytes},
      {"gradient_bytes", &c.gradient_bytes}};
  for (const auto& [name, values] : vectors)
    for (size_t i = 0; i < values->size(); ++i) check(name, (*values)[i], i, true);
  check("latency", c.latency, 0, false);
  check("bandwidth", c.bandwidth, 0, false);
  check("reduce_latency", c.reduce_latency, 0, false);
  check("reduce_bandwidth", c.reduce_bandwidth, 0, false);
}

}  // namespace

SimResult simulate(const Schedule& schedule, const CostModel& costs) {
  check_costs(costs);
  const int R = static_cast<int>(schedule.ranks.size());
  SimResult result;
  StreamRun<true> run(schedule, &costs, &result.timing);
  run.run();

  // Summary.
  result.ranks.resize(R);
  if (!run.summarize(&result.ranks)) {
    const auto memory = in_flight_per_rank(schedule, costs.activation_bytes);
    for (int r = 0; r < R; ++r) result.ranks[r].memory = memory[r];
  }
  for (int r = 0; r < R; ++r) result.makespan = std::max(result.makespan, result.ranks[r].end);
  // Finite costs can still add up past the largest double (a huge size over a tiny bandwidth).
  if (!std::isfinite(result.makespan))
    throw ScheduleError(
        "the cost model's times overflow: the makespan is not a finite number; use smaller "
        "costs or sizes, or larger bandwidths");
  set_idle_and_bubble(result);
  return result;
}

namespace {
constexpr int kKinds = static_cast<int>(ActionKind::kAllReduceGrad) + 1;
}  // namespace

Replay::Replay(const Schedule& schedule)
    : ranks_(static_cast<int>(schedule.ranks.size())), stages_(schedule.num_stages()) {
  first_.assign(ranks_ + 1, 0);
  for (int r = 0; r < ranks_; ++r)
    first_[r + 1] = first_[r] + static_cast<int>(schedule.ranks[r].size());
  std::vector<std::vector<ActionTiming>> timing;
  const CostModel unit;
  StreamRun<true> recorded(schedule, &unit, &timing, /*checked=*/false, &steps_);
  recorded.run();
  buckets_.assign(std::max(stages_, 0), 0);
  for (const auto& list : schedule.ranks)
    for (const Action& a : list)
      if (is_reduce(a.kind)) ++buckets_[a.stage];
  // The (kind, stage) pairs the steps cost, each once.
  std::vector<int> slot_of(static_cast<size_t>(kKinds) * std::max(stages_, 0), -1);
  for (ReplayStep& s : steps_) {
    int& slot = slot_of[static_cast<size_t>(s.kind) * stages_ + s.stage];
    if (slot < 0)
      slot = static_cast<int>(slots_.size()), slots_.push_back({s.kind, s.stage, 0, -1});
    s.stage = slot;
  }
  per_slot_.assign(slots_.size(), 0.0);
  timing_.assign(first_[ranks_], {0, 0});
  step_of_.assign(first_[ranks_], -1);
  for (size_t i = 0; i < steps_.size(); ++i) {
    step_of_[steps_[i].action] = static_cast<int>(i);
    if (steps_[i].received >= 0) step_of_[steps_[i].received] = static_cast<int>(i);
  }
  busy_.assign(ranks_, 0), reduce_.assign(ranks_, 0), end_.assign(ranks_, 0);
}

double Replay::run(const CostModel& costs) {
  // CostModel::cost reads only the kind and the stage.
  for (size_t k = 0; k < slots_.size(); ++k) {
    const Action& a = slots_[k];
    per_slot_[k] = a.kind == ActionKind::kAllReduceGrad
                       ? reduce_bucket_cost(costs.cost(a), costs.reduce_latency,
                                            std::max(buckets_[a.stage], 1))
                       : costs.cost(a);
  }
  std::fill(busy_.begin(), busy_.end(), 0.0);
  std::fill(reduce_.begin(), reduce_.end(), 0.0);
  std::fill(end_.begin(), end_.end(), 0.0);
  ActionTiming* const t = timing_.data();
  for (const ReplayStep& s : steps_) {
    double start = 0;
    for (int d : s.after)
      if (d >= 0) start = std::max(start, t[d].end);
    const double end = start + per_slot_[s.stage];
    t[s.action] = {start, end};
    end_[s.rank] = std::max(end_[s.rank], end);
    if (s.type == ReplayStep::kCompute) {
      busy_[s.rank] += end - start;
    } else if (s.type == ReplayStep::kReduce) {
      reduce_[s.rank] += end - start;
    } else {
      t[s.received] = {start, end};
      end_[s.receiver] = std::max(end_[s.receiver], end);
    }
  }
  makespan_ = 0;
  for (int r = 0; r < ranks_; ++r) makespan_ = std::max(makespan_, end_[r]);
  return makespan_;
}

std::vector<Action> Replay::critical_path() const {
  std::vector<Action> path;
  // The steps that end last are recorded last: search from the end.
  int at = -1;
  for (size_t i = steps_.size(); i-- > 0 && at < 0;)
    if (timing_[steps_[i].action].end == makespan_) at = static_cast<int>(i);
  while (at >= 0) {
    const ReplayStep& s = steps_[at];
    path.push_back(slots_[s.stage]);
    // start = max(0, the ends of what the step waited for): the dependency that set it.
    const double start = timing_[s.action].start;
    int before = -1;
    for (int d : s.after)
      if (d >= 0 && timing_[d].end == start) before = d;
    at = start > 0 && before >= 0 ? step_of_[before] : -1;
  }
  std::reverse(path.begin(), path.end());
  return path;
}

SimResult Replay::result() const {
  SimResult out;
  out.timing.resize(ranks_);
  out.ranks.resize(ranks_);
  for (int r = 0; r < ranks_; ++r) {
    out.timing[r].assign(timing_.begin() + first_[r], timing_.begin() + first_[r + 1]);
    out.ranks[r].busy = busy_[r], out.ranks[r].reduce = reduce_[r], out.ranks[r].end = end_[r];
  }
  out.makespan = makespan_;
  set_idle_and_bubble(out);
  return out;
}

}  // namespace conveyor::schedule
