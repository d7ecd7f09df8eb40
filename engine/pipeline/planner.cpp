#include "engine/pipeline/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <memory>
#include <optional>
#include <sstream>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/partition_search.h"
#include "engine/schedule/simulator.h"

namespace conveyor {
namespace {

using namespace planning;

std::string ranges_text(const std::vector<StageRange>& ranges) {
  std::ostringstream out;
  for (size_t s = 0; s < ranges.size(); ++s)
    out << (s ? " " : "") << "[" << ranges[s].begin << "," << ranges[s].end << ")";
  return out.str();
}

void check_shape(const std::vector<UnitCost>& units, const schedule::Schedule& schedule) {
  const int stages = schedule.num_stages();
  if (stages < 1) throw PlanError("the schedule has no stages; expected at least one");
  if (static_cast<int64_t>(units.size()) < stages)
    throw PlanError("cannot cut " + std::to_string(units.size()) + " units into " +
                    std::to_string(stages) + " stages: every stage needs a unit; use at most " +
                    std::to_string(units.size()) + " stages");
}

// Where one rank's memory can peak, counted in micro-batches and boundary tensors so that the
// bytes of any partition can be put in. At each point of the rank's list: held[j] = (kept,
// rebuilt, pending, forward), how many micro-batches' bytes of its j-th stage are held there (until
// W, as the planner counts them); transit[j] = (inputs, outputs), how many boundary tensors at that
// stage's input and output wait there to be consumed or sent (the list start counts, with none). A
// point another one holds at least as many of everywhere is left out: with bytes
// >= 0 it never holds more.
struct RankPeaks {
  struct Held {
    int kept = 0, rebuilt = 0, pending = 0, forward = 0;
    bool operator<=(const Held& o) const {
      return kept <= o.kept && rebuilt <= o.rebuilt && pending <= o.pending && forward <= o.forward;
    }
  };
  struct Transit {
    int inputs = 0, outputs = 0;
    bool operator<=(const Transit& o) const { return inputs <= o.inputs && outputs <= o.outputs; }
  };
  std::vector<int> stages;                    // the rank's, ascending
  std::vector<std::vector<Held>> held;        // [point][index in stages]
  std::vector<std::vector<Transit>> transit;  // [point][index in stages]
};

// Adds `point` to `points` unless one there holds at least as much everywhere; drops those it
// holds at least as much as.
template <typename Count>
void add_peak(std::vector<std::vector<Count>>& points, const std::vector<Count>& point) {
  auto at_most = [](const std::vector<Count>& a, const std::vector<Count>& b) {
    for (size_t j = 0; j < a.size(); ++j)
      if (!(a[j] <= b[j])) return false;
    return true;
  };
  for (const auto& p : points)
    if (at_most(point, p)) return;
  std::erase_if(points, [&](const auto& p) { return at_most(p, point); });
  points.push_back(point);
}

// The rank's peaks over its list, as peak_activation_bytes (held until W) and transit_of count
// them: the same additions and releases, counted per stage.
RankPeaks rank_peaks(const std::vector<schedule::Action>& list, std::vector<int> stages,
                     int last_stage) {
  using schedule::ActionKind;
  RankPeaks out;
  out.stages = std::move(stages);
  std::vector<RankPeaks::Held> held(out.stages.size());
  std::vector<RankPeaks::Transit> transit(out.stages.size());
  add_peak(out.transit, transit);
  for (const auto& a : list) {
    const auto j = static_cast<size_t>(std::find(out.stages.begin(), out.stages.end(), a.stage) -
                                       out.stages.begin());
    if (j == out.stages.size()) continue;  // not the rank's: nothing of it is held here
    RankPeaks::Held& h = held[j];
    RankPeaks::Transit& t = transit[j];
    const bool has_input = a.stage > 0, has_output = a.stage < last_stage;
    switch (a.kind) {
      case ActionKind::kForward: {
        ++h.kept;
        auto peak = held;  // what the forward holds for a moment on top
        ++peak[j].forward;
        add_peak(out.held, peak);
        t.inputs -= has_input, t.outputs += has_output;
        break;
      }
      case ActionKind::kBackward: {
        auto peak = held;
        ++peak[j].rebuilt, ++peak[j].pending;
        add_peak(out.held, peak);
        --h.kept;
        t.outputs -= has_output, t.inputs += has_input;
        break;
      }
      case ActionKind::kBackwardInput:
        ++h.rebuilt, ++h.pending;
        add_peak(out.held, held);
        t.outputs -= has_output, t.inputs += has_input;
        break;
      case ActionKind::kBackwardWeight:  // releases what the stage held for it
        --h.kept, --h.rebuilt, --h.pending;
        break;
      case ActionKind::kSendAct:
        --t.outputs;
        break;
      case ActionKind::kRecvGrad:
        ++t.outputs;
        break;
      case ActionKind::kSendGrad:
        --t.inputs;
        break;
      case ActionKind::kRecvAct:
        ++t.inputs;
        break;
      case ActionKind::kAllReduceGrad:  // sums gradients: holds no activation
        break;
    }
    add_peak(out.transit, transit);
  }
  return out;
}

// Per rank memory of a partition: the state of its units, the activations its stages hold at
// the peak (with recomputed units their kept inputs and rebuilds, with a split backward what
// I leaves for W), the boundary tensors waiting, and its largest unit workspace.
struct MemoryModel : PartitionMemory {
  const Sums& sums;
  const std::vector<UnitCost>& units;
  const std::vector<bool>& recomputed;
  const schedule::Schedule& schedule;
  std::vector<double> saved, input, pending;  // per unit
  std::vector<RankPeaks> peaks;               // per rank

