#include "engine/pipeline/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>

#include "engine/core/allocator.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/schedule/simulator.h"

namespace conveyor {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string ranges_text(const std::vector<StageRange>& ranges) {
  std::ostringstream out;
  for (size_t s = 0; s < ranges.size(); ++s)
    out << (s ? " " : "") << "[" << ranges[s].begin << "," << ranges[s].end << ")";
  return out.str();
}

// Sums of one per-unit quantity over every range [b, e), each added up in unit order, so a
// stage's total is the same number however it is reached (no prefix differences).
struct Prefix {
  int64_t n = 0;
  std::vector<double> table;  // table[b * (n + 1) + e]
  Prefix(const std::vector<UnitCost>& units, double (*of)(const UnitCost&))
      : n(static_cast<int64_t>(units.size())), table((n + 1) * (n + 1), 0.0) {
    for (int64_t b = 0; b < n; ++b)
      for (int64_t e = b + 1; e <= n; ++e)
        table[b * (n + 1) + e] = table[b * (n + 1) + e - 1] + of(units[e - 1]);
  }
  double over(int64_t begin, int64_t end) const { return table[begin * (n + 1) + end]; }
  double over(const StageRange& r) const { return over(r.begin, r.end); }
};

// Bytes within a billionth of the cap fit: sums taken in another order may differ in the last
// bits, and that must not decide whether a partition runs.
bool fits(double bytes, double cap) { return cap <= 0 || bytes <= cap * (1 + 1e-9); }

struct Sums {
  Prefix compute, activation, state, forward, input, weight;
  std::vector<double> workspace;  // per unit
  explicit Sums(const std::vector<UnitCost>& units)
      : compute(units, [](const UnitCost& u) { return u.compute(); }),
        activation(units, [](const UnitCost& u) { return u.activation_bytes; }),
        state(units, [](const UnitCost& u) { return u.state_bytes; }),
        forward(units, [](const UnitCost& u) { return u.forward; }),
        input(units, [](const UnitCost& u) { return u.backward_input; }),
        weight(units, [](const UnitCost& u) { return u.backward_weight; }) {
    for (const auto& u : units) workspace.push_back(u.workspace_bytes);
  }
  // The largest workspace of units [begin, end): one unit runs at a time.
  double workspace_over(int64_t begin, int64_t end) const {
    return *std::max_element(workspace.begin() + begin, workspace.begin() + end);
  }
};

// Per rank, the largest workspace of the units of its stages.
std::vector<double> workspace_of(const Sums& sums, const std::vector<StageRange>& ranges,
                                 const schedule::Placement& placement) {
  std::vector<double> out(placement.num_ranks, 0.0);
  for (int s = 0; s < static_cast<int>(ranges.size()); ++s) {
    double& w = out[placement.rank_of(s)];
    w = std::max(w, sums.workspace_over(ranges[s].begin, ranges[s].end));
  }
  return out;
}

void check_shape(const std::vector<UnitCost>& units, const schedule::Schedule& schedule) {
  const int stages = schedule.num_stages();
  if (stages < 1) throw PlanError("the schedule has no stages; expected at least one");
  if (static_cast<int64_t>(units.size()) < stages)
    throw PlanError("cannot cut " + std::to_string(units.size()) + " units into " +
                    std::to_string(stages) + " stages: every stage needs a unit; use at most " +
                    std::to_string(units.size()) + " stages");
}

double bottleneck_of(const Sums& sums, const std::vector<StageRange>& ranges,
                     const schedule::Placement& placement) {
  std::vector<double> per_rank(placement.num_ranks, 0.0);
  for (int s = 0; s < static_cast<int>(ranges.size()); ++s)
    per_rank[placement.rank_of(s)] += sums.compute.over(ranges[s]);
  return *std::max_element(per_rank.begin(), per_rank.end());
}

// Where one rank's memory can peak, counted in micro-batches and boundary tensors so that the
// bytes of any stage can be put in: held[i] = (kept, rebuilt, pending) multiplicities of the
// stage's per-micro-batch bytes at one point of the rank's list; transit[i] = (inputs,
// outputs), the boundary tensors at the stage's input and output that wait there to be
// consumed or sent. For a rank holding one stage (chunks == 1).
struct PeakPoints {
  struct Held {
    int kept = 0, rebuilt = 0, pending = 0;
  };
  struct Transit {
    int inputs = 0, outputs = 0;
  };
  std::vector<Held> held;
  std::vector<Transit> transit;
};

PeakPoints peak_points(const std::vector<schedule::Action>& list, int last_stage) {
  using schedule::ActionKind;
  PeakPoints out;
  int kept = 0, split = 0, inputs = 0, outputs = 0;
  for (const auto& a : list) {
    switch (a.kind) {
      case ActionKind::kForward:
        ++kept;
        out.held.push_back({kept, split, split});
        if (a.stage > 0) --inputs;
        if (a.stage < last_stage) ++outputs;
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (a.kind == ActionKind::kBackward) {
          out.held.push_back({kept, split + 1, split + 1});
          --kept;
        } else {
          ++split;
          out.held.push_back({kept, split, split});
        }
        if (a.stage < last_stage) --outputs;
        if (a.stage > 0) ++inputs;
        break;
      case ActionKind::kBackwardWeight:
        --kept, --split;
        break;
      case ActionKind::kSendAct:
      case ActionKind::kRecvGrad:
        outputs += a.kind == ActionKind::kSendAct ? -1 : 1;
        break;
      case ActionKind::kSendGrad:
      case ActionKind::kRecvAct:
        inputs += a.kind == ActionKind::kRecvAct ? 1 : -1;
        break;
      case ActionKind::kAllReduceGrad:  // sums gradients: holds no activation
        break;
    }
    out.transit.push_back({inputs, outputs});
  }
  return out;
}

// Per rank: the boundary tensors waiting on it, in its list order, for the given stage input
// and output bytes (a received activation until its F takes it, an output until it is sent or
// a local F takes it; gradients alike), plus one message per link received early.
std::vector<double> transit_of(const schedule::Schedule& schedule, const std::vector<double>& in,
                               const std::vector<double>& out) {
  using schedule::ActionKind;
  const int last = schedule.num_stages() - 1;
  std::vector<double> peaks(schedule.ranks.size(), 0.0);
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    double now = 0;
    for (const auto& a : schedule.ranks[r]) {
      const auto s = static_cast<size_t>(a.stage);
      switch (a.kind) {
        case ActionKind::kForward:
          if (a.stage > 0) now -= in[s];
          if (a.stage < last) now += out[s];
          break;
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput:
          if (a.stage < last) now -= out[s];
          if (a.stage > 0) now += in[s];
          break;
        case ActionKind::kBackwardWeight:
          break;
        case ActionKind::kSendAct:
          now -= out[s];
          break;
        case ActionKind::kRecvGrad:
          now += out[s];
          break;
        case ActionKind::kSendGrad:
          now -= in[s];
          break;
        case ActionKind::kRecvAct:
          now += in[s];
          break;
        case ActionKind::kAllReduceGrad:  // sums gradients: holds no activation
          break;
      }
      peaks[r] = std::max(peaks[r], now);
    }
  }
  // Receives run as soon as their message has arrived, ahead of the list: one more message
  // per link and direction.
  for (int s = 0; s <= last; ++s) {
    double& peak = peaks[static_cast<size_t>(schedule.placement.rank_of(s))];
    if (s > 0) peak += in[static_cast<size_t>(s)];
    if (s < last) peak += out[static_cast<size_t>(s)];
  }
  return peaks;
}

