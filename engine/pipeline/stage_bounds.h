#pragma once
// Lower bounds on the simulated step time of a partition from the stages each rank holds,
// read off the schedule's lists once and evaluated on unit sums: one rank's own stages
// (OwnStageBound), and, by dynamic programming over the cuts, every rank of a V-shaped
// (PairedStageBound) or looped (LoopedPairBound) placement of two stages a rank. The
// partition search (partition_search.h) prunes with them.
#include <cstdint>
#include <utility>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/pipeline/partition_sums.h"
#include "engine/schedule/schedule.h"

namespace conveyor::planning {

// A lower bound on the simulated step time from one rank's own stages alone: every action of
// a rank is of one of its stages, so where each of them begins and ends fixes, from the unit
// sums, when the rank's actions can start and what the gradient still has to cross after its
// last one. For each own stage, the first forward and the first gradient step (I, or B where
// the stage does not split) open a line: the action starts no earlier than the chain of its
// micro-batch before it (the forwards of every stage below; for a gradient step, every forward
// and the gradient steps of every stage above), then the rank runs the rest of its list one
// action at a time, and after its last gradient step that gradient still crosses the stages
// below (their I, and W too where none of them splits) while the rank runs what follows it.
// Transfers are left out: they only add time.
class OwnStageBound {
 public:
  OwnStageBound(const schedule::Schedule& schedule, const Sums& sums);
  struct Terms {
    double bound;  // rank()
    // The gradient step (I, or B) of the last micro-batch on the own stage asked for: the
    // earliest it can end (each line of the rank opened at or before it, up to it), and the
    // least time from its start to the end of the step (the rank's actions from it on, and
    // the gradient's way below after the last of them). -inf, which bounds nothing, where
    // the rank has no such step.
    double relay_end, relay_rest;
  };
  // Rank r's bound when its stages (placement.stages_of(r), in that order) hold `own`.
  double rank(int r, const StageRange* own) const { return terms(r, own, -1).bound; }
  // The same, with the relay terms of its own stage `relay_own` (an index into stages_of(r);
  // -1: none). The last micro-batch's gradient reaches a stage only after the gradient step
  // of every stage above it, so the relay end of one stage, plus the input gradients of the
  // stages between, plus the relay rest of a stage below it on another rank bounds the step
  // time too: a wait across ranks that no rank's own bound sees.
  Terms terms(int r, const StageRange* own, int relay_own) const;
  // Rank r's compute when its stages hold `own`: it runs one action at a time, so the step
  // takes no less. Grows with each own stage's units.
  double busy(int r, const StageRange* own) const;
  const Sums& sums() const { return sums_; }

 private:
  struct Line {
    int own_index;                // the stage whose action opens it, as an index into stages_of(r)
    int at;                       // the action's index in the rank's list
    bool gradient;                // a gradient step (else a forward)
    bool with_tail;               // at or before the rank's last gradient step
    std::vector<double> f, i, w;  // per own stage: F, I and W costs from the action on
  };
  struct Relay {
    int at = -1;  // index in the rank's list of the stage's gradient step of the last micro-batch
    std::vector<double> from_f, from_i, from_w;     // per own stage: counts from it on
    std::vector<double> after_f, after_i, after_w;  // per own stage: counts after it
  };
  struct Rank {
    std::vector<int> stages;
    std::vector<Line> lines;
    std::vector<double> after_f, after_i, after_w;  // per own stage: after the last gradient
    int last_own = -1;          // own index of the last gradient step's stage (-1: none)
    std::vector<Relay> relays;  // per own stage
    std::vector<double> total_f, total_i, total_w;  // per own stage: all its actions
  };
  const Sums& sums_;
  int64_t n_;
  std::vector<Rank> ranks_;
  std::vector<bool> split_below_, split_above_;  // per stage: some stage below (above) splits
};

// For a V-shaped placement of two stages a rank (rank r holds stages r and 2p-1-r, nested):
// inner(r, a, b), the least over every cut of the units [a, b) into the stages r .. 2p-1-r of
// the largest OwnStageBound of the ranks r .. p-1, by dynamic programming from the middle
// pair outwards (the memory cap is left out, which only lowers it). inner(0, 0, n) bounds
// every partition's step time; with the ranks before r placed, inner(r, c_r, c_{2p-r}) bounds
// every completion.
class PairedStageBound {
 public:
  PairedStageBound(const schedule::Schedule& schedule, const Sums& sums);
  static bool applies(const schedule::Placement& placement) {
    return placement.layout == schedule::Layout::kVShape && placement.chunks == 2;
  }
  double inner(int r, int64_t a, int64_t b) const {
    return table_[(static_cast<size_t>(r) * (n_ + 1) + a) * (n_ + 1) + b];
  }
  // relay(r, a, b): the least over the same cuts of the latest time after the last
  // micro-batch's gradient enters the stage 2p-1-r (at unit b) that the ranks r .. p-1 can
  // end: OwnStageBound's relay rest of each of them, after the input gradients of the
  // returning stages above its own (-inf for no rank).
  double relay(int r, int64_t a, int64_t b) const {
    return relay_[(static_cast<size_t>(r) * (n_ + 1) + a) * (n_ + 1) + b];
  }
  // With the stages [0, k) placed and ending at unit a (k <= p): the least inner(k, a, b) over
  // every b, a bound on the ranks k .. p-1 whatever the later cuts.
  double after_prefix(int k, int64_t a) const {
    return prefix_[static_cast<size_t>(k) * (n_ + 1) + a];
  }
  const OwnStageBound& own() const { return own_; }
  // What the search that places the pairs from the outside in knows of the ranks placed:
  // the largest of their bounds, and the earliest start of the last micro-batch's gradient
  // step on the returning stage of the next rank (-inf before rank 0).
  struct Outer {
    double placed = 0;
    double arrival = -kInf;
  };
  // Rank r's stages r and 2p-1-r at [a, a2) and [b2, b), after the ranks before it (`outer`):
  // a lower bound on every partition that completes them (the ranks placed, the relays
  // between them, and inner(r+1, a2, b2) and relay(r+1, a2, b2) for the ranks inside), and
  // what the next rank's choices start from.
  struct Placed {
    double bound;
    Outer next;
  };
  Placed place(int r, const Outer& outer, int64_t a, int64_t a2, int64_t b2, int64_t b) const;
  // A partition that attains inner(0, 0, n): a good first incumbent, as the bound is close.
  std::vector<StageRange> least_partition() const;

