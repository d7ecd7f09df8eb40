#include "engine/pipeline/partition_search.h"

#include <algorithm>
#include <functional>

namespace conveyor::planning {

double bottleneck_of(const Sums& sums, const std::vector<StageRange>& ranges,
                     const schedule::Placement& placement) {
  std::vector<double> per_rank(placement.num_ranks, 0.0);
  for (int s = 0; s < static_cast<int>(ranges.size()); ++s)
    per_rank[placement.rank_of(s)] += sums.compute.over(ranges[s]);
  return *std::max_element(per_rank.begin(), per_rank.end());
}

// The simulator's costs of a partition: per stage, the sums over its units.
schedule::CostModel cost_model(const std::vector<UnitCost>& units,
                               const std::vector<StageRange>& ranges, double transfer) {
  schedule::CostModel costs;
  costs.forward.clear(), costs.backward_input.clear(), costs.backward_weight.clear();
  for (const auto& r : ranges) {
    double f = 0, i = 0, w = 0, a = 0;
    for (int64_t u = r.begin; u < r.end; ++u)
      f += units[u].forward, i += units[u].backward_input, w += units[u].backward_weight,
          a += units[u].activation_bytes;
    costs.forward.push_back(f);
    costs.backward_input.push_back(i);
    costs.backward_weight.push_back(w);
    costs.activation_bytes.push_back(a);
  }
  costs.latency = transfer;
  return costs;
}

// Min over contiguous partitions of max over stages of cost(stage, begin, end), where a cost of
// +inf marks a stage that is not allowed: O(S · U²) dynamic programming. Empty when every
// partition has an infinite stage.
std::vector<StageRange> min_max_partition(
    int64_t units, int stages, const std::function<double(int, int64_t, int64_t)>& cost) {
  // best[s][u]: the smallest largest-stage cost putting units [0, u) into stages [0, s).
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(units + 1, kInf));
  std::vector<std::vector<int64_t>> cut(stages + 1, std::vector<int64_t>(units + 1, -1));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int64_t u = s; u <= units - (stages - s); ++u)
      for (int64_t start = s - 1; start < u; ++start) {
        if (best[s - 1][start] == kInf) continue;
        const double c = std::max(best[s - 1][start], cost(s - 1, start, u));
        if (c < best[s][u]) best[s][u] = c, cut[s][u] = start;
      }
  if (best[stages][units] == kInf) return {};
  std::vector<StageRange> ranges(stages);
  for (int s = stages, u = static_cast<int>(units); s >= 1; --s) {
    ranges[s - 1] = {cut[s][u], u};
    u = static_cast<int>(cut[s][u]);
  }
  return ranges;
}

namespace {

// See search_partition's budgets.
constexpr int64_t kBudgetActions = 4096;
// Critical paths the search keeps to bound prefixes and partitions before simulating them.
constexpr size_t kPaths = 32;
// Iterative deepening (PartitionSearcher::Impl::search): at most this many walks below the
// best found in one search, taking at most this share of its prefixes on top of its budget;
// the work each next walk aims at, in prefixes visited by the one before; the buckets of the
// bounds a walk drops above its ceiling.
constexpr int kMaxWalks = 16;
constexpr int64_t kLowerShare = 4;  // a quarter
constexpr int64_t kGrowth = 8;
constexpr int kBuckets = 256;

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

