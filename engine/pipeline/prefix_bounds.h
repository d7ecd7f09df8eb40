#pragma once
// Lower bounds the partition search (partition_search.h) prunes prefixes and partitions
// with, read off the schedule and the simulator: each rank's busy time and the chain before
// and after it (StepBound), water filling of the remaining compute over the ranks still to
// come (RankWork), a relaxed simulation of a prefix (relaxed_step), and the critical paths of
// simulated partitions (CostPath). Internal to the search.
#include <cstdint>
#include <vector>

#include "engine/pipeline/partition.h"
#include "engine/pipeline/partition_sums.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"

namespace conveyor::planning {

// Lower bounds on the simulated step time of a partition, read off the schedule's lists. A rank
// runs its computes one at a time, so it ends no earlier than
//   head + busy + max(0, tail - after):
// busy, the sum of its computes; head, the forwards of every stage below the one of its first
// compute (that micro-batch must pass them first); tail, the gradient steps (I, or B when the
// stage does not split) of every stage below the one of its last gradient step (that
// micro-batch's gradient must pass them after it); after, the weight gradients the rank itself
// runs after that last gradient step. Transfers are left out: they can only add time.
struct StepBound {
  struct Count {
    double f = 0, i = 0, w = 0;  // how many F, I and W costs of a stage a rank runs
  };
  const schedule::Placement& placement;
  std::vector<std::vector<Count>> counts;  // [rank][stage]
  std::vector<std::vector<double>> after;  // [rank][stage]: W actions after the last gradient
  std::vector<int> first, last;            // per rank: stage of the first F, of the last I or B
  std::vector<bool> split;                 // per stage: its gradient step is I alone
  std::vector<bool> split_below;           // per stage: some stage below it splits
  std::vector<std::vector<int>> own;       // per rank: its stages
  double multiple = kInf;  // the fewest F, I or W of one stage any rank runs (m, generated)

  explicit StepBound(const schedule::Schedule& schedule);
  // Rank r's busy time with stage costs F, I, W, over the stages [0, known) only.
  double busy(int r, const std::vector<double>& f, const std::vector<double>& i,
              const std::vector<double>& w, int known) const;
  // The bound of rank r when the stages [0, known) have their costs; exact once every stage of
  // the rank and every stage below its first and last is known, smaller before.
  double rank(int r, const std::vector<double>& f, const std::vector<double>& i,
              const std::vector<double>& w, int known) const;
  // With one stage per rank (rank s holds stage s): rank s's bound when its stage holds the
  // units [b, e). The stages below hold exactly the units [0, b), so the head is their
  // forwards and the tail their gradient steps, whatever the cuts among them; when some
  // stage below splits its backward, the tail counts the input gradients alone (still a
  // lower bound). What rank() gives once the stages up to s are known, from the units alone.
  double lone_stage(const Sums& sums, int s, int64_t b, int64_t e) const;
};

inline double StepBound::busy(int r, const std::vector<double>& f, const std::vector<double>& i,
                              const std::vector<double>& w, int known) const {
  double total = 0;
  for (int s : own[r])
    if (s < known) total += counts[r][s].f * f[s] + counts[r][s].i * i[s] + counts[r][s].w * w[s];
  return total;
}

inline double StepBound::rank(int r, const std::vector<double>& f, const std::vector<double>& i,
                              const std::vector<double>& w, int known) const {
  double head = 0, tail = 0, later = 0;
  for (int s = 0; s < std::min(first[r], known); ++s) head += f[s];
  bool complete = last[r] < known;
  for (int s : own[r]) complete = complete && s < known;
  if (complete) {
    for (int s = 0; s < last[r]; ++s) tail += split[s] ? i[s] : i[s] + w[s];
    for (int s : own[r]) later += after[r][s] * w[s];
  }
  return head + busy(r, f, i, w, known) + std::max(0.0, tail - later);
}

inline double StepBound::lone_stage(const Sums& sums, int s, int64_t b, int64_t e) const {
  const Count& c = counts[s][s];
  const double weight = sums.weight.over(b, e);
  const double tail = sums.input.over(0, b) + (split_below[s] ? 0.0 : sums.weight.over(0, b));
  return sums.forward.over(0, b) + c.f * sums.forward.over(b, e) + c.i * sums.input.over(b, e) +
         c.w * weight + std::max(0.0, tail - after[s][s] * weight);
}

// Water filling of the extra compute over the ranks holding later stages. Rank r's action j
// starts no earlier than its relaxed start S_j (monotone), and the rank then runs its later
// actions one at a time, so it ends no earlier than S_j + (their relaxed durations) + c_j *
// (the extra compute of its later stages), c_j being the fewest F, I or W of any of its later
// stages from j on. Each line (S_j + relaxed rest, c_j) is such a bound; the extra computes
// sum to `extra` whatever the cuts, so the step time is at least the least level L at which
// the ranks can absorb it: sum over ranks of min over lines (L - base) / c >= extra.
class RankWork {
 public:
  RankWork(const schedule::Schedule& schedule, const schedule::Replay& sim, int known,
           double extra);
  // The bound: the relaxed makespan, raised to the least level that absorbs the extra work.
  double level() const;