  MemoryModel(const Sums& sums, const std::vector<UnitCost>& units,
              const std::vector<bool>& recomputed, const schedule::Schedule& schedule)
      : sums(sums), units(units), recomputed(recomputed), schedule(schedule) {
    for (const auto& u : units)
      saved.push_back(u.activation_bytes), input.push_back(u.input_bytes),
          pending.push_back(u.weight_pending_bytes);
    for (int r = 0; r < schedule.num_ranks(); ++r)
      peaks.push_back(rank_peaks(schedule.ranks[static_cast<size_t>(r)],
                                 schedule.placement.stages_of(r), schedule.num_stages() - 1));
    activation_memo.resize((units.size() + 1) * (units.size() + 1));
    activation_known.assign(activation_memo.size(), false);
  }

  // What a stage of units `range` holds per micro-batch, remembered: the searches ask again
  // for every prefix.
  const StageActivationBytes& activations(const StageRange& range) const {
    const size_t at =
        static_cast<size_t>(range.begin) * (units.size() + 1) + static_cast<size_t>(range.end);
    if (!activation_known[at]) {
      activation_memo[at] = stage_activation_bytes(saved, input, {range}, recomputed, pending)[0];
      activation_known[at] = true;
    }
    return activation_memo[at];
  }
  mutable std::vector<StageActivationBytes> activation_memo;  // [begin * (n + 1) + end]
  mutable std::vector<bool> activation_known;
  mutable std::vector<StageActivationBytes> held_bytes;  // per stage of a rank: scratch
  mutable std::vector<double> in_bytes, out_bytes;       // likewise
  // The boundary tensor entering unit `u` (none past the last unit).
  double boundary(int64_t u) const {
    return u < static_cast<int64_t>(units.size()) ? units[static_cast<size_t>(u)].input_bytes : 0.0;
  }
  // The most rank r's held activations reach, with its j-th stage's bytes `bytes[j]`.
  double held_peak(int r, const std::vector<StageActivationBytes>& bytes) const {
    double peak = 0;
    for (const auto& point : peaks[static_cast<size_t>(r)].held) {
      double total = 0;
      for (size_t j = 0; j < point.size(); ++j)
        total += point[j].kept * bytes[j].kept + point[j].rebuilt * bytes[j].rebuilt +
                 point[j].pending * bytes[j].weight_pending +
                 point[j].forward * bytes[j].forward_extra;
      peak = std::max(peak, total);
    }
    return peak;
  }
  // Rank r's bytes with its stages holding `own[j]`: state, held activations, boundary tensors
  // waiting (plus one more message per stage and direction: the executor takes no more ahead
  // of the list, RankStep::may_receive) and the largest workspace.
  double rank_bytes(int r, const std::vector<StageRange>& own) const {
    const RankPeaks& rank = peaks[static_cast<size_t>(r)];
    const int last = schedule.num_stages() - 1;
    held_bytes.resize(own.size()), in_bytes.resize(own.size()), out_bytes.resize(own.size());
    double state = 0, workspace = 0, early = 0;
    for (size_t j = 0; j < own.size(); ++j) {
      held_bytes[j] = activations(own[j]);
      state += sums.state.over(own[j]);
      workspace = std::max(workspace, sums.workspace_over(own[j].begin, own[j].end));
      in_bytes[j] = boundary(own[j].begin), out_bytes[j] = boundary(own[j].end);
      early +=
          (rank.stages[j] > 0 ? in_bytes[j] : 0.0) + (rank.stages[j] < last ? out_bytes[j] : 0.0);
    }
    double transit = 0;
    for (const auto& point : rank.transit) {
      double total = 0;
      for (size_t j = 0; j < point.size(); ++j)
        total += point[j].inputs * in_bytes[j] + point[j].outputs * out_bytes[j];
      transit = std::max(transit, total);
    }
    return state + held_peak(r, held_bytes) + transit + early + workspace;
  }