// Per rank memory of a partition: the state of its units, the activations its stages hold at
// the peak (with recomputed units their kept inputs and rebuilds, with a split backward what
// I leaves for W), the boundary tensors waiting, and its largest unit workspace.
struct MemoryModel {
  const Sums& sums;
  const std::vector<UnitCost>& units;
  const std::vector<bool>& recomputed;
  const schedule::Schedule& schedule;
  std::vector<PeakPoints> points;  // per rank, when every rank holds one stage

  MemoryModel(const Sums& sums, const std::vector<UnitCost>& units,
              const std::vector<bool>& recomputed, const schedule::Schedule& schedule)
      : sums(sums), units(units), recomputed(recomputed), schedule(schedule) {
    if (schedule.placement.chunks == 1)
      for (const auto& list : schedule.ranks)
        points.push_back(peak_points(list, schedule.num_stages() - 1));
  }

  std::vector<StageActivationBytes> activations(const std::vector<StageRange>& ranges) const {
    std::vector<double> saved, input, pending;
    for (const auto& u : units)
      saved.push_back(u.activation_bytes), input.push_back(u.input_bytes),
          pending.push_back(u.weight_pending_bytes);
    return stage_activation_bytes(saved, input, ranges, recomputed, pending);
  }
  // The boundary tensor entering unit `u` (none past the last unit).
  double boundary(int64_t u) const {
    return u < static_cast<int64_t>(units.size()) ? units[static_cast<size_t>(u)].input_bytes : 0.0;
  }

  std::vector<double> operator()(const std::vector<StageRange>& ranges) const {
    const auto held = peak_activation_bytes(schedule, activations(ranges), true);
    std::vector<double> in, out;
    for (const auto& r : ranges) in.push_back(boundary(r.begin)), out.push_back(boundary(r.end));
    const auto transit = transit_of(schedule, in, out);
    const auto workspace = workspace_of(sums, ranges, schedule.placement);
    std::vector<double> bytes(schedule.num_ranks(), 0.0);
    for (int s = 0; s < static_cast<int>(ranges.size()); ++s)
      bytes[schedule.placement.rank_of(s)] += sums.state.over(ranges[s]);
    for (int r = 0; r < schedule.num_ranks(); ++r) bytes[r] += held[r] + transit[r] + workspace[r];
    return bytes;
  }
  // Stage s of units [b, e) on a rank that holds only it (chunks == 1).
  double stage(int s, int64_t b, int64_t e) const {
    const StageActivationBytes a = activations({{b, e}})[0];
    const PeakPoints& p = points[static_cast<size_t>(schedule.placement.rank_of(s))];
    double held = 0, transit = 0;
    for (const auto& h : p.held)
      held = std::max(held, h.kept * a.kept + h.rebuilt * a.rebuilt + h.pending * a.weight_pending);
    const double in = boundary(b), out = boundary(e);
    for (const auto& t : p.transit) transit = std::max(transit, t.inputs * in + t.outputs * out);
    transit += (s > 0 ? in : 0.0) + (s < schedule.num_stages() - 1 ? out : 0.0);  // as transit_of
    return sums.state.over(b, e) + held + transit + sums.workspace_over(b, e);
  }
};

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
};

