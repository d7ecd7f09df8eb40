#pragma once
// PartitionSearcher's state and steps (partition_search.h), shared by the files of the
// search: partition_search.cpp (bounds bookkeeping, simulations, iterative deepening),
// partition_search_stages.cpp (stage by stage) and partition_search_pairs.cpp (two stages a
// rank, a pair at a time). Internal to the search.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "engine/pipeline/partition_search.h"
#include "engine/pipeline/prefix_bounds.h"

namespace conveyor::planning {

// The search's state: the bounds prepared once per schedule, the best partition found (kept
// across searches), and one search's budget, ceiling and prefix.
//
// Branch and bound over the contiguous partitions, stage by stage: a prefix is dropped when it
// overflows the cap, or when one of its lower bounds already exceeds the best simulated step
// time or the ceiling: a rank's bound (StepBound); the least the remaining units add to the
// ranks still to come (the DP over lone stages, or water filling); the furthest-cut test of
// the later stages (completes_within); the remembered critical paths (path_bound); the
// prefix's relaxed simulation (relaxed_step). Each complete partition that survives and fits
// is simulated. Exact for the simulated step time: a dropped partition is slower than one
// already simulated, or than the ceiling. A prefix dropped for the ceiling alone, or left when
// the budget ran out, keeps its bound, and the least such bound is what the search proved of
// the partitions it did not simulate.
struct PartitionSearcher::Impl {
  // See budget_scale.
  static constexpr int64_t kBudgetActions = 4096;
  // Critical paths the search keeps to bound prefixes and partitions before simulating them.
  static constexpr size_t kPaths = 32;
  // Iterative deepening (PartitionSearcher::Impl::search): at most this many walks below the
  // best found in one search, taking at most this share of its prefixes on top of its budget;
  // the work each next walk aims at, in prefixes visited by the one before; the buckets of the
  // bounds a walk drops above its ceiling.
  static constexpr int kMaxWalks = 16;
  static constexpr int64_t kLowerShare = 4;  // a quarter
  static constexpr int64_t kGrowth = 8;
  static constexpr int kBuckets = 256;

  const Sums& sums;
  const std::vector<UnitCost>& timed;
  const PartitionMemory& memory_of;
  const schedule::Schedule& schedule;
  const double cap, transfer;
  const int64_t n;
  const int stages, ranks;
  const bool one_stage_per_rank;
  const StepBound bound;
  // Two stages a rank in a V: the search places the ranks' pairs of stages from the outside
  // in, each bounded by the pairs still open (PairedStageBound); null otherwise.
  const std::unique_ptr<PairedStageBound> paired;
  // Two stages a rank in a loop (interleaved, v = 2): likewise, under each middle cut
  // (LoopedPairBound); null otherwise.
  const std::unique_ptr<LoopedPairBound> looped;
  schedule::Replay replay;
  // The budgets count work: a simulation of a short schedule (few micro-batches) costs a
  // fraction of a long one's, so it gets as many more simulations, up to those of a schedule
  // of kBudgetActions actions; those with more keep the counts asked for.
  const int64_t budget_scale;
  // One stage per rank: whether stage k of [b, e) fits (-1: not asked yet).
  std::vector<int8_t> stage_fit;
  // One stage per rank: completion[k][e], the least largest lone-stage bound of the stages
  // [k, S) over every cut of the units [e, n) among them that fits (kInf: none fits).
  std::vector<std::vector<double>> completion;

  Searched out;
  double best_bottleneck = kInf;

  // One search. Its simulations count those start_from ran since the last search.
  SearchBudget budget;
  int64_t visit_limit = 0;  // of this walk
  int64_t simulated_here = 0, relaxed_here = 0, visits_here = 0, actions_here = 0;
  double ceiling = kInf;
  bool exhausted = false;
  double least_open = kInf;  // the least bound of a prefix left for the ceiling or the budget
  std::vector<double> f, i, w, state;
  std::vector<StageRange> ranges;
  std::vector<double> rank_base, rank_slack;  // completes_within's, per rank
  std::vector<double> rank_compute;           // may_win_tie's, per rank
  std::vector<std::vector<int>> ranks_after;  // [k]: the ranks holding a stage after k
  std::vector<double> levels;                 // remaining's, per rank of ranks_after
  int known = 0;                              // stages of `ranges` placed
  // Critical paths of the partitions simulated last, distinct, at most kPaths of them.
  std::vector<CostPath> paths;
  int64_t path_clock = 0;   // counts drops by a path and paths remembered
  int64_t path_serial = 0;  // counts paths remembered
  // least_f[lo * (n + 1) + hi]: the least F of the units [lo, hi]; likewise I and W.
  std::vector<double> least_f, least_i, least_w;
  std::vector<double> node_f, node_i, node_w;  // path_bound's least costs of later stages