 private:
  struct Line {
    double base, per;
  };

  void add_lines(const std::vector<schedule::Action>& list, const schedule::Replay& sim, int r,
                 int known, const std::vector<int>& later, std::vector<double>& count_f,
                 std::vector<double>& count_i, std::vector<double>& count_w);

  double absorbed(double level) const;

  std::vector<std::vector<Line>> lines_;  // per rank holding later stages
  double extra_, makespan_;
  int microbatches_;
};

// Two lower bounds on the step time of every partition that begins with the stages
// [0, known), which cost f, i and w; the prefix ends at unit `end`, so stage j >= known starts
// within [end + j - known, n - stages + j] and holds at least the unit there with the least F,
// I and W.
struct Relaxed {
  // The schedule simulated with each later stage at those least costs. With every rank's list
  // fixed, the simulator's times are maxima and sums of the costs (no choice among ready
  // actions depends on them), so they never decrease when a cost grows: this bounds from below
  // the step time of every completion, bubbles included, and only grows with `end`.
  double simulated = 0;
  // What the units [end, n) cost beyond the least units the later stages were credited with:
  // RankWork, over the replay's run of it, raises the bound with it.
  double extra = 0;
};

// The relaxed costs of the stages [known, S) after a prefix that ends at unit `end`, simulated
// by `replay` (Relaxed says what the two figures bound).
Relaxed relaxed_step(const schedule::Schedule& schedule, schedule::Replay& replay,
                     const std::vector<UnitCost>& timed, const std::vector<double>& f,
                     const std::vector<double>& i, const std::vector<double>& w, int known,
                     int64_t end, double transfer);

// Whether partition a (step time, bottleneck, ranges) is preferred to b: faster, then more
// balanced, then the earlier cuts, so that ties are decided the same way every time.
bool preferred(double step_a, double bottleneck_a, const std::vector<StageRange>& a, double step_b,
               double bottleneck_b, const std::vector<StageRange>& b);

// A path of the schedule's dependency graph (Replay::critical_path) as what it adds up: per
// stage, how many F, I and W costs, and how many transfers. Every step on it waits for the one
// before, so under any partition's costs its length is at most that partition's step time.
struct CostPath {
  std::vector<double> f, i, w;
  double transfers = 0;

  CostPath(const std::vector<schedule::Action>& steps, int stages);
  // below_f[s]: the F counts of the stages [0, s); likewise I and W.
  std::vector<double> below_f, below_i, below_w;
  // completion[k][e]: the least the stages [k, S) add to the path over every cut of the units
  // [e, n) among them (kInf: no cut), by dynamic programming from the last stage; each stage
  // adds its counts times its sums.
  std::vector<std::vector<double>> completion;
  int64_t used = 0;    // when it last dropped a prefix, or was remembered
  int64_t serial = 0;  // which path remembered this is

  bool same_counts(const CostPath& o) const;
  // The path's time over stages [0, known) of the given costs, plus its transfers.
  double known_length(const std::vector<double>& sf, const std::vector<double>& si,
                      const std::vector<double>& sw, int known, double transfer) const;
  void fill_completion(const Sums& sums);
};

}  // namespace conveyor::planning