// The simulated step time when stages [0, known) cost f, i and w and each later stage only the
// least F, I and W of the units its first unit may be (the prefix ends at unit `end`, so stage
// j >= known starts within [end + j - known, n - stages + j]). With every rank's list fixed,
// the simulator's times are maxima and sums of the costs (no choice among ready actions
// depends on them), so they never decrease when a cost grows: this bounds from below the step
// time of every partition that begins with the known stages, bubbles included.
double relaxed_step(const schedule::Schedule& schedule, const std::vector<UnitCost>& timed,
                    const std::vector<double>& f, const std::vector<double>& i,
                    const std::vector<double>& w, int known, int64_t end, double transfer) {
  const int stages = schedule.num_stages();
  const int64_t n = static_cast<int64_t>(timed.size());
  schedule::CostModel costs;
  costs.forward.assign(f.begin(), f.begin() + known);
  costs.backward_input.assign(i.begin(), i.begin() + known);
  costs.backward_weight.assign(w.begin(), w.begin() + known);
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
  }
  costs.latency = transfer;
  return schedule::simulate(schedule, costs).makespan;
}

// Pruned comparisons leave a billionth of slack: the simulator adds times in another order,
// and a bound a few ulps over a tie must not hide it.
constexpr double kSlack = 1e-9;

// Whether partition a (step time, bottleneck, ranges) is preferred to b: faster, then more
// balanced, then the earlier cuts, so that ties are decided the same way every time.
bool preferred(double step_a, double bottleneck_a, const std::vector<StageRange>& a,
               double step_b, double bottleneck_b, const std::vector<StageRange>& b) {
  if (step_a != step_b) return step_a < step_b;
  if (bottleneck_a != bottleneck_b) return bottleneck_a < bottleneck_b;
  for (size_t s = 0; s < a.size() && s < b.size(); ++s)
    if (a[s].begin != b[s].begin) return a[s].begin < b[s].begin;
  return false;
}

struct Searched {
  std::vector<StageRange> ranges;  // empty: none fits
  double step = kInf;
  bool proven = true;  // false: a budget ran out before every partition was ruled out
  int64_t simulated = 0;
  int64_t relaxed = 0;  // relaxed simulations of prefixes (relaxed_step)
};

