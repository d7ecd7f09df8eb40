#include "engine/pipeline/planner.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/partition_search.h"
#include "engine/pipeline/plan_format.h"
#include "engine/pipeline/planner_memory.h"
#include "engine/schedule/simulator.h"

namespace conveyor {
namespace {

using namespace planning;

void check_shape(const std::vector<UnitCost>& units, const schedule::Schedule& schedule) {
  const int stages = schedule.num_stages();
  if (stages < 1) throw PlanError("the schedule has no stages; expected at least one");
  if (static_cast<int64_t>(units.size()) < stages)
    throw PlanError("cannot cut " + std::to_string(units.size()) + " units into " +
                    std::to_string(stages) + " stages: every stage needs a unit; use at most " +
                    std::to_string(units.size()) + " stages");
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

}  // namespace conveyor