  std::vector<double> operator()(const std::vector<StageRange>& ranges) const override {
    std::vector<double> bytes(static_cast<size_t>(schedule.num_ranks()));
    std::vector<StageRange> own;
    for (int r = 0; r < schedule.num_ranks(); ++r) {
      own.clear();
      for (int s : peaks[static_cast<size_t>(r)].stages)
        own.push_back(ranges[static_cast<size_t>(s)]);
      bytes[static_cast<size_t>(r)] = rank_bytes(r, own);
    }
    return bytes;
  }
  // Stage s of units [b, e) on a rank that holds only it (chunks == 1).
  double stage(int s, int64_t b, int64_t e) const override {
    return rank_bytes(schedule.placement.rank_of(s), {{b, e}});
  }
  // Rank r's state, held activations and workspace over its stages among the first `known`
  // of `ranges`, the others taken as empty: each term only grows with a stage's units.
  // (Boundary tensors are left out: a stage's count of them can be negative at a point.)
  double known_stages(int r, const std::vector<StageRange>& ranges, int known) const override {
    const RankPeaks& rank = peaks[static_cast<size_t>(r)];
    held_bytes.assign(rank.stages.size(), {});
    double state = 0, workspace = 0;
    for (size_t j = 0; j < rank.stages.size(); ++j) {
      const int s = rank.stages[j];
      if (s >= known) continue;
      const StageRange& range = ranges[static_cast<size_t>(s)];
      held_bytes[j] = activations(range);
      state += sums.state.over(range);
      workspace = std::max(workspace, sums.workspace_over(range.begin, range.end));
    }
    return state + held_peak(r, held_bytes) + workspace;
  }
};

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
        << bytes_text(*std::max_element(lean.begin(), lean.end())) << " (" << ranges_text(leanest)
        << ")";
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

namespace {

void check_search(const std::vector<UnitCost>& units, const schedule::Schedule& schedule,
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
}

// One pipelined layout's partition problem, prepared to be searched in steps: its costs (with
// recomputation), memory model and searcher, started from the most balanced partition that
// fits. The planner first searches each layout only for what could beat the fastest layout
// found so far, then each on its own, so the searcher keeps what it found between searches.
class LayoutSearch {
 public:
  // PlanError for bad options, and for a cap that no partition fits.
  LayoutSearch(const std::vector<UnitCost>& units, const schedule::Schedule& schedule,
               const PartitionSearch& search)
      : schedule_((check_search(units, schedule, search), schedule)),
        recomputed_(search.recomputed),
        timed_(with_recompute_time(units, recomputed_)),
        sums_(timed_),
        memory_(sums_, timed_, recomputed_, schedule_),
        searcher_(sums_, timed_, memory_, schedule_, search.memory_cap, search.transfer_seconds),
        cap_(search.memory_cap),
        transfer_(search.transfer_seconds),
        // Relaxed simulations cost what a full one does but prune whole subtrees, so they
        // get a larger share of the budget than the completions.
        budget_{search.max_simulations, search.max_simulations * 20, search.max_simulations * 20} {
    const auto compute = [&](int, int64_t b, int64_t e) { return sums_.compute.over(b, e); };
    balanced_ = min_max_partition(units_count(), schedule_.num_stages(), compute);
    searcher_.start_from(first_incumbent(), budget_.simulations);
    root_bound_ = searcher_.root_bound();
  }