// Branch and bound over the contiguous partitions, stage by stage: a prefix is dropped when a
// rank's bound (StepBound), the least the remaining units add to the ranks still to come, or
// the prefix's relaxed simulation (relaxed_step, at most `max_relaxed` of them) already
// exceeds the best simulated step time, or when it overflows the cap; each complete
// partition that survives and fits is simulated. Exact for the simulated step time: a dropped
// partition is slower than one already simulated. `incumbent` (may be empty) is tried first.
Searched search_partition(const Sums& sums, const std::vector<UnitCost>& timed,
                          const MemoryModel& memory_of, const schedule::Schedule& schedule,
                          double cap, double transfer, int64_t max_simulations,
                          int64_t max_visits, int64_t max_relaxed,
                          const std::vector<StageRange>& incumbent) {
  const int64_t n = static_cast<int64_t>(timed.size());
  const int stages = schedule.num_stages(), ranks = schedule.num_ranks();
  const schedule::Placement& placement = schedule.placement;
  const bool one_stage_per_rank = placement.chunks == 1;
  const StepBound bound(schedule);
  Searched out;
  double best_bottleneck = kInf;
  int64_t visits = 0;

  auto fits_cap = [&](const std::vector<StageRange>& ranges) {
    const auto memory = memory_of(ranges);
    return fits(*std::max_element(memory.begin(), memory.end()), cap);
  };
  auto try_partition = [&](const std::vector<StageRange>& ranges) {
    if (out.simulated >= max_simulations) return void(out.proven = false);
    ++out.simulated;
    const double step =
        schedule::simulate(schedule, cost_model(timed, ranges, transfer)).makespan;
    const double bottleneck = bottleneck_of(sums, ranges, placement);
    if (out.ranges.empty() ||
        preferred(step, bottleneck, ranges, out.step, best_bottleneck, out.ranges))
      out.ranges = ranges, out.step = step, best_bottleneck = bottleneck;
  };
  if (!incumbent.empty() && fits_cap(incumbent)) try_partition(incumbent);
  // Moving one cut by one unit while that helps makes the incumbent nearly optimal, so the
  // bounds below prune most prefixes: a few simulations bought here save many.
  for (bool moved = !out.ranges.empty(); moved && out.proven;) {
    moved = false;
    for (int k = 1; k < stages && !moved && out.proven; ++k)
      for (int delta : {-1, 1}) {
        std::vector<StageRange> next = out.ranges;
        next[k - 1].end += delta, next[k].begin += delta;
        if (next[k - 1].end <= next[k - 1].begin || next[k].end <= next[k].begin) continue;
        if (!fits_cap(next)) continue;
        const double before = out.step;
        try_partition(next);
        if (out.step < before) {
          moved = true;
          break;
        }
      }
  }

  // Whether stage k of units [b, e) fits, remembered: the search asks again for every prefix.
  std::vector<int8_t> stage_fit(one_stage_per_rank && cap > 0 ? stages * (n + 1) * (n + 1) : 0, -1);
  auto stage_fits = [&](int k, int64_t b, int64_t e) {
    if (stage_fit.empty()) return true;
    int8_t& known = stage_fit[(k * (n + 1) + b) * (n + 1) + e];
    if (known < 0) known = fits(memory_of.stage(k, b, e), cap) ? 1 : 0;
    return known == 1;
  };
  std::vector<double> f(stages, 0.0), i(stages, 0.0), w(stages, 0.0), state(ranks, 0.0);
  std::vector<StageRange> ranges(stages);
  auto limit = [&] { return out.ranges.empty() ? kInf : out.step * (1 + kSlack); };
  // The least largest busy time of the ranks holding stages after `k`, when the units [e, n)
  // are still to be spread over them (water filling over their busy times so far).
  auto remaining = [&](int k, int64_t e) {
    std::vector<double> levels;
    for (int r = 0; r < ranks; ++r)
      if (std::any_of(bound.own[r].begin(), bound.own[r].end(), [&](int s) { return s > k; }))
        levels.push_back(bound.busy(r, f, i, w, k + 1));
    std::sort(levels.begin(), levels.end());
    double water = bound.multiple * sums.compute.over(e, n), level = levels.front();
    size_t under = 1;
    for (; under < levels.size() && water >= (levels[under] - level) * under; ++under)
      water -= (levels[under] - level) * under, level = levels[under];
    return level + water / under + sums.forward.over(0, e) * (one_stage_per_rank ? 1 : 0);
  };
  std::function<void(int, int64_t)> place = [&](int k, int64_t b) {
    if (!out.proven) return;
    if (++visits > max_visits) return void(out.proven = false);
    const int r = placement.rank_of(k);
    const int64_t last_end = k == stages - 1 ? n : n - (stages - 1 - k);
    for (int64_t e = k == stages - 1 ? n : b + 1; e <= last_end && out.proven; ++e) {
      // One stage per rank: the stage's memory is its own, checked here. Several: a rank's
      // state only grows with more units, so past the cap no longer cut helps.
      if (one_stage_per_rank && !stage_fits(k, b, e)) continue;
      if (!one_stage_per_rank && !fits(state[r] + sums.state.over(b, e), cap)) break;
      ranges[k] = {b, e};
      f[k] = sums.forward.over(b, e), i[k] = sums.input.over(b, e), w[k] = sums.weight.over(b, e);
      // The rank's bound only grows with e: past the best step time, stop.
      if (bound.rank(r, f, i, w, k + 1) > limit()) break;
      if (k == stages - 1) {
        bool within = true;
        for (int q = 0; q < ranks && within; ++q) within = bound.rank(q, f, i, w, stages) <= limit();
        if (within && (one_stage_per_rank || fits_cap(ranges))) try_partition(ranges);
        break;
      }
      // Too few units here leave too much for the rest: try a later cut.
      if (remaining(k, e) > limit()) continue;
      // The relaxed simulation sees the bubble the sums above miss. It only grows with e
      // (each later stage's least unit is taken over fewer units), so past the limit, stop.
      // Only in the first half of the stages, where a prune drops the most partitions per
      // simulation (measured: as many proven as at every depth, in half the time); never next
      // to the last stage, whose one completion is simulated anyway.
      if (k + 2 < stages && 2 * k < stages && out.relaxed < max_relaxed) {
        ++out.relaxed;
        if (relaxed_step(schedule, timed, f, i, w, k + 1, e, transfer) > limit()) break;
      }
      state[r] += sums.state.over(b, e);
      place(k + 1, e);
      state[r] -= sums.state.over(b, e);
    }
    f[k] = i[k] = w[k] = 0;
  };
  place(0, 0);
  return out;
}

// The partition whose largest rank memory is smallest, by the same search over memory: a
// rank's state bounds its memory from below. Empty when `max_visits` ran out first.
std::vector<StageRange> leanest_partition(const Sums& sums, const MemoryModel& memory_of,
                                          const schedule::Schedule& schedule, int64_t max_visits) {
  const int64_t n = static_cast<int64_t>(sums.compute.n);
  const int stages = schedule.num_stages();
  const schedule::Placement& placement = schedule.placement;
  if (placement.chunks == 1)
    return min_max_partition(n, stages, [&](int s, int64_t b, int64_t e) {
      return memory_of.stage(s, b, e);
    });
  std::vector<StageRange> best, ranges(stages);
  std::vector<double> state(schedule.num_ranks(), 0.0);
  double lowest = kInf;
  int64_t visits = 0;
  std::function<bool(int, int64_t)> place = [&](int k, int64_t b) {
    if (++visits > max_visits) return false;
    const int r = placement.rank_of(k);
    for (int64_t e = k == stages - 1 ? n : b + 1; e <= n - (stages - 1 - k); ++e) {
      if (state[r] + sums.state.over(b, e) >= lowest) break;
      ranges[k] = {b, e};
      if (k == stages - 1) {
        const auto memory = memory_of(ranges);
        const double peak = *std::max_element(memory.begin(), memory.end());
        if (peak < lowest) lowest = peak, best = ranges;
        break;
      }
      state[r] += sums.state.over(b, e);
      const bool finished = place(k + 1, e);
      state[r] -= sums.state.over(b, e);
      if (!finished) return false;
    }
    return true;
  };
  return place(0, 0) ? best : std::vector<StageRange>{};
}