  explicit StepBound(const schedule::Schedule& schedule) : placement(schedule.placement) {
    using schedule::ActionKind;
    const int ranks = schedule.num_ranks(), stages = schedule.num_stages();
    counts.assign(ranks, std::vector<Count>(stages));
    after.assign(ranks, std::vector<double>(stages, 0.0));
    first.assign(ranks, 0), last.assign(ranks, 0), split.assign(stages, false);
    for (int r = 0; r < ranks; ++r) own.push_back(placement.stages_of(r));
    for (int r = 0; r < ranks; ++r) {
      bool started = false;
      for (const auto& a : schedule.ranks[r]) {
        Count& c = counts[r][a.stage];
        switch (a.kind) {
          case ActionKind::kForward:
            if (!started) first[r] = a.stage;
            started = true, c.f += 1;
            break;
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
            c.i += 1, c.w += a.kind == ActionKind::kBackward ? 1 : 0;
            if (a.kind == ActionKind::kBackwardInput) split[a.stage] = true;
            last[r] = a.stage, started = true;
            std::fill(after[r].begin(), after[r].end(), 0.0);
            break;
          case ActionKind::kBackwardWeight:
            c.w += 1, after[r][a.stage] += 1;
            break;
          default:
            break;
        }
      }
      for (int s : own[r])
        multiple = std::min({multiple, counts[r][s].f, counts[r][s].i, counts[r][s].w});
    }
    split_below.assign(stages, false);
    for (int s = 1; s < stages; ++s) split_below[s] = split_below[s - 1] || split[s - 1];
  }
  // Rank r's busy time with stage costs F, I, W, over the stages [0, known) only.
  double busy(int r, const std::vector<double>& f, const std::vector<double>& i,
              const std::vector<double>& w, int known) const {
    double total = 0;
    for (int s : own[r])
      if (s < known) total += counts[r][s].f * f[s] + counts[r][s].i * i[s] + counts[r][s].w * w[s];
    return total;
  }
  // The bound of rank r when the stages [0, known) have their costs; exact once every stage of
  // the rank and every stage below its first and last is known, smaller before.
  double rank(int r, const std::vector<double>& f, const std::vector<double>& i,
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
  // With one stage per rank (rank s holds stage s): rank s's bound when its stage holds the
  // units [b, e). The stages below hold exactly the units [0, b), so the head is their
  // forwards and the tail their gradient steps, whatever the cuts among them; when some
  // stage below splits its backward, the tail counts the input gradients alone (still a
  // lower bound). What rank() gives once the stages up to s are known, from the units alone.
  double lone_stage(const Sums& sums, int s, int64_t b, int64_t e) const {
    const Count& c = counts[s][s];
    const double weight = sums.weight.over(b, e);
    const double tail = sums.input.over(0, b) + (split_below[s] ? 0.0 : sums.weight.over(0, b));
    return sums.forward.over(0, b) + c.f * sums.forward.over(b, e) + c.i * sums.input.over(b, e) +
           c.w * weight + std::max(0.0, tail - after[s][s] * weight);
  }
};

// Water filling of the extra compute over the ranks holding later stages. Rank r's action j
// starts no earlier than its relaxed start S_j (monotone), and the rank then runs its later
// actions one at a time, so it ends no earlier than S_j + (their relaxed durations) + c_j *
// (the extra compute of its later stages), c_j being the fewest F, I or W of any of its later
// stages from j on. Each line (S_j + relaxed rest, c_j) is such a bound; the extra computes
// sum to `extra` whatever the cuts, so the step time is at least the least level L at which
// the ranks can absorb it: sum over ranks of min over lines (L - base) / c >= extra.
class RankWork {
 public:
  RankWork(const schedule::Schedule& schedule, const schedule::Replay& sim, int known, double extra)
      : extra_(extra), makespan_(sim.makespan()), microbatches_(schedule.num_microbatches) {
    if (known >= schedule.num_stages() || extra <= 0) return;
    const int stages = schedule.num_stages(), ranks = schedule.num_ranks();
    lines_.resize(ranks);
    std::vector<double> count_f(stages), count_i(stages), count_w(stages);
    for (int r = 0; r < ranks; ++r) {
      std::vector<int> later;
      for (int s : schedule.placement.stages_of(r))
        if (s >= known) later.push_back(s);
      if (later.empty()) continue;
      for (int s : later) count_f[s] = count_i[s] = count_w[s] = 0;
      add_lines(schedule.ranks[r], sim, r, known, later, count_f, count_i, count_w);
    }
  }
  // The bound: the relaxed makespan, raised to the least level that absorbs the extra work.
  double level() const {
    // Every base is at most the relaxed makespan, where each rank absorbs a share >= 0.
    double low = makespan_;
    if (lines_.empty() || absorbed(low) >= extra_) return low;
    double high = low + extra_ * microbatches_ * 3;
    for (double step = extra_; absorbed(high) < extra_; step *= 2) high += step;
    for (int round = 0; round < 60 && high - low > 1e-12 * high; ++round) {
      const double mid = 0.5 * (low + high);
      (absorbed(mid) >= extra_ ? high : low) = mid;
    }
    return low;  // not enough at `low`: the least level is above it
  }

 private:
  struct Line {
    double base, per;
  };

  void add_lines(const std::vector<schedule::Action>& list, const schedule::Replay& sim, int r,
                 int known, const std::vector<int>& later, std::vector<double>& count_f,
                 std::vector<double>& count_i, std::vector<double>& count_w) {
    using schedule::ActionKind;
    double rest = 0;
    for (size_t j = list.size(); j-- > 0;) {
      const schedule::Action& a = list[j];
      if (!schedule::is_compute(a.kind)) continue;
      const schedule::ActionTiming& t = sim.timing(r, static_cast<int>(j));
      rest += t.end - t.start;
      if (a.stage < known) continue;
      if (a.kind == ActionKind::kForward) count_f[a.stage] += 1;
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput)
        count_i[a.stage] += 1;
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight)
        count_w[a.stage] += 1;
      double per = kInf;
      for (int s : later) per = std::min({per, count_f[s], count_i[s], count_w[s]});
      if (per <= 0) continue;
      // Scanning backwards `per` only grows: a line whose base is no higher than the new
      // one's is never the smaller (L - base) / per.
      const double base = t.start + rest;
      auto& mine = lines_[r];
      while (!mine.empty() && mine.back().base <= base) mine.pop_back();
      mine.push_back({base, per});
    }
  }

  double absorbed(double level) const {
    double total = 0;
    for (const auto& mine : lines_) {
      if (mine.empty()) continue;
      double least = kInf;
      for (const Line& l : mine) least = std::min(least, (level - l.base) / l.per);
      total += std::max(0.0, least);
    }
    return total;
  }

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

Relaxed relaxed_step(const schedule::Schedule& schedule, schedule::Replay& replay,
                     const std::vector<UnitCost>& timed, const std::vector<double>& f,
                     const std::vector<double>& i, const std::vector<double>& w, int known,
                     int64_t end, double transfer) {
  const int stages = schedule.num_stages();
  const int64_t n = static_cast<int64_t>(timed.size());
  schedule::CostModel costs;
  costs.forward.assign(f.begin(), f.begin() + known);
  costs.backward_input.assign(i.begin(), i.begin() + known);
  costs.backward_weight.assign(w.begin(), w.begin() + known);
  double extra = 0;
  for (int64_t u = end; u < n; ++u) extra += timed[u].compute();
  for (int j = known; j < stages; ++j) {
    double least_f = kInf, least_i = kInf, least_w = kInf;
    // The last stage ends with the last unit.
    for (int64_t u = j == stages - 1 ? n - 1 : end + (j - known); u <= n - stages + j; ++u)
      least_f = std::min(least_f, timed[u].forward),
      least_i = std::min(least_i, timed[u].backward_input),
      least_w = std::min(least_w, timed[u].backward_weight);
    costs.forward.push_back(least_f);
    costs.backward_input.push_back(least_i);
    costs.backward_weight.push_back(least_w);
    extra -= least_f + least_i + least_w;
  }
  costs.latency = transfer;
  return {replay.run(costs), extra};
}