  // Searches with a fresh budget (`share` of the layout's), skipping the partitions that
  // cannot beat `ceiling`, timing at most `actions` actions in its simulations; the actions it
  // timed.
  int64_t search(double ceiling = kInf, int64_t actions = std::numeric_limits<int64_t>::max(),
                 int64_t share = 1) {
    SearchBudget budget = budget_;
    budget.simulations = std::max<int64_t>(budget.simulations / share, 1);
    budget.visits = std::max<int64_t>(budget.visits / share, 1);
    budget.relaxed = std::max<int64_t>(budget.relaxed / share, 1);
    budget.actions = actions;
    searched_ = true;
    const Searched& found = searcher_.search(budget, ceiling);
    proved_ = std::max(proved_, found.proven ? found.step : found.lower_bound);
    return found.actions;
  }
  bool found_any() const { return !searcher_.found().ranges.empty(); }
  // The fastest partition found is proven the fastest that fits (or, none found, none fits).
  bool proven() const { return searched_ && proved_ >= searcher_.found().step; }
  // No partition that fits is faster than this: the most any search proved.
  double lower_bound() const {
    return std::min(searcher_.found().step, std::max(root_bound_, proved_));
  }
  double step() const { return searcher_.found().step; }

  // PlanError when no partition that fits was found: none does, or the budget ran out.
  PartitionChoice choice() const {
    const Searched& found = searcher_.found();
    if (found.ranges.empty()) {
      if (proven()) throw_no_fit(timed_, sums_, memory_, schedule_, cap_, balanced_);
      throw PlanError("no partition of " + std::to_string(units_count()) + " units into " +
                      std::to_string(schedule_.num_stages()) + " stages fitting " +
                      bytes_text(cap_) + " was found within " +
                      std::to_string(budget_.simulations) +
                      " simulated partitions; raise the search budget or the cap");
    }
    PartitionChoice out;
    out.ranges = found.ranges;
    out.bottleneck = bottleneck_of(sums_, found.ranges, schedule_.placement);
    out.rank_bytes = memory_(found.ranges);
    out.step_seconds = found.step;
    out.lower_bound = lower_bound();
    out.proven = proven();
    out.simulated = found.simulated;
    return out;
  }
  // The simulated run of `ranges` (what the plan reports of a layout besides its step time).
  schedule::SimResult simulate(const std::vector<StageRange>& ranges) const {
    return schedule::simulate(schedule_, cost_model(timed_, ranges, transfer_));
  }

 private:
  int64_t units_count() const { return static_cast<int64_t>(timed_.size()); }

