#pragma once
// Internal to the simulator, not part of the library's interface: the stream run, the engine
// under simulate(), Replay and check_progress (simulator.h), which runs a schedule's lists as
// the executor runs them, with times (kTimed) or without. The class is declared here;
// stream_run_setup.cpp sets a run up and reads it out, stream_run.cpp runs its streams.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "engine/schedule/action_index.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::schedule::detail {

// A per-stage vector's entry for `stage` (CostModel): size 1 applies to every stage. Read by
// CostModel::cost and by the run's memory count.
inline double per_stage(const std::vector<double>& v, int stage, double fallback = 0.0) {
  if (v.empty()) return fallback;
  if (v.size() == 1) return v[0];
  return stage < static_cast<int>(v.size()) ? v[stage] : fallback;
}

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
            std::vector<ReplayStep>* trace = nullptr);

  // Fills each rank's busy, reduce and end (a timed run that has finished), and its memory
  // when the run counted it. Whether it did.
  bool summarize(std::vector<RankStats>* ranks) const;

  void run();

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

  int reduce_position(int r) const {
    const Streams& q = streams_[r];
    return q.reduce < q.reduce_end ? reduces_[q.reduce].first : q.size;
  }

  void wake(int r) {
    if (r < 0 || r >= ranks_ || queued_[r]) return;
    queued_[r] = 1;
    work_.push_back(r);
  }

  // stream_run_setup.cpp: setting the run up, and reading it out.
  static bool cost_is_per_kind(const CostModel& c, ActionKind kind);
  void prepare(int r, bool checked);
  void find_reduces(int r);
  DeadlockError deadlock();
  std::string send_waits_for(int r, int h) const;

  // stream_run.cpp: the streams at work. Declared inline, as members defined in the class
  // are: they are the run's inner loop, and the compiler inlines into run() more readily what
  // is declared so.
  inline void count_activations(Streams& q, const Action& a, int i) const;
  inline bool inputs_ready(int r, const Action& a, size_t c, double* ready) const;
  inline void visit(int r);
  inline bool run_computes(int r);
  inline bool run_sends(int r);
  inline void run_reduces(int r);

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

}  // namespace conveyor::schedule::detail