 private:
  OwnStageBound own_;
  int64_t n_;
  int ranks_;
  std::vector<double> table_;                        // [r][a][b]
  std::vector<double> relay_;                        // [r][a][b]
  std::vector<double> prefix_;                       // [k][a]: after_prefix
  std::vector<std::pair<int64_t, int64_t>> choice_;  // [r][a][b]: the inner cuts (a2, b2)
};

// For a looped placement of two stages a rank (rank r holds stages r and p+r), for each middle
// cut m = c_p: inner(m, r, a, b), the least over every cut of the units [a, m) into the stages
// r .. p-1 and of [b, n) into the stages p+r .. 2p-1 of the largest OwnStageBound (or busy
// time) of the ranks r .. p-1, by dynamic programming over the pairs of cuts (c_{r+1},
// c_{p+r+1}), which advance together, from the last rank back; the memory cap is left out,
// which only lowers it. With the ranks before r placed, inner(m, r, c_r, c_{p+r}) bounds every
// completion, and the least of inner(m, 0, 0, m) over m every partition. Values are taken
// under a cap: one at the cap says only that the least is no lower, which is all a search
// under that ceiling needs, and keeps most choices out of the DP.
class LoopedPairBound {
 public:
  LoopedPairBound(const schedule::Schedule& schedule, const Sums& sums);
  static bool applies(const schedule::Placement& placement) {
    return placement.layout == schedule::Layout::kLooped && placement.chunks == 2;
  }
  // Fills the tables of every middle cut under `cap` (kInf: exact), unless they were filled
  // under a cap at least as high.
  void prepare(double cap);
  // inner(m, 0, 0, m): no partition with the middle cut m is faster (kInf: no partition has
  // it).
  double middle(int64_t m) const { return middle_[m]; }
  // A middle cut whose bound reached the cap keeps no table: every value under it reads that.
  double inner(int64_t m, int r, int64_t a, int64_t b) const {
    return tables_[m].empty() ? middle_[m]
                              : tables_[m][(static_cast<size_t>(r) * (n_ + 1) + a) * (n_ + 1) + b];
  }
  // With the stages [0, k) placed, k <= p, the last ending at unit e: the least inner(m, k, e,
  // b) over every m and b, a bound on the ranks k .. p-1 whatever the later cuts (k = p: the
  // middle cut's bound).
  double after_prefix(int k, int64_t e) const {
    return prefix_[static_cast<size_t>(k) * (n_ + 1) + e];
  }
  // The least over every middle cut: a lower bound on every partition's step time.
  double least() const;
  // A partition that attains least() (empty when it is at the cap).
  std::vector<StageRange> least_partition() const;
  const OwnStageBound& own() const { return own_; }
  // Rank r's stages r and p+r at [a, a2) and [b, b2) under the middle cut m, after ranks
  // whose largest bound is `placed`: a lower bound on every partition that completes them
  // (with inner(m, r+1, a2, b2) for the ranks after r), and the largest bound of the ranks
  // up to r (`*own`).
  double place(int64_t m, int r, double placed, int64_t a, int64_t a2, int64_t b, int64_t b2,
               double* own) const;

 private:
  void fill(int64_t m);
  OwnStageBound own_;
  int64_t n_;
  int ranks_;
  double cap_ = -1;                          // of the tables filled; -1: none yet
  std::vector<double> middle_;               // per middle cut
  std::vector<std::vector<double>> tables_;  // per middle cut: [r][a][b]; empty when none
  std::vector<std::vector<std::pair<int32_t, int32_t>>> choices_;  // likewise: (a2, b2)
  std::vector<double> prefix_;                                     // [k][e]: after_prefix
};

}  // namespace conveyor::planning