  // The smallest largest stage compute (F + I + W), within the cap per stage when each rank
  // holds one stage: close to the optimum, so the bounds prune early. With several stages a
  // rank, when the most balanced partition overflows, the leanest one. Empty when the
  // leanest was not found within the budget (the search then looks for one that fits);
  // PlanError when no partition fits.
  std::vector<StageRange> first_incumbent() const {
    const int stages = schedule_.num_stages();
    if (schedule_.placement.chunks == 1) {
      const auto within =
          min_max_partition(units_count(), stages, [&](int s, int64_t b, int64_t e) {
            return fits(memory_.stage(s, b, e), cap_) ? sums_.compute.over(b, e) : kInf;
          });
      if (within.empty()) throw_no_fit(timed_, sums_, memory_, schedule_, cap_, balanced_);
      return within;
    }
    if (fits_cap(balanced_)) return balanced_;
    const auto leanest = leanest_partition(sums_, memory_, schedule_, budget_.visits);
    if (!leanest.empty() && !fits_cap(leanest))
      throw_no_fit(timed_, sums_, memory_, schedule_, cap_, balanced_);
    return leanest;
  }
  bool fits_cap(const std::vector<StageRange>& ranges) const {
    const auto memory = memory_(ranges);
    return fits(*std::max_element(memory.begin(), memory.end()), cap_);
  }