// The same schedule with `ranks` ranks, when it is one the generators make (by its name).
std::optional<schedule::Schedule> with_ranks(const schedule::Schedule& schedule, int ranks) {
  const auto kind = schedule::parse_schedule_kind(schedule.name);
  if (!kind) return std::nullopt;
  try {
    return schedule::generate(*kind, ranks, schedule.num_microbatches, schedule.placement.chunks);
  } catch (const schedule::ScheduleError&) {
    return std::nullopt;  // not defined for these values (interleaved needs m % p == 0)
  }
}

// The fewest ranks, up to four times as many, on which some partition fits the cap; 0: none.
int ranks_that_fit(const std::vector<UnitCost>& timed, const Sums& sums,
                   const std::vector<bool>& recomputed, const schedule::Schedule& schedule,
                   double cap) {
  const int64_t n = static_cast<int64_t>(timed.size());
  for (int p = schedule.num_ranks() + 1; p <= 4 * schedule.num_ranks(); ++p) {
    if (static_cast<int64_t>(p) * schedule.placement.chunks > n) break;
    const auto more = with_ranks(schedule, p);
    if (!more) continue;
    const MemoryModel memory_of(sums, timed, recomputed, *more);
    const auto lean = leanest_partition(sums, memory_of, *more, 2000);
    if (lean.empty()) continue;
    const auto memory = memory_of(lean);
    if (fits(*std::max_element(memory.begin(), memory.end()), cap)) return p;
  }
  return 0;
}

std::string stages_text(const schedule::Placement& placement, int rank) {
  const auto stages = placement.stages_of(rank);
  std::string out = stages.size() == 1 ? "stage " : "stages ";
  for (size_t k = 0; k < stages.size(); ++k)
    out += (k == 0 ? "" : k + 1 == stages.size() ? " and " : ", ") + std::to_string(stages[k]);
  return out;
}

[[noreturn]] void throw_no_fit(const std::vector<UnitCost>& timed, const Sums& sums,
                               const MemoryModel& memory_of, const schedule::Schedule& schedule,
                               double cap, const std::vector<StageRange>& balanced) {
  const auto memory = memory_of(balanced);
  const int worst =
      static_cast<int>(std::max_element(memory.begin(), memory.end()) - memory.begin());
  const auto held = schedule::in_flight_per_rank(schedule);
  const auto leanest = leanest_partition(sums, memory_of, schedule, 20000);
  const int more = ranks_that_fit(timed, sums, memory_of.recomputed, schedule, cap);
  std::ostringstream out;
  out << "no partition of " << timed.size() << " units into " << schedule.num_stages()
      << " stages fits " << bytes_text(cap) << " per device under " << schedule.name << " with "
      << schedule.num_microbatches << " micro-batches: in the most balanced partition "
      << ranges_text(balanced) << " rank " << worst << " ("
      << stages_text(schedule.placement, worst) << ") needs " << bytes_text(memory[worst]) << " ("
      << held[worst].peak_held << " micro-batches held), " << bytes_text(memory[worst] - cap)
      << " over";
  if (!leanest.empty()) {
    const auto lean = memory_of(leanest);
    out << "; the smallest cap any partition fits is "
        << bytes_text(*std::max_element(lean.begin(), lean.end())) << " ("
        << ranges_text(leanest) << ")";
  }
  out << "; ";
  if (more > 0) {
    out << "with " << more * schedule.placement.chunks << " stages";
    if (schedule.placement.chunks > 1) out << " (" << more << " ranks)";
    out << " every rank fits; or ";
  }
  out << "raise the cap, pick a schedule that holds fewer micro-batches"
      << (memory_of.recomputed.empty() ? " or recompute activations" : "");
  throw PlanError(out.str());
}

}  // namespace

std::vector<double> rank_memory(const std::vector<UnitCost>& units,
                                const std::vector<StageRange>& ranges,
                                const schedule::Schedule& schedule,
                                const std::vector<bool>& recomputed) {
  const Sums sums(units);
  return MemoryModel(sums, units, recomputed, schedule)(ranges);
}

std::vector<UnitCost> with_recompute_time(const std::vector<UnitCost>& units,
                                          const std::vector<bool>& recomputed) {
  std::vector<UnitCost> out = units;
  for (size_t u = 0; u < out.size() && u < recomputed.size(); ++u)
    if (recomputed[u]) out[u].backward_input += out[u].forward;
  return out;
}