  Impl(const Sums& sums, const std::vector<UnitCost>& timed, const PartitionMemory& memory_of,
       const schedule::Schedule& schedule, double cap, double transfer);

  // Whether stage k of units [b, e) fits, remembered: the search asks again for every prefix.
  bool stage_fits(int k, int64_t b, int64_t e);

  bool fits_cap(const std::vector<StageRange>& partition) const {
    const auto memory = memory_of(partition);
    return fits(*std::max_element(memory.begin(), memory.end()), cap);
  }

  // Dynamic programming from the last stage: each rank's lone-stage bound depends on its own
  // stage's units alone.
  void fill_completion();

  void fill_least_units();

  // Keeps the critical path of the last run when it is new, in place of the one that has
  // gone longest without dropping a prefix.
  void remember_path();

  // A path that dropped a prefix is kept longer.
  void touch(CostPath* path) {
    if (path) path->used = ++path_clock;
  }

  // Two lower bounds on the step time of every completion of the stages [0, known), which
  // end at unit `end`, from the remembered paths: `growing`, each path's length with every
  // later stage at the least F, I and W of a unit it must hold (as relaxed_step costs them),
  // only grows with `end`, since every cost does; `spread`, each path's least length over the
  // cuts of the later units (its completion), is at least as high but need not grow.
  struct PathBound {
    double growing = 0, spread = 0;
    CostPath* growing_path = nullptr;  // the paths that gave them
    CostPath* spread_path = nullptr;
  };
  PathBound path_bound(int known, int64_t end);

  double limit() const {
    return std::min(out.ranges.empty() ? kInf : out.step, ceiling) * (1 + kSlack);
  }

  // Whether the prefix `ranges[0, known)` (or the partition, known = S), whose completions
  // take at least `value`, is dropped: past the limit, or tied with the best (within the
  // slack) where no completion could be preferred to it. One dropped for the ceiling alone
  // keeps its bound for the search's lower bound. Every test below only tightens as the last
  // known stage grows, so a drop of a bound that grows with it drops the later cuts too.
  bool drop(double value);

  // In a tie on the step time, whether a completion of the known stages could still be
  // preferred to the best: its bottleneck is at least the known stages' (sums of times only
  // grow), and with an equal one the earlier cuts win.
  bool may_win_tie();

  // A prefix every completion of which is past the limit, by a test that gives no bound of
  // its own: the limit is all that is known of it.
  void drop_beyond_limit() {
    count_dropped(limit());
    if (out.ranges.empty() || ceiling < out.step) least_open = std::min(least_open, limit());
  }

  // Left unsearched for want of budget: its bound is all the search proved of it.
  void leave_open(double value) { least_open = std::min(least_open, value); }

  void try_partition(const std::vector<StageRange>& partition);

  // The complete partition `ranges`: simulated unless a rank's bound rules it out, or it
  // does not fit.
  void finish();

  // The least largest busy time of the ranks holding stages after `k`, when the units [e, n)
  // are still to be spread over them (water filling over their busy times so far); with one
  // stage per rank, the dynamic programming's exact completion bound, which is above it.
  double remaining(int k, int64_t e);

  // Whether the stages after `k` can hold the units [e, n) with every rank's bound within
  // `level`, in a relaxation: a stage may be empty, and a rank's bound counts only its known
  // stages and the one stage being placed (the other unknown ones at no cost, its head at
  // least the forwards of the known stages, its tail the gradient steps of those alone). By
  // monotonicity each of these is below the rank's bound in any completion. A stage's bound
  // then grows with its units alone, so cutting each stage as late as its bound allows
  // reaches the end whenever any cut does. False drops every completion of the prefix.
  bool completes_within(int k, int64_t e, double level);

  // The relaxed simulation sees the bubble the sums miss, and leaves its critical path for
  // the path bounds. Only in the first quarter of the stages, where a prune drops the most:
  // deeper, the remembered paths bound prefixes at a fraction of a simulation's cost
  // (measured on bench_planner's table: relaxed simulations down to three quarters of the
  // stages took plan() two to three times as long for the same rows proven; at 50 units and
  // 16 ranks the first quarter proved the most rows). Never next to the last stage, whose one
  // completion is simulated anyway.
  bool relaxes(int k) const {
    return k + 2 < stages && 4 * k < stages && relaxed_here < budget.relaxed && !exhausted &&
           affords_run();
  }
  // Whether one more run (a simulation, relaxed or not) fits the budget of actions.
  bool affords_run() const { return actions_here <= budget.actions - replay.actions(); }