// Whether partition a (step time, bottleneck, ranges) is preferred to b: faster, then more
// balanced, then the earlier cuts, so that ties are decided the same way every time.
bool preferred(double step_a, double bottleneck_a, const std::vector<StageRange>& a, double step_b,
               double bottleneck_b, const std::vector<StageRange>& b) {
  if (step_a != step_b) return step_a < step_b;
  if (bottleneck_a != bottleneck_b) return bottleneck_a < bottleneck_b;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s)
    if (a[s].begin != b[s].begin) return a[s].begin < b[s].begin;
  return false;
}

}  // namespace

double relaxed_step_bound(const std::vector<UnitCost>& timed, const schedule::Schedule& schedule,
                          const std::vector<StageRange>& prefix, double transfer, bool rank_work) {
  const int stages = schedule.num_stages();
  std::vector<double> f(stages, 0.0), i(stages, 0.0), w(stages, 0.0);
  for (size_t s = 0; s < prefix.size(); ++s)
    for (int64_t u = prefix[s].begin; u < prefix[s].end; ++u)
      f[s] += timed[u].forward, i[s] += timed[u].backward_input, w[s] += timed[u].backward_weight;
  schedule::Replay replay(schedule);
  const Relaxed relaxed =
      relaxed_step(schedule, replay, timed, f, i, w, static_cast<int>(prefix.size()),
                   prefix.empty() ? 0 : prefix.back().end, transfer);
  return rank_work
             ? RankWork(schedule, replay, static_cast<int>(prefix.size()), relaxed.extra).level()
             : relaxed.simulated;
}

// A path of the schedule's dependency graph (Replay::critical_path) as what it adds up: per
// stage, how many F, I and W costs, and how many transfers. Every step on it waits for the one
// before, so under any partition's costs its length is at most that partition's step time.
struct CostPath {
  std::vector<double> f, i, w;
  double transfers = 0;

  CostPath(const std::vector<schedule::Action>& steps, int stages)
      : f(stages, 0.0), i(stages, 0.0), w(stages, 0.0) {
    using schedule::ActionKind;
    for (const schedule::Action& a : steps) switch (a.kind) {
        case ActionKind::kForward:
          f[a.stage] += 1;
          break;
        case ActionKind::kBackward:
          i[a.stage] += 1, w[a.stage] += 1;
          break;
        case ActionKind::kBackwardInput:
          i[a.stage] += 1;
          break;
        case ActionKind::kBackwardWeight:
          w[a.stage] += 1;
          break;
        case ActionKind::kAllReduceGrad:  // none in a planned schedule; left out, it only
          break;                          // shortens the path
        default:
          transfers += schedule::is_send(a.kind) ? 1 : 0;
          break;
      }
    below_f.assign(stages + 1, 0.0), below_i = below_f, below_w = below_f;
    for (int s = 0; s < stages; ++s)
      below_f[s + 1] = below_f[s] + f[s], below_i[s + 1] = below_i[s] + i[s],
                  below_w[s + 1] = below_w[s] + w[s];
  }
  // below_f[s]: the F counts of the stages [0, s); likewise I and W.
  std::vector<double> below_f, below_i, below_w;
  // completion[k][e]: the least the stages [k, S) add to the path over every cut of the units
  // [e, n) among them (kInf: no cut), by dynamic programming from the last stage; each stage
  // adds its counts times its sums.
  std::vector<std::vector<double>> completion;
  int64_t used = 0;    // when it last dropped a prefix, or was remembered
  int64_t serial = 0;  // which path remembered this is