std::vector<int64_t> blocks_of(const std::vector<StageRange>& ranges) {
  std::vector<int64_t> blocks;
  for (size_t s = 0; s < ranges.size(); ++s)
    blocks.push_back(ranges[s].end - ranges[s].begin - (s == 0 ? 1 : 0) -
                     (s + 1 == ranges.size() ? 1 : 0));
  return blocks;
}

PartitionChoice best_partition(const std::vector<UnitCost>& units,
                               const schedule::Schedule& schedule,
                               const PartitionSearch& search) {
  check_shape(units, schedule);
  const std::vector<bool>& recomputed = search.recomputed;
  if (!recomputed.empty() && recomputed.size() != units.size())
    throw PlanError("recomputation marks " + std::to_string(recomputed.size()) +
                    " units of a cost table of " + std::to_string(units.size()) +
                    "; expected one mark per unit");
  if (search.memory_cap < 0)
    throw PlanError("memory cap " + std::to_string(search.memory_cap) +
                    " is negative; expected bytes > 0, or 0 for no cap");
  if (search.max_simulations < 1)
    throw PlanError("a search budget of " + std::to_string(search.max_simulations) +
                    " simulations; expected at least 1");
  const double cap = search.memory_cap;
  const std::vector<UnitCost> timed = with_recompute_time(units, recomputed);
  const Sums sums(timed);
  const MemoryModel memory_of(sums, timed, recomputed, schedule);
  const int64_t n = static_cast<int64_t>(units.size());
  const int stages = schedule.num_stages();
  const schedule::Placement& placement = schedule.placement;

  // The first incumbent: the smallest largest stage compute (F + I + W), within the cap per
  // stage when each rank holds one stage. Close to the optimum, so the bounds prune early.
  const auto compute = [&](int, int64_t b, int64_t e) { return sums.compute.over(b, e); };
  std::vector<StageRange> balanced = min_max_partition(n, stages, compute), incumbent = balanced;
  if (placement.chunks == 1)
    incumbent = min_max_partition(n, stages, [&](int s, int64_t b, int64_t e) {
      return fits(memory_of.stage(s, b, e), cap) ? sums.compute.over(b, e) : kInf;
    });
  const Searched found = search_partition(sums, timed, memory_of, schedule, cap,
                                          search.transfer_seconds, search.max_simulations,
                                          search.max_simulations * 20,
                                          search.max_simulations, incumbent);
  if (found.ranges.empty()) {
    if (found.proven) throw_no_fit(timed, sums, memory_of, schedule, cap, balanced);
    throw PlanError("no partition of " + std::to_string(n) + " units into " +
                    std::to_string(stages) + " stages fitting " + bytes_text(cap) +
                    " was found within " + std::to_string(search.max_simulations) +
                    " simulated partitions; raise the search budget or the cap");
  }
  PartitionChoice out;
  out.ranges = found.ranges;
  out.bottleneck = bottleneck_of(sums, found.ranges, placement);
  out.rank_bytes = memory_of(found.ranges);
  out.step_seconds = found.step;
  out.proven = found.proven;
  out.simulated = found.simulated;
  return out;
}

const PlanCandidate& Plan::best() const {
  for (const auto& c : candidates)
    if (c.rejected.empty()) return c;
  std::string why;
  for (const auto& c : candidates) why += "\n  " + c.layout + ": " + c.rejected;
  throw PlanError("no layout fits:" + why);
}