  const schedule::Schedule schedule_;
  const std::vector<bool> recomputed_;
  const std::vector<UnitCost> timed_;
  const Sums sums_;
  const MemoryModel memory_;
  PartitionSearcher searcher_;
  const double cap_, transfer_;
  const SearchBudget budget_;
  std::vector<StageRange> balanced_;
  double root_bound_ = 0;
  double proved_ = 0;  // the highest lower bound a search proved
  bool searched_ = false;
};

}  // namespace

PartitionChoice best_partition(const std::vector<UnitCost>& units,
                               const schedule::Schedule& schedule, const PartitionSearch& search) {
  LayoutSearch layout(units, schedule, search);
  layout.search();
  return layout.choice();
}

const PlanCandidate& Plan::best() const {
  for (const auto& c : candidates)
    if (c.rejected.empty()) return c;
  std::string why;
  for (const auto& c : candidates) why += "\n  " + c.layout + ": " + c.rejected;
  throw PlanError("no layout fits:" + why);
}

const PlanCandidate* Plan::fastest_pipeline() const {
  for (const auto& c : candidates)
    if (c.rejected.empty() && c.pipelined) return &c;
  return nullptr;
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
    u.weight_pending_bytes *= factor;
    u.workspace_bytes *= factor;
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
  // Ring all-reduce of the gradients (one f32 gradient per weight): 2(p-1) steps, each moving
  // 1/p of them; in k buckets, k such all-reduces of a k-th each, priced as the simulator
  // prices a stage's buckets.
  const double latency = 2.0 * (p - 1) * options.allreduce_latency;
  const double whole =
      latency +
      2.0 * (p - 1) *
          (options.allreduce_bandwidth > 0 ? parameters / p / options.allreduce_bandwidth : 0.0);
  const int buckets = schedule::gradient_bucket_count(parameters, options.gradient_bucket_bytes);
  const double reduce =
      p == 1 ? 0.0 : buckets * schedule::reduce_bucket_cost(whole, latency, buckets);
  c.step_seconds = compute * per_token * static_cast<double>(replica_tokens) + reduce;
  c.step_lower_bound = c.step_seconds;
  c.bubble = c.step_seconds > 0 ? reduce / c.step_seconds : 0.0;
  return c;
}

// A pipelined candidate with the search of its partition (none when it cannot run).
struct PipelineRow {
  PlanCandidate candidate;
  std::unique_ptr<LayoutSearch> search;
};

// Prepares the row's search; a layout no partition fits, or none found fitting within the
// budget, is rejected with the reason.
void prepare(PipelineRow& row, const std::vector<UnitCost>& units,
             const schedule::Schedule& schedule, const PartitionSearch& search) {
  PlanCandidate& c = row.candidate;
  try {
    row.search = std::make_unique<LayoutSearch>(units, schedule, search);
    if (row.search->found_any()) return;
    row.search->search();  // the cap left no incumbent: look for any partition that fits
    row.search->choice();  // PlanError when none was found
  } catch (const std::invalid_argument& e) {  // PlanError, or units out of range
    c.rejected = e.what();
    // No partition runs, unless one was missed for want of budget.
    c.step_lower_bound = row.search && !row.search->proven() ? row.search->lower_bound() : kInf;
  }
}

// The rounds of search_rows: each layout still open is searched again with 1/64, 1/16, 1/4
// and then all of its budget, so that those quick to prove are proven before a hard one
// takes the budget of all of them. A search resumed with more budget walks again what it
// walked before, faster with the incumbent and the paths it found: at most a third more.
constexpr int64_t kRoundShares[] = {64, 16, 4, 1};

// Searches the rows' partitions within `actions`, in rounds of growing budgets. In each
// round, first, in the order of their lower bounds, the layouts that could still beat the
// fastest step time found so far, each only for what could (the one that wins is then
// proven, and the others need not be searched to the end); then the others not yet proven,
// each for its own row's exact step time.
void search_rows(std::vector<PipelineRow>& rows, int64_t actions) {
  std::vector<LayoutSearch*> open;
  double fastest = kInf;
  for (PipelineRow& row : rows)
    if (row.candidate.rejected.empty()) {
      open.push_back(row.search.get());
      fastest = std::min(fastest, row.search->step());
    }
  // A search stopped by the ceiling proved every partition above `fastest * (1 + kSlack)`.
  auto could_win = [&](const LayoutSearch* layout) {
    return layout->lower_bound() < fastest * (1 + kSlack);
  };
  for (const int64_t share : kRoundShares) {
    std::stable_sort(open.begin(), open.end(), [](const LayoutSearch* a, const LayoutSearch* b) {
      return a->lower_bound() < b->lower_bound();
    });
    for (const bool contenders : {true, false})
      for (LayoutSearch* layout : open) {
        if (layout->proven() || could_win(layout) != contenders) continue;
        if (actions <= 0) return;
        actions -= layout->search(contenders ? fastest : kInf, actions, share);
        fastest = std::min(fastest, layout->step());
      }
  }
}

// The row's partition and what its simulation says of it.
void finish(PipelineRow& row) {
  PlanCandidate& c = row.candidate;
  if (!c.rejected.empty()) return;
  const PartitionChoice choice = row.search->choice();
  c.ranges = choice.ranges;
  c.partition_proven = choice.proven;
  c.step_lower_bound = choice.lower_bound;
  c.peak_bytes = choice.rank_bytes;
  const auto sim = row.search->simulate(choice.ranges);
  c.step_seconds = sim.makespan;
  c.bubble = sim.bubble_fraction;
  for (const auto& rank : sim.ranks) c.busy_seconds.push_back(rank.busy);
}

// The step time the table shows of a feasible candidate: its lower bound when its partition
// was not proven the fastest.
double shown_step(const PlanCandidate& c) {
  return c.partition_proven ? c.step_seconds : c.step_lower_bound;
}

// Feasible candidates first, by the step time shown, then by the fastest partition found;
// the fastest found first of all, and the fastest pipeline before every other one, even when
// a layout not searched to the end shows a lower bound below it.
void rank(std::vector<PlanCandidate>& candidates) {
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const PlanCandidate& a, const PlanCandidate& b) {
                     if (a.rejected.empty() != b.rejected.empty()) return a.rejected.empty();
                     if (shown_step(a) != shown_step(b)) return shown_step(a) < shown_step(b);
                     return a.step_seconds < b.step_seconds;
                   });
  auto fastest_first = [&](auto in) {
    auto first = candidates.end(), fastest = candidates.end();
    for (auto it = candidates.begin(); it != candidates.end(); ++it) {
      if (!it->rejected.empty() || !in(*it)) continue;
      if (first == candidates.end()) first = it;
      if (fastest == candidates.end() || it->step_seconds < fastest->step_seconds) fastest = it;
    }
    if (first != candidates.end()) std::rotate(first, fastest, fastest + 1);
  };
  fastest_first([](const PlanCandidate& c) { return c.pipelined; });
  fastest_first([](const PlanCandidate&) { return true; });
}