  bool same_counts(const CostPath& o) const {
    return f == o.f && i == o.i && w == o.w && transfers == o.transfers;
  }
  // The path's time over stages [0, known) of the given costs, plus its transfers.
  double known_length(const std::vector<double>& sf, const std::vector<double>& si,
                      const std::vector<double>& sw, int known, double transfer) const {
    double total = transfers * transfer;
    for (int s = 0; s < known; ++s) total += f[s] * sf[s] + i[s] * si[s] + w[s] * sw[s];
    return total;
  }
  void fill_completion(const Sums& sums) {
    const int stages = static_cast<int>(f.size());
    const int64_t n = sums.compute.n;
    completion.assign(stages + 1, std::vector<double>(n + 1, kInf));
    completion[stages][n] = 0;
    for (int k = stages - 1; k >= 0; --k)
      for (int64_t b = k; b <= n - (stages - k); ++b) {
        double least = kInf;
        for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e)
          least = std::min(least, f[k] * sums.forward.over(b, e) + i[k] * sums.input.over(b, e) +
                                      w[k] * sums.weight.over(b, e) + completion[k + 1][e]);
        completion[k][b] = least;
      }
  }
};

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
       const schedule::Schedule& schedule, double cap, double transfer)
      : sums(sums),
        timed(timed),
        memory_of(memory_of),
        schedule(schedule),
        cap(cap),
        transfer(transfer),
        n(static_cast<int64_t>(timed.size())),
        stages(schedule.num_stages()),
        ranks(schedule.num_ranks()),
        one_stage_per_rank(schedule.placement.chunks == 1),
        bound(schedule),
        paired(PairedStageBound::applies(schedule.placement)
                   ? std::make_unique<PairedStageBound>(schedule, sums)
                   : nullptr),
        looped(LoopedPairBound::applies(schedule.placement)
                   ? std::make_unique<LoopedPairBound>(schedule, sums)
                   : nullptr),
        replay(schedule),
        budget_scale(
            std::max<int64_t>(kBudgetActions / std::max<int64_t>(replay.actions(), 1), 1)) {
    if (one_stage_per_rank && cap > 0) stage_fit.assign(stages * (n + 1) * (n + 1), -1);
    if (one_stage_per_rank) fill_completion();
    f.assign(stages, 0.0), i.assign(stages, 0.0), w.assign(stages, 0.0), state.assign(ranks, 0.0);
    rank_base.assign(ranks, 0.0), rank_slack.assign(ranks, 0.0), rank_compute.assign(ranks, 0.0);
    ranges.resize(stages);
    ranks_after.resize(stages);
    for (int k = 0; k < stages; ++k)
      for (int r = 0; r < ranks; ++r)
        if (std::any_of(bound.own[r].begin(), bound.own[r].end(), [&](int s) { return s > k; }))
          ranks_after[k].push_back(r);
    fill_least_units();
    node_f.assign(stages, 0.0), node_i.assign(stages, 0.0), node_w.assign(stages, 0.0);
  }

  // Whether stage k of units [b, e) fits, remembered: the search asks again for every prefix.
  bool stage_fits(int k, int64_t b, int64_t e) {
    if (stage_fit.empty()) return true;
    int8_t& known = stage_fit[(k * (n + 1) + b) * (n + 1) + e];
    if (known < 0) known = fits(memory_of.stage(k, b, e), cap) ? 1 : 0;
    return known == 1;
  }

  bool fits_cap(const std::vector<StageRange>& partition) const {
    const auto memory = memory_of(partition);
    return fits(*std::max_element(memory.begin(), memory.end()), cap);
  }

  // Dynamic programming from the last stage: each rank's lone-stage bound depends on its own
  // stage's units alone.
  void fill_completion() {
    completion.assign(stages + 1, std::vector<double>(n + 1, kInf));
    completion[stages][n] = 0;
    for (int k = stages - 1; k >= 0; --k)
      for (int64_t b = k; b <= n - (stages - k); ++b) {
        double least = kInf;
        for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e) {
          if (completion[k + 1][e] == kInf || !stage_fits(k, b, e)) continue;
          least = std::min(least, std::max(bound.lone_stage(sums, k, b, e), completion[k + 1][e]));
        }
        completion[k][b] = least;
      }
  }

  void fill_least_units() {
    least_f.assign((n + 1) * (n + 1), kInf), least_i = least_f, least_w = least_f;
    for (int64_t lo = 0; lo < n; ++lo) {
      double lf = kInf, li = kInf, lw = kInf;
      for (int64_t hi = lo; hi < n; ++hi) {
        lf = std::min(lf, timed[hi].forward), li = std::min(li, timed[hi].backward_input),
        lw = std::min(lw, timed[hi].backward_weight);
        least_f[lo * (n + 1) + hi] = lf, least_i[lo * (n + 1) + hi] = li,
                               least_w[lo * (n + 1) + hi] = lw;
      }
    }
  }

  // Keeps the critical path of the last run when it is new, in place of the one that has
  // gone longest without dropping a prefix.
  void remember_path() {
    CostPath path(replay.critical_path(), stages);
    for (const CostPath& known : paths)
      if (known.same_counts(path)) return;
    path.fill_completion(sums);
    path.used = ++path_clock, path.serial = ++path_serial;
    if (paths.size() < kPaths) return paths.push_back(std::move(path));
    *std::min_element(paths.begin(), paths.end(), [](const CostPath& a, const CostPath& b) {
      return a.used < b.used;
    }) = std::move(path);
  }

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
  PathBound path_bound(int known, int64_t end) {
    PathBound out;
    if (paths.empty()) return out;
    for (int s = known; s < stages; ++s) {
      // The last stage ends with the last unit.
      const int64_t lo = s == stages - 1 ? n - 1 : end + (s - known), hi = n - stages + s;
      node_f[s] = least_f[lo * (n + 1) + hi], node_i[s] = least_i[lo * (n + 1) + hi],
      node_w[s] = least_w[lo * (n + 1) + hi];
    }
    for (CostPath& path : paths) {
      const double prefix = path.known_length(f, i, w, known, transfer);
      double least = 0;
      for (int s = known; s < stages; ++s)
        least += path.f[s] * node_f[s] + path.i[s] * node_i[s] + path.w[s] * node_w[s];
      if (prefix + least > out.growing) out.growing = prefix + least, out.growing_path = &path;
      const double spread = prefix + path.completion[known][end];
      if (spread > out.spread) out.spread = spread, out.spread_path = &path;
    }
    return out;
  }

  double limit() const {
    return std::min(out.ranges.empty() ? kInf : out.step, ceiling) * (1 + kSlack);
  }

  // Whether the prefix `ranges[0, known)` (or the partition, known = S), whose completions
  // take at least `value`, is dropped: past the limit, or tied with the best (within the
  // slack) where no completion could be preferred to it. One dropped for the ceiling alone
  // keeps its bound for the search's lower bound. Every test below only tightens as the last
  // known stage grows, so a drop of a bound that grows with it drops the later cuts too.
  bool drop(double value) {
    if (value > limit()) {
      count_dropped(value);
      if (out.ranges.empty() || value <= out.step * (1 + kSlack))
        least_open = std::min(least_open, value);
      return true;
    }
    return !out.ranges.empty() && value >= out.step * (1 - kSlack) && !may_win_tie();
  }

  // In a tie on the step time, whether a completion of the known stages could still be
  // preferred to the best: its bottleneck is at least the known stages' (sums of times only
  // grow), and with an equal one the earlier cuts win.
  bool may_win_tie() {
    std::fill(rank_compute.begin(), rank_compute.end(), 0.0);
    for (int s = 0; s < known; ++s)
      rank_compute[schedule.placement.rank_of(s)] += sums.compute.over(ranges[s]);
    const double least = *std::max_element(rank_compute.begin(), rank_compute.end());
    if (least != best_bottleneck) return least < best_bottleneck;
    for (int s = 0; s < known; ++s)
      if (ranges[s].end != out.ranges[s].end) return ranges[s].end < out.ranges[s].end;
    return true;
  }

  // A prefix every completion of which is past the limit, by a test that gives no bound of
  // its own: the limit is all that is known of it.
  void drop_beyond_limit() {
    count_dropped(limit());
    if (out.ranges.empty() || ceiling < out.step) least_open = std::min(least_open, limit());
  }

  // Left unsearched for want of budget: its bound is all the search proved of it.
  void leave_open(double value) { least_open = std::min(least_open, value); }

  void try_partition(const std::vector<StageRange>& partition) {
    ++simulated_here, ++out.simulated, actions_here += replay.actions();
    const double step = replay.run(cost_model(timed, partition, transfer));
    remember_path();
    const double bottleneck = bottleneck_of(sums, partition, schedule.placement);
    if (out.ranges.empty() ||
        preferred(step, bottleneck, partition, out.step, best_bottleneck, out.ranges))
      out.ranges = partition, out.step = step, best_bottleneck = bottleneck;
  }

  // The complete partition `ranges`: simulated unless a rank's bound rules it out, or it
  // does not fit.
  void finish() {
    double least = 0;
    for (int q = 0; q < ranks; ++q) least = std::max(least, bound.rank(q, f, i, w, stages));
    if (drop(least)) return;
    const PathBound path = path_bound(stages, n);
    if (drop(std::max(least, path.growing))) {
      if (path.growing > least) touch(path.growing_path);
      return;
    }
    least = std::max(least, path.growing);
    if (!one_stage_per_rank && !fits_cap(ranges)) return;
    if (exhausted || simulated_here >= budget.simulations || !affords_run()) {
      exhausted = true;
      return leave_open(least);
    }
    try_partition(ranges);
  }

  // The least largest busy time of the ranks holding stages after `k`, when the units [e, n)
  // are still to be spread over them (water filling over their busy times so far); with one
  // stage per rank, the dynamic programming's exact completion bound, which is above it.
  double remaining(int k, int64_t e) {
    if (one_stage_per_rank) return completion[k + 1][e];
    levels.clear();
    for (int r : ranks_after[k]) levels.push_back(bound.busy(r, f, i, w, k + 1));
    std::sort(levels.begin(), levels.end());
    double water = bound.multiple * sums.compute.over(e, n), level = levels.front();
    size_t under = 1;
    for (; under < levels.size() && water >= (levels[under] - level) * under; ++under)
      water -= (levels[under] - level) * under, level = levels[under];
    return level + water / under;
  }

  // Whether the stages after `k` can hold the units [e, n) with every rank's bound within
  // `level`, in a relaxation: a stage may be empty, and a rank's bound counts only its known
  // stages and the one stage being placed (the other unknown ones at no cost, its head at
  // least the forwards of the known stages, its tail the gradient steps of those alone). By
  // monotonicity each of these is below the rank's bound in any completion. A stage's bound
  // then grows with its units alone, so cutting each stage as late as its bound allows
  // reaches the end whenever any cut does. False drops every completion of the prefix.
  bool completes_within(int k, int64_t e, double level) {
    const double known_forwards = sums.forward.over(0, e);
    for (int r = 0; r < ranks; ++r) {
      double tail = 0, later = 0;
      for (int s = 0; s < std::min(bound.last[r], k + 1); ++s)
        tail += bound.split[s] ? i[s] : i[s] + w[s];
      for (int s : bound.own[r])
        if (s <= k) later += bound.after[r][s] * w[s];
      double head = known_forwards;
      if (bound.first[r] <= k) {
        head = 0;
        for (int s = 0; s < bound.first[r]; ++s) head += f[s];
      }
      rank_base[r] = head + bound.busy(r, f, i, w, k + 1);
      rank_slack[r] = tail - later;
    }
    int64_t at = e;
    for (int s = k + 1; s < stages; ++s) {
      const int r = schedule.placement.rank_of(s);
      const StepBound::Count& c = bound.counts[r][s];
      auto within = [&](int64_t end) {
        const double weight = sums.weight.over(at, end);
        const double rank = rank_base[r] + c.f * sums.forward.over(at, end) +
                            c.i * sums.input.over(at, end) + c.w * weight +
                            std::max(0.0, rank_slack[r] - bound.after[r][s] * weight);
        return rank <= level && fits(state[r] + sums.state.over(at, end), cap);
      };
      int64_t end = at;
      while (end < n && within(end + 1)) ++end;
      at = end;
    }
    return at == n;
  }

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

  void place(int k, int64_t b) {
    const int r = schedule.placement.rank_of(k);
    const int64_t last_end = k == stages - 1 ? n : n - (stages - 1 - k);
    for (int64_t e = k == stages - 1 ? n : b + 1; e <= last_end; ++e) {
      // One stage per rank: the stage's memory is its own, checked here. Several: what the
      // rank's known stages hold only grows with more units, so past the cap no later cut
      // helps.
      ranges[k] = {b, e};
      if (one_stage_per_rank && !stage_fits(k, b, e)) continue;
      if (!one_stage_per_rank && cap > 0 && !fits(memory_of.known_stages(r, ranges, k + 1), cap))
        break;
      known = k + 1;
      f[k] = sums.forward.over(b, e), i[k] = sums.input.over(b, e), w[k] = sums.weight.over(b, e);
      // The rank's bound only grows with e: past the limit, stop.
      const double own = bound.rank(r, f, i, w, k + 1);
      if (drop(own)) break;
      if (k == stages - 1) {
        finish();
        break;
      }
      // Too few units here leave too much for the rest: try a later cut.
      double least = std::max(own, remaining(k, e));
      // Two stages a rank in a V: the ranks whose both stages are still to come.
      if (paired && k + 1 <= ranks) least = std::max(least, paired->after_prefix(k + 1, e));
      // Two stages a rank in a loop: the ranks whose both stages are still to come, or,
      // past the middle cut, those whose second stage is.
      if (looped && k + 1 <= ranks) least = std::max(least, looped->after_prefix(k + 1, e));
      if (looped && k + 1 > ranks)
        least = std::max(
            least, looped->inner(ranges[ranks - 1].end, k + 1 - ranks, ranges[k - ranks].end, e));
      if (drop(least)) continue;
      if (!one_stage_per_rank && !completes_within(k, e, limit())) {
        drop_beyond_limit();
        continue;
      }
      // Grows with e, as the relaxed simulation does, which it bounds from below.
      const PathBound path = path_bound(k + 1, e);
      if (drop(path.growing)) {
        touch(path.growing_path);
        break;
      }
      if (drop(path.spread)) {
        touch(path.spread_path);
        continue;
      }
      least = std::max(least, path.spread);
      if (relaxes(k)) {
        ++relaxed_here, ++out.relaxed, actions_here += replay.actions();
        const Relaxed relaxed = relaxed_step(schedule, replay, timed, f, i, w, k + 1, e, transfer);
        remember_path();
        // Only grows with e (each later stage's least unit is taken over fewer units), so
        // past the limit, stop.
        if (drop(relaxed.simulated)) break;
        least = std::max(least, relaxed.simulated);
      }
      if (exhausted || visits_here >= visit_limit || !affords_run()) {
        exhausted = true;
        leave_open(least);
        continue;
      }
      ++visits_here, ++out.visits;
      state[r] += sums.state.over(b, e);
      place(k + 1, e);
      state[r] -= sums.state.over(b, e);
    }
    f[k] = i[k] = w[k] = 0;
  }

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
                           std::vector<std::pair<int64_t, double>>& outer) {
    if (paths.empty()) return 0;
    const int mine = partner(r);
    // The inner stages: one run of units in the V; two in the loop, [a2, m) and [b2, n).
    const int64_t low = a2 * (n + 1) + ((paired ? b2 : middle) - 1);
    const int64_t high = b2 * (n + 1) + (n - 1);
    if (outer.size() < paths.size()) outer.resize(paths.size(), {-1, 0.0});
    double most = 0;
    for (size_t k = 0; k < paths.size(); ++k) {
      CostPath& path = paths[k];
      if (outer[k].first != path.serial) {
        double placed = transfer * path.transfers;
        for (int s = 0; s < r; ++s)
          placed += path.f[s] * f[s] + path.i[s] * i[s] + path.w[s] * w[s];
        for (int s = paired ? mine + 1 : ranks; s < (paired ? stages : mine); ++s)
          placed += path.f[s] * f[s] + path.i[s] * i[s] + path.w[s] * w[s];
        outer[k] = {path.serial, placed};
      }
      double length = outer[k].second + path.f[r] * f[r] + path.i[r] * i[r] + path.w[r] * w[r] +
                      path.f[mine] * f[mine] + path.i[mine] * i[mine] + path.w[mine] * w[mine];
      // The stages [r+1, partner) of the V, or [r+1, p) of the loop, over the first run.
      const int first_end = paired ? mine : ranks;
      length += (path.below_f[first_end] - path.below_f[r + 1]) * least_f[low] +
                (path.below_i[first_end] - path.below_i[r + 1]) * least_i[low] +
                (path.below_w[first_end] - path.below_w[r + 1]) * least_w[low];
      if (!paired)
        length += (path.below_f[stages] - path.below_f[mine + 1]) * least_f[high] +
                  (path.below_i[stages] - path.below_i[mine + 1]) * least_i[high] +
                  (path.below_w[stages] - path.below_w[mine + 1]) * least_w[high];
      if (length > most) most = length, *longest = &path;
    }
    return most;
  }

  struct PairChoice {
    double bound;
    PairedStageBound::Outer next;  // the loop's uses `placed` alone
    int64_t a2, b2;
  };
  void place_pairs(int r, const PairedStageBound::Outer& placed) {
    const int p = ranks, mine = partner(r);
    const int64_t a = r == 0 ? 0 : ranges[r - 1].end;
    const int64_t b =
        paired ? (r == 0 ? n : ranges[mine + 1].begin) : (r == 0 ? middle : ranges[mine - 1].end);
    std::vector<PairChoice> choices;
    std::vector<std::pair<int64_t, double>> outer;
    auto consider = [&](int64_t a2, int64_t b2) {
      // The ranks after r: their pair table.
      // (In the V, inner(p, a2, b2) is finite only where the middle stages meet, a2 = b2.)
      const double rest = paired       ? paired->inner(r + 1, a2, b2)
                          : r == p - 1 ? 0.0
                                       : looped->inner(middle, r + 1, a2, b2);
      if (rest == kInf) return;
      // Slower than the best found whatever rank r's own bound: dropped without it, as
      // drop() would, keeping nothing; most choices at the ranks placed first are.
      if (!out.ranges.empty() && std::max(placed.placed, rest) > out.step * (1 + kSlack)) return;
      PairChoice choice{0, {}, a2, b2};
      if (paired) {
        const PairedStageBound::Placed next = paired->place(r, placed, a, a2, b2, b);
        choice.bound = next.bound, choice.next = next.next;
      } else {
        choice.bound = looped->place(middle, r, placed.placed, a, a2, b, b2, &choice.next.placed);
      }
      if (choice.bound > limit()) {
        drop(choice.bound);  // keeps it for the lower bound when only the ceiling is past
        return;
      }
      choices.push_back(choice);
    };
    if (paired) {
      const int64_t inner_stages = 2 * (p - r - 1);
      for (int64_t a2 = a + 1; a2 + inner_stages < b; ++a2)
        for (int64_t b2 = a2 + inner_stages; b2 < b; ++b2) consider(a2, b2);
    } else if (r == p - 1) {
      consider(middle, n);
    } else {
      for (int64_t a2 = a + 1; a2 <= middle - (p - 1 - r); ++a2)
        for (int64_t b2 = b + 1; b2 <= n - (p - 1 - r); ++b2) consider(a2, b2);
    }
    std::sort(choices.begin(), choices.end(), [](const PairChoice& x, const PairChoice& y) {
      return x.bound != y.bound ? x.bound < y.bound : x.a2 != y.a2 ? x.a2 < y.a2 : x.b2 < y.b2;
    });
    for (const PairChoice& choice : choices) {
      known = 0;                      // no prefix to compare in a tie
      if (drop(choice.bound)) break;  // the rest are no lower
      ranges[r] = {a, choice.a2};
      ranges[mine] = paired ? StageRange{choice.b2, b} : StageRange{b, choice.b2};
      for (int s : {r, mine})
        f[s] = sums.forward.over(ranges[s]), i[s] = sums.input.over(ranges[s]),
        w[s] = sums.weight.over(ranges[s]);
      if (r == p - 1) {
        known = stages;
        finish();
        continue;
      }
      // The remembered critical paths, each later stage at the least F, I and W of a unit
      // it may hold: they see the bubbles of partitions like those simulated.
      CostPath* longest = nullptr;
      const double path = paired_path_bound(r, choice.a2, choice.b2, &longest, outer);
      if (path > choice.bound && drop(path)) {
        touch(longest);
        continue;
      }
      if (exhausted || visits_here >= visit_limit || !affords_run()) {
        exhausted = true;
        leave_open(choice.bound);
        continue;
      }
      ++visits_here, ++out.visits;
      place_pairs(r + 1, choice.next);
    }
    f[r] = i[r] = w[r] = f[mine] = i[mine] = w[mine] = 0;
  }

  // The loop: each middle cut from the least bound up, then its ranks' pairs.
  void place_middles() {
    prepare_looped();
    std::vector<std::pair<double, int64_t>> order;
    for (int64_t m = ranks; m <= n - ranks; ++m) {
      const double least = looped->middle(m);
      if (least > limit()) {
        drop(least);
        continue;
      }
      order.push_back({least, m});
    }
    std::sort(order.begin(), order.end());
    for (const auto& [least, m] : order) {
      known = 0;
      if (drop(least)) break;
      if (exhausted || visits_here >= visit_limit || !affords_run()) {
        exhausted = true;
        leave_open(least);
        continue;
      }
      ++visits_here, ++out.visits;
      middle = m;
      place_pairs(0, {});
    }
  }

  // The loop's pair tables under the best found: a search drops every prefix past it, so a
  // value past it need not be exact (a little above, so that a tie still counts as one).
  void prepare_looped() {
    if (looped) looped->prepare(out.ranges.empty() ? kInf : out.step * (1 + 4 * kSlack));
  }

  // No partition that fits is faster than this: what the searches proved, and the root's
  // bounds once taken.
  double proved = 0;
  bool rooted = false;

  void take_root_bound() {
    if (rooted) return;
    rooted = true;
    std::vector<double> none(stages, 0.0);
    double least =
        RankWork(schedule, replay, 0,
                 relaxed_step(schedule, replay, timed, none, none, none, 0, 0, transfer).extra)
            .level();
    if (one_stage_per_rank) least = std::max(least, completion[0][0]);
    if (paired) least = std::max(least, paired->inner(0, 0, n));
    if (looped) {
      prepare_looped();
      least = std::max(least, looped->least());
    }
    proved = std::max(proved, least);
  }

  // One walk of the tree under `ceiling`; whether it proved the best found the fastest.
  bool walk() {
    least_open = kInf;
    prepare_looped();
    // Under a cap, stage by stage: a prefix's memory is known there, and it prunes the most.
    // The loop's pairs only under a ceiling below the best found: its own-stage bounds fall
    // far short of its step times (7 % at the optimum of bench_planner's 26-unit model at p =
    // 8), which the stage-by-stage bounds (relaxed simulations, critical paths) see, while
    // under a ceiling near the DP's least the pair tables drop nearly every choice (there, at
    // 50 units, 510 prefixes prove a bound above zbv's step time where the stages by stage
    // took 90 thousand).
    if (paired && cap <= 0)
      place_pairs(0, {});
    else if (looped && cap <= 0 && ceiling < out.step)
      place_middles();
    else
      place(0, 0);
    // A prefix left with a bound tied with the best could only have won the tie.
    return least_open == kInf || (!out.ranges.empty() && least_open >= out.step * (1 - kSlack));
  }

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

  void count_dropped(double value) {
    if (!counting || value >= counted_top) return;
    const double at = (value - ceiling) / (counted_top - ceiling) * kBuckets;
    ++dropped_above[std::clamp(static_cast<int>(at), 0, kBuckets - 1)];
  }

  Searched search(const SearchBudget& asked, double asked_ceiling) {
    budget = {asked.simulations * budget_scale, asked.visits, asked.relaxed * budget_scale,
              asked.actions};
    relaxed_here = visits_here = actions_here = 0;
    exhausted = false;
    const bool deepens = cap <= 0 && (paired || (looped && asked_ceiling < out.step));
    if (deepens) take_root_bound();
    if (next_ceiling < 0) next_ceiling = proved;
    const int64_t lower_visits = budget.visits / kLowerShare;
    bool proven = false;
    for (int walks = 0;; ++walks) {
      const double top = std::min(asked_ceiling, out.step);  // kInf while none found
      const bool lower = deepens && walks < kMaxWalks && visits_here < lower_visits && top < kInf &&
                         next_ceiling < top * (1 - kSlack);
      ceiling = lower ? std::max(next_ceiling, proved) : asked_ceiling;
      visit_limit = lower ? lower_visits : visits_here + budget.visits;
      counting = lower, counted_top = top;
      std::fill(dropped_above.begin(), dropped_above.end(), 0);
      const int64_t visits_before = visits_here;
      proven = walk();
      // Not proven: no partition is faster than the least bound left open, or than the best.
      proved = std::max(proved, proven ? out.step : std::min(out.step, least_open));
      if (!lower || proven) break;
      if (exhausted) {
        if (visits_here < visit_limit) break;  // out of simulations or actions
        exhausted = false;  // out of the lower walks' share: the last walk follows
        continue;
      }
      // Where the bounds dropped above this ceiling add up to kGrowth times this walk's
      // visits (the best found, when they never do).
      next_ceiling = top;
      const int64_t wanted = std::max<int64_t>(1, kGrowth * (visits_here - visits_before));
      int64_t taken = 0;
      for (int k = 0; k < kBuckets; ++k)
        if ((taken += dropped_above[k]) >= wanted) {
          next_ceiling = ceiling + (top - ceiling) * (k + 1) / kBuckets;
          break;
        }
    }
    counting = false;
    out.proven = proven || (!out.ranges.empty() && proved >= out.step * (1 - kSlack));
    out.lower_bound = out.proven ? out.step : std::min(out.step, proved);
    out.actions = actions_here;
    simulated_here = 0;
    return out;
  }
};