namespace {

std::vector<UnitCost> scaled(const std::vector<UnitCost>& units, double factor) {
  std::vector<UnitCost> out = units;
  for (auto& u : out) {
    u.forward *= factor;
    u.backward_input *= factor;
    u.backward_weight *= factor;
    u.activation_bytes *= factor;
    u.input_bytes *= factor;
  }
  return out;
}

void check_options(const UnitCosts& costs, const PlanOptions& options) {
  if (costs.units.size() < 2)
    throw PlanError("the cost table has " + std::to_string(costs.units.size()) +
                    " units; a model has at least 2 (the first and the loss head)");
  if (costs.microbatch_tokens < 1)
    throw PlanError("the costs were measured at " + std::to_string(costs.microbatch_tokens) +
                    " tokens per micro-batch; expected at least 1");
  if (options.num_ranks < 1)
    throw PlanError("planning for " + std::to_string(options.num_ranks) +
                    " devices; expected at least 1");
  if (options.batch_tokens < 1)
    throw PlanError("batch of " + std::to_string(options.batch_tokens) +
                    " tokens; expected at least 1");
}

// Every device a replica of the whole model; with `shard_optimizer` each keeps 1/p of the
// optimizer state (ZeRO stage 1, --shard-optimizer). Its traffic is a reduce-scatter of the
// gradients and an all-gather of the updated weights, p - 1 ring steps of 1/p of them each:
// the 2(p - 1) steps of the ring all-reduce it replaces, so the step time is the same.
PlanCandidate data_parallel(const UnitCosts& costs, const PlanOptions& options,
                            bool shard_optimizer) {
  const int p = options.num_ranks;
  PlanCandidate c;
  c.layout = "data-parallel x" + std::to_string(p);
  c.pipelined = false;
  c.shard_optimizer = shard_optimizer;
  c.ranges = {{0, static_cast<int64_t>(costs.units.size())}};
  if (options.batch_tokens % p != 0) {
    c.rejected = "the batch of " + std::to_string(options.batch_tokens) +
                 " tokens does not split into " + std::to_string(p) + " equal replicas";
    return c;
  }
  const int64_t replica_tokens = options.batch_tokens / p;
  double state = 0, parameters = 0, compute = 0, activation = 0;
  for (const auto& u : costs.units)
    state += u.state_bytes - (shard_optimizer ? u.optimizer_bytes * (p - 1) / p : 0.0),
        parameters += u.parameter_bytes, compute += u.compute(), activation += u.activation_bytes;
  // Each replica runs its share one micro-batch after another, accumulating gradients; the
  // fewest micro-batches whose activations fit.
  const double per_token = 1.0 / static_cast<double>(costs.microbatch_tokens);
  c.microbatches = 0;
  for (int m = 1; m <= replica_tokens; ++m) {
    if (replica_tokens % m) continue;
    const double bytes = state + activation * per_token * static_cast<double>(replica_tokens / m);
    if (fits(bytes, options.memory_cap)) {
      c.microbatches = m;
      c.peak_bytes = std::vector<double>(p, bytes);
      break;
    }
  }
  if (c.microbatches == 0) {
    c.short_of_memory = true;
    c.rejected = "the model's state alone (" + bytes_text(state) + ") does not fit the cap of " +
                 bytes_text(options.memory_cap) + " on one device";
    c.peak_bytes = std::vector<double>(p, state);
    return c;
  }
  // Ring all-reduce of the gradients: 2(p-1) steps, each moving 1/p of them.
  const double reduce =
      p == 1 ? 0.0
             : 2.0 * (p - 1) *
                   (options.allreduce_latency + (options.allreduce_bandwidth > 0
                                                     ? parameters / p / options.allreduce_bandwidth
                                                     : 0.0));
  c.step_seconds = compute * per_token * static_cast<double>(replica_tokens) + reduce;
  c.bubble = c.step_seconds > 0 ? reduce / c.step_seconds : 0.0;
  return c;
}

}  // namespace

Plan plan(const UnitCosts& costs, const PlanOptions& options) {
  return plan(std::vector<UnitCosts>{costs}, options);
}

Plan plan(const std::vector<UnitCosts>& measured, const PlanOptions& options) {
  if (measured.empty()) throw PlanError("no cost table to plan from; profile the model first");
  for (const auto& table : measured) {
    check_options(table, options);
    if (table.units.size() != measured[0].units.size())
      throw PlanError("cost tables of " + std::to_string(measured[0].units.size()) + " and " +
                      std::to_string(table.units.size()) +
                      " units; every table must describe the same model");
  }
  auto nearest = [&](int64_t tokens) -> const UnitCosts& {
    const UnitCosts* best = &measured[0];
    for (const auto& table : measured)
      if (std::llabs(table.microbatch_tokens - tokens) <
          std::llabs(best->microbatch_tokens - tokens))
        best = &table;
    return *best;
  };
  const int p = options.num_ranks;
  std::vector<int> counts = options.microbatch_counts;
  if (counts.empty())
    for (int m : {p, 2 * p, 4 * p, 8 * p}) counts.push_back(m);
  Plan out;
  struct Kind {
    schedule::ScheduleKind kind;
    int chunks;
  };
  std::vector<Kind> kinds = {{schedule::ScheduleKind::kGPipe, 1},
                             {schedule::ScheduleKind::k1F1B, 1},
                             {schedule::ScheduleKind::kZBH1, 1},
                             {schedule::ScheduleKind::kZBV, 2}};
  for (int v : options.interleaved_chunks)
    if (v >= 2) kinds.push_back({schedule::ScheduleKind::kInterleaved, v});
  for (int m : counts) {
    if (m < 1 || options.batch_tokens % m != 0) continue;
    const UnitCosts& costs = nearest(options.batch_tokens / m);
    const double factor = static_cast<double>(options.batch_tokens / m) /
                          static_cast<double>(costs.microbatch_tokens);
    auto units = scaled(costs.units, factor);
    // The step's token ids live where the first stage does, its targets and per-token losses
    // (one tensor per micro-batch) where the last one does, for the whole step.
    const auto round = [](int64_t bytes) {
      return static_cast<double>(CachingAllocator::round_size(static_cast<size_t>(bytes)));
    };
    const double ids = round(options.batch_tokens * 4);
    units.front().state_bytes += ids;
    units.back().state_bytes += ids + m * round(options.batch_tokens / m * 4);
    for (const auto& k : kinds) {
      if (p == 1 && k.kind != schedule::ScheduleKind::k1F1B) continue;
      schedule::Schedule sched;
      try {
        sched = schedule::generate(k.kind, p, m, k.chunks);
      } catch (const schedule::ScheduleError&) {
        continue;  // not defined for these values (interleaved needs m % p == 0)
      }
      if (sched.num_stages() > static_cast<int>(units.size())) continue;
      auto candidate = [&](const RecomputeSpec& recompute) {
        PlanCandidate c;
        c.kind = k.kind;
        c.chunks = k.chunks;
        c.microbatches = m;
        c.recompute = recompute;
        c.layout = schedule::schedule_kind_name(k.kind);
        if (k.kind == schedule::ScheduleKind::kInterleaved)
          c.layout += " v=" + std::to_string(k.chunks);
        try {
          const std::vector<bool> marks =
              recompute.any() ? recompute.per_unit(static_cast<int64_t>(units.size()))
                              : std::vector<bool>{};
          PartitionSearch search;
          search.memory_cap = options.memory_cap;
          search.recomputed = marks;
          search.transfer_seconds = costs.transfer_seconds * factor;
          const PartitionChoice choice = best_partition(units, sched, search);
          c.ranges = choice.ranges;
          c.partition_proven = choice.proven;
          c.peak_bytes = choice.rank_bytes;
          const auto sim =
              schedule::simulate(sched, cost_model(with_recompute_time(units, marks), choice.ranges,
                                                   costs.transfer_seconds * factor));
          c.step_seconds = sim.makespan;
          c.bubble = sim.bubble_fraction;
          for (const auto& rank : sim.ranks) c.busy_seconds.push_back(rank.busy);
        } catch (const std::invalid_argument& e) {  // PlanError, or units out of range
          c.rejected = e.what();
        }
        return c;
      };
      PlanCandidate c = candidate(options.recompute);
      // Short of memory: the same layout recomputing every unit may fit.
      const bool retry =
          !c.rejected.empty() && !options.recompute.any() && options.recompute_when_short;
      out.candidates.push_back(std::move(c));
      if (retry) out.candidates.push_back(candidate(RecomputeSpec::every_unit()));
    }
  }
  if (options.include_data_parallel && p > 1) {
    const UnitCosts& costs = nearest(options.batch_tokens / p);
    PlanCandidate replicas = data_parallel(costs, options, false);
    // Short of memory: replicas that share the optimizer state may fit.
    double optimizer = 0;
    for (const auto& u : costs.units) optimizer += u.optimizer_bytes;
    const bool retry = replicas.short_of_memory && optimizer > 0;
    out.candidates.push_back(std::move(replicas));
    if (retry) out.candidates.push_back(data_parallel(costs, options, true));
  }
  std::stable_sort(out.candidates.begin(), out.candidates.end(),
                   [](const PlanCandidate& a, const PlanCandidate& b) {
                     if (a.rejected.empty() != b.rejected.empty()) return a.rejected.empty();
                     return a.step_seconds < b.step_seconds;
                   });
  return out;
}