// Whether the fastest feasible pipeline's partition is proven the fastest of its layout and
// no partition of any other pipelined layout (feasible or not found fitting) beats it.
bool fastest_pipeline_proven(const std::vector<PlanCandidate>& candidates) {
  const PlanCandidate* fastest = nullptr;
  for (const auto& c : candidates)
    if (c.pipelined && c.rejected.empty()) {
      fastest = &c;
      break;
    }
  if (!fastest || !fastest->partition_proven) return false;
  for (const auto& c : candidates)
    if (c.pipelined && &c != fastest && c.step_lower_bound < fastest->step_seconds * (1 - kSlack))
      return false;
  return true;
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
  std::erase_if(kinds, [&](const Kind& k) {
    return (options.schedule && k.kind != *options.schedule) ||
           (options.chunks && k.chunks != *options.chunks);
  });
  std::vector<PipelineRow> rows;
  for (int m : counts) {
    if (m < 1 || options.batch_tokens % m != 0) continue;
    const UnitCosts& costs = nearest(options.batch_tokens / m);
    const double factor = static_cast<double>(options.batch_tokens / m) /
                          static_cast<double>(costs.microbatch_tokens);
    auto units = scaled(costs.units, factor);
    // The step's token ids live where the first stage does, its targets and per-token losses
    // where the last one does, for the whole step.
    const StepInputBytes step = step_input_bytes(options.batch_tokens / m, m);
    units.front().state_bytes += step.first_unit;
    units.back().state_bytes += step.last_unit;
    for (const auto& k : kinds) {
      // On one rank every schedule runs the same actions in a row: 1F1B stands for them,
      // unless the caller asked for another.
      if (p == 1 && !options.schedule && k.kind != schedule::ScheduleKind::k1F1B) continue;
      schedule::Schedule sched;
      try {
        sched = schedule::generate(k.kind, p, m, k.chunks);
      } catch (const schedule::ScheduleError&) {
        continue;  // not defined for these values (interleaved needs m % p == 0)
      }
      if (sched.num_stages() > static_cast<int>(units.size())) continue;
      auto prepared = [&](const RecomputeSpec& recompute) {
        PipelineRow row;
        PlanCandidate& c = row.candidate;
        c.kind = k.kind;
        c.chunks = k.chunks;
        c.microbatches = m;
        c.recompute = recompute;
        c.layout = schedule::schedule_kind_name(k.kind);
        if (k.kind == schedule::ScheduleKind::kInterleaved)
          c.layout += " v=" + std::to_string(k.chunks);
        PartitionSearch search;
        search.memory_cap = options.memory_cap;
        search.transfer_seconds = costs.transfer_seconds * factor;
        search.max_simulations = options.max_simulations;
        if (recompute.any())
          search.recomputed = recompute.per_unit(static_cast<int64_t>(units.size()));
        prepare(row, units, sched, search);
        return row;
      };
      PipelineRow row = prepared(options.recompute);
      // Short of memory: the same layout recomputing every unit may fit.
      const bool retry = !row.candidate.rejected.empty() && !options.recompute.any() &&
                         options.recompute_when_short;
      rows.push_back(std::move(row));
      if (retry) rows.push_back(prepared(RecomputeSpec::every_unit()));
    }
  }
  search_rows(rows, options.max_search_actions);
  for (PipelineRow& row : rows) {
    finish(row);
    out.candidates.push_back(std::move(row.candidate));
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
  rank(out.candidates);
  out.fastest_pipeline_proven = fastest_pipeline_proven(out.candidates);
  return out;
}

namespace {

std::string milliseconds(double seconds) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(3) << seconds * 1e3;
  return out.str();
}

// The step column: the step time, or "≥ bound" for a partition not proven the fastest (the
// sign takes three bytes and one column).
std::string step_column(const PlanCandidate& c) {
  std::ostringstream out;
  if (c.partition_proven)
    out << std::setw(14) << milliseconds(c.step_seconds);
  else
    out << std::setw(16) << "\u2265 " + milliseconds(c.step_lower_bound);
  return out.str();
}

// What a row not proven the fastest of its layout says of its partition: the fastest found,
// and why the search stopped.
std::string unproven_note(const PlanCandidate& c, const PlanCandidate* fastest, int fastest_rank) {
  const std::string found = " (fastest found " + milliseconds(c.step_seconds) + " ms; ";
  if (fastest && c.step_lower_bound >= fastest->step_seconds * (1 - kSlack))
    return found + "no partition of it beats rank " + std::to_string(fastest_rank) +
           ", so the search stopped there)";
  return found + "not proven fastest: the partition search ran out of budget)";
}

std::string feasible_row(const PlanCandidate& c, const PlanCandidate* fastest, int fastest_rank) {
  std::ostringstream out, memory;
  for (size_t r = 0; r < c.peak_bytes.size(); ++r)
    memory << (r ? " " : "") << bytes_text(c.peak_bytes[r]);
  out << step_column(c) << std::fixed << std::setprecision(1) << std::setw(8) << c.bubble * 100
      << "%  " << std::left << std::setw(11) << (c.pipelined ? to_string(c.recompute) : "none")
      << std::right << memory.str() << " / "
      << (c.pipelined         ? ranges_text(c.ranges)
          : c.shard_optimizer ? "whole model on every device, optimizer state sharded "
                                "(--shard-optimizer)"
                              : "whole model on every device")
      << (c.partition_proven ? "" : unproven_note(c, fastest, fastest_rank));
  return out.str();
}

// A layout that cannot run: none of its partitions fits, or none that fits was found within
// the budget (then how fast one would be at best).
std::string rejected_row(const PlanCandidate& c) {
  const bool missed = c.pipelined && std::isfinite(c.step_lower_bound);
  std::string out = missed ? "  none found fitting" : "  does not fit";
  if (c.recompute.any()) out += " recomputing " + to_string(c.recompute);
  if (c.shard_optimizer) out += " sharing the optimizer state";
  out += ": " + c.rejected;
  if (missed)
    out += "; one that fits would take at least " + milliseconds(c.step_lower_bound) + " ms";
  return out;
}

}  // namespace