PartitionSearcher::PartitionSearcher(const Sums& sums, const std::vector<UnitCost>& timed,
                                     const PartitionMemory& memory_of,
                                     const schedule::Schedule& schedule, double cap,
                                     double transfer)
    : impl_(std::make_unique<Impl>(sums, timed, memory_of, schedule, cap, transfer)) {}

PartitionSearcher::~PartitionSearcher() = default;

double PartitionSearcher::root_bound() {
  impl_->take_root_bound();
  return impl_->proved;
}

// Moving one cut by one unit while that helps makes the incumbent nearly optimal, so the
// bounds prune most prefixes: a few simulations bought here save many.
void PartitionSearcher::start_from(const std::vector<StageRange>& incumbent,
                                   int64_t max_simulations) {
  Impl& s = *impl_;
  const int64_t budget = max_simulations * s.budget_scale;
  // Whether `partition` fits and is faster than the best so far.
  auto attempt = [&](const std::vector<StageRange>& partition) {
    if (s.simulated_here >= budget || !s.fits_cap(partition)) return false;
    const double before = s.out.step;
    s.try_partition(partition);
    return s.out.step < before;
  };
  if (!incumbent.empty()) attempt(incumbent);
  // The partition the paired bound is least for: its bound is close to the optimum, so it
  // is often nearly as fast.
  if (s.paired) attempt(s.paired->least_partition());
  if (s.looped) {
    s.prepare_looped();
    const auto least = s.looped->least_partition();
    if (!least.empty()) attempt(least);
  }
  for (bool moved = !s.out.ranges.empty(); moved;) {
    moved = false;
    for (int k = 1; k < s.stages && !moved; ++k)
      for (int delta : {-1, 1}) {
        std::vector<StageRange> next = s.out.ranges;
        next[k - 1].end += delta, next[k].begin += delta;
        if (next[k - 1].end <= next[k - 1].begin || next[k].end <= next[k].begin) continue;
        if (attempt(next)) {
          moved = true;
          break;
        }
      }
  }
}