std::string format_plan(const Plan& plan) {
  std::ostringstream out;
  out << std::left << std::setw(5) << "rank" << std::setw(20) << "layout" << std::right
      << std::setw(5) << "m" << std::setw(14) << "step (ms)" << std::setw(9) << "bubble"
      << "  " << std::left << std::setw(11) << "recompute"
      << "peak memory per rank / partition\n";
  int rank = 0;
  for (const auto& c : plan.candidates) {
    std::ostringstream memory;
    for (size_t r = 0; r < c.peak_bytes.size(); ++r)
      memory << (r ? " " : "") << bytes_text(c.peak_bytes[r]);
    out << std::left << std::setw(5) << (c.rejected.empty() ? std::to_string(++rank) : "-")
        << std::setw(20) << c.layout << std::right << std::setw(5)
        << (c.microbatches > 0 ? std::to_string(c.microbatches) : "-");
    if (c.rejected.empty()) {
      out << std::fixed << std::setprecision(3) << std::setw(14) << c.step_seconds * 1e3
          << std::setprecision(1) << std::setw(8) << c.bubble * 100 << "%  " << std::left
          << std::setw(11) << (c.pipelined ? to_string(c.recompute) : "none") << std::right
          << memory.str() << " / "
          << (c.pipelined         ? ranges_text(c.ranges)
              : c.shard_optimizer ? "whole model on every device, optimizer state sharded "
                                    "(--shard-optimizer)"
                                  : "whole model on every device")
          << (c.partition_proven ? "" : " (not proven fastest: the partition search ran out of budget)")
          << "\n";
    } else {
      out << "  does not fit" << (c.recompute.any() ? " recomputing " + to_string(c.recompute) : "")
          << (c.shard_optimizer ? " sharing the optimizer state" : "") << ": " << c.rejected
          << "\n";
    }
  }
  const PlanCandidate* best_pipe = nullptr;
  const PlanCandidate* dp = nullptr;
  for (const auto& c : plan.candidates) {
    if (!c.rejected.empty()) continue;
    if (c.pipelined && !best_pipe) best_pipe = &c;
    if (!c.pipelined && !dp) dp = &c;
  }
  const std::string replicas =
      dp ? dp->layout +
               (dp->shard_optimizer ? " sharing the optimizer state (--shard-optimizer)" : "")
         : std::string();
  if (dp && !best_pipe)
    out << "no pipeline layout fits; " << replicas << " does\n";
  else if (dp && dp->step_seconds <= best_pipe->step_seconds)
    out << "pipelining loses for this model and batch: " << replicas
        << " is faster than the best pipeline (" << best_pipe->layout << ")\n";
  return out.str();
}

}  // namespace conveyor