std::string format_plan(const Plan& plan) {
  std::ostringstream out;
  out << std::left << std::setw(5) << "rank" << std::setw(20) << "layout" << std::right
      << std::setw(5) << "m" << std::setw(14) << "step (ms)" << std::setw(9) << "bubble"
      << "  " << std::left << std::setw(11) << "recompute"
      << "peak memory per rank / partition\n";
  int rank = 0, best_pipe_rank = 0;
  const PlanCandidate* best_pipe = nullptr;
  const PlanCandidate* dp = nullptr;
  for (const auto& c : plan.candidates) {
    if (c.rejected.empty()) {
      ++rank;
      if (c.pipelined && !best_pipe) best_pipe = &c, best_pipe_rank = rank;
      if (!c.pipelined && !dp) dp = &c;
    }
    out << std::left << std::setw(5) << (c.rejected.empty() ? std::to_string(rank) : "-")
        << std::setw(20) << c.layout << std::right << std::setw(5)
        << (c.microbatches > 0 ? std::to_string(c.microbatches) : "-")
        << (c.rejected.empty() ? feasible_row(c, best_pipe, best_pipe_rank) : rejected_row(c))
        << "\n";
  }
  if (best_pipe) {
    out << "rank " << best_pipe_rank << " (" << best_pipe->layout
        << ", m=" << best_pipe->microbatches;
    if (plan.fastest_pipeline_proven)
      out << ") is proven the fastest pipeline: no partition of another layout beats it\n";
    else
      out << ") is the fastest pipeline found, not proven the fastest: a partition search ran "
             "out of budget first\n";
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