Searched PartitionSearcher::search(const SearchBudget& budget, double ceiling) {
  return impl_->search(budget, ceiling);
}

const Searched& PartitionSearcher::found() const { return impl_->out; }

Searched search_partition(const Sums& sums, const std::vector<UnitCost>& timed,
                          const PartitionMemory& memory_of, const schedule::Schedule& schedule,
                          double cap, double transfer, const SearchBudget& budget,
                          const std::vector<StageRange>& incumbent) {
  PartitionSearcher searcher(sums, timed, memory_of, schedule, cap, transfer);
  searcher.start_from(incumbent, budget.simulations);
  return searcher.search(budget);
}

// The partition whose largest rank memory is smallest, by the same search over memory: what
// a rank's known stages hold bounds its memory from below. Empty when `max_visits` ran out
// first.
std::vector<StageRange> leanest_partition(const Sums& sums, const PartitionMemory& memory_of,
                                          const schedule::Schedule& schedule, int64_t max_visits) {
  const int64_t n = static_cast<int64_t>(sums.compute.n);
  const int stages = schedule.num_stages();
  const schedule::Placement& placement = schedule.placement;
  if (placement.chunks == 1)
    return min_max_partition(n, stages,
                             [&](int s, int64_t b, int64_t e) { return memory_of.stage(s, b, e); });
  std::vector<StageRange> best, ranges(stages);
  double lowest = kInf;
  int64_t visits = 0;
  std::function<bool(int, int64_t)> place = [&](int k, int64_t b) {
    if (++visits > max_visits) return false;
    const int r = placement.rank_of(k);
    for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e) {
      ranges[k] = {b, e};
      if (memory_of.known_stages(r, ranges, k + 1) >= lowest) break;
      if (k == stages - 1) {
        const auto memory = memory_of(ranges);
        const double peak = *std::max_element(memory.begin(), memory.end());
        if (peak < lowest) lowest = peak, best = ranges;
        break;
      }
      if (!place(k + 1, e)) return false;
    }
    return true;
  };
  return place(0, 0) ? best : std::vector<StageRange>{};
}

}  // namespace conveyor::planning