  // Stage k from unit b on: each cut the bounds and the cap leave, then the stages after it.
  void place(int k, int64_t b);

  // Two stages a rank, placed a rank at a time from the outside in. In the V (zbv), rank r's
  // stages r and 2p-1-r take the units [a, a2) and [b2, b) within the [a, b) the outer ranks
  // left, and the stages r+1 .. 2p-2-r of the ranks still to place hold [a2, b2). In the loop
  // (interleaved, v = 2) under the middle cut m = c_p, rank r's stages r and p+r take [a, a2)
  // and [b, b2), where a and b end the stages r-1 and p+r-1, and the ranks still to place hold
  // [a2, m) and [b2, n). A choice is bounded by the largest OwnStageBound of the ranks placed
  // and the pair table of those still to place, and the choices are tried from the least
  // bound up, so the first past the limit ends the rank. Prefix order does not apply, so a tie
  // is never dropped.
  int64_t middle = 0;  // the loop's middle cut, while one is searched
  int partner(int r) const { return paired ? stages - 1 - r : ranks + r; }

  // path_bound for the pairs, the stages of the ranks still to place each at the least F, I
  // and W of a unit they may hold. `outer` keeps, per path, what the stages of the ranks
  // before r add to it (the same for every choice of rank r), with the serial of the path it
  // was taken of.
  double paired_path_bound(int r, int64_t a2, int64_t b2, CostPath** longest,
                           std::vector<std::pair<int64_t, double>>& outer);

  struct PairChoice {
    double bound;
    PairedStageBound::Outer next;  // the loop's uses `placed` alone
    int64_t a2, b2;
  };
  void place_pairs(int r, const PairedStageBound::Outer& placed);

  // The loop: each middle cut from the least bound up, then its ranks' pairs.
  void place_middles();

  // The loop's pair tables under the best found: a search drops every prefix past it, so a
  // value past it need not be exact (a little above, so that a tie still counts as one).
  void prepare_looped() {
    if (looped) looped->prepare(out.ranges.empty() ? kInf : out.step * (1 + 4 * kSlack));
  }

  // No partition that fits is faster than this: what the searches proved, and the root's
  // bounds once taken.
  double proved = 0;
  bool rooted = false;

  void take_root_bound();

  // One walk of the tree under `ceiling`; whether it proved the best found the fastest.
  bool walk();

  // Iterative deepening on the bound where each node's bound is a pair table's (zbv without a
  // cap; interleaved v=2 without one under a ceiling below the best found, every walk of it
  // by pairs): walks under growing ceilings below the best found, then the walk under it. A
  // depth-first walk under the best found descends into every subtree whose bound is below
  // it, most of them far from the optimum, before it meets a partition near the proven bound;
  // a walk under a lower ceiling visits only the subtrees that could hold so fast a
  // partition, finds one there if any is, and proves the bound up to its ceiling. Each walk
  // repeats the ones before it, so the next ceiling is set where the bounds dropped above
  // this one count kGrowth times the prefixes this one visited. The walks below the best
  // found take at most a quarter of the search's prefixes, on top of those of the last walk,
  // which keeps the whole budget it has without them. Measured on bench_planner's 50-unit
  // model at p = 8 (zbv, m = 64, one search with a large budget from the first incumbent),
  // before the relays: 15 thousand prefixes to prove the optimum rather than 58 thousand in
  // one walk, which met it only after 47 thousand (with them, 1.1 thousand).
  double next_ceiling = -1;  // of the next walk below the best found; -1: the root's bound
  bool counting = false;     // the walk counts the bounds it drops in (ceiling, counted_top)
  double counted_top = 0;
  std::vector<int64_t> dropped_above = std::vector<int64_t>(kBuckets, 0);

  void count_dropped(double value);

  Searched search(const SearchBudget& asked, double asked_ceiling);
};

// Called for every prefix and cut the search tries: defined here so the walks inline it.
inline bool PartitionSearcher::Impl::drop(double value) {
  if (value > limit()) {
    count_dropped(value);
    if (out.ranges.empty() || value <= out.step * (1 + kSlack))
      least_open = std::min(least_open, value);
    return true;
  }
  return !out.ranges.empty() && value >= out.step * (1 - kSlack) && !may_win_tie();
}

}  // namespace conveyor::planning
