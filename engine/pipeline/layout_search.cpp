#include "engine/pipeline/layout_search.h"

#include <algorithm>
#include <optional>
#include <sstream>

#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/plan_format.h"

namespace conveyor::planning {
namespace {

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

// The fewest ranks, up to four times as many, on which some partition fits the cap (each
// rank's share of it, when the ranks share one device); 0: none.
int ranks_that_fit(const std::vector<UnitCost>& timed, const Sums& sums,
                   const std::vector<bool>& recomputed, const schedule::Schedule& schedule,
                   double cap, const PartitionSearch& search) {
  const int64_t n = static_cast<int64_t>(timed.size());
  for (int p = schedule.num_ranks() + 1; p <= 4 * schedule.num_ranks(); ++p) {
    if (static_cast<int64_t>(p) * schedule.placement.chunks > n) break;
    const double share =
        search.cap_shared_by_ranks
            ? (cap + search.cap_reserve) * schedule.num_ranks() / p - search.cap_reserve
            : cap;
    if (!(share > 0)) break;  // 0 would read as no cap at all
    const auto more = with_ranks(schedule, p);
    if (!more) continue;
    const MemoryModel memory_of(sums, timed, recomputed, *more);
    const auto lean = leanest_partition(sums, memory_of, *more, 2000);
    if (lean.empty()) continue;
    const auto memory = memory_of(lean);
    if (fits(*std::max_element(memory.begin(), memory.end()), share)) return p;
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
                               double cap, const PartitionSearch& search,
                               const std::vector<StageRange>& balanced) {
  const auto memory = memory_of(balanced);
  const int worst =
      static_cast<int>(std::max_element(memory.begin(), memory.end()) - memory.begin());
  const auto held = schedule::in_flight_per_rank(schedule);
  const auto leanest = leanest_partition(sums, memory_of, schedule, 20000);
  const int more = ranks_that_fit(timed, sums, memory_of.recomputed, schedule, cap, search);
  std::ostringstream out;
  out << "no partition of " << timed.size() << " units into " << schedule.num_stages()
      << " stages fits " << bytes_text(cap) << " per rank under " << schedule.name << " with "
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

}  // namespace

LayoutSearch::LayoutSearch(const std::vector<UnitCost>& units, const schedule::Schedule& schedule,
                           const PartitionSearch& search)
    : schedule_((check_search(units, schedule, search), schedule)),
      recomputed_(search.recomputed),
      timed_(with_recompute_time(units, recomputed_)),
      sums_(timed_),
      memory_(sums_, timed_, recomputed_, schedule_),
      searcher_(sums_, timed_, memory_, schedule_, search.memory_cap, search.transfer_seconds),
      cap_(search.memory_cap),
      search_(search),
      transfer_(search.transfer_seconds),
      // Relaxed simulations cost what a full one does but prune whole subtrees, so they
      // get a larger share of the budget than the completions.
      budget_{search.max_simulations, search.max_simulations * 20, search.max_simulations * 20} {
  const auto compute = [&](int, int64_t b, int64_t e) { return sums_.compute.over(b, e); };
  balanced_ = min_max_partition(units_count(), schedule_.num_stages(), compute);
  searcher_.start_from(first_incumbent(), budget_.simulations);
  root_bound_ = searcher_.root_bound();
}

int64_t LayoutSearch::search(double ceiling, int64_t actions, int64_t share) {
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

PartitionChoice LayoutSearch::choice() const {
  const Searched& found = searcher_.found();
  if (found.ranges.empty()) {
    if (proven()) throw_no_fit(timed_, sums_, memory_, schedule_, cap_, search_, balanced_);
    throw PlanError("no partition of " + std::to_string(units_count()) + " units into " +
                    std::to_string(schedule_.num_stages()) + " stages fitting " + bytes_text(cap_) +
                    " was found within " + std::to_string(budget_.simulations) +
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

std::vector<StageRange> LayoutSearch::first_incumbent() const {
  const int stages = schedule_.num_stages();
  if (schedule_.placement.chunks == 1) {
    const auto within = min_max_partition(units_count(), stages, [&](int s, int64_t b, int64_t e) {
      return fits(memory_.stage(s, b, e), cap_) ? sums_.compute.over(b, e) : kInf;
    });
    if (within.empty()) throw_no_fit(timed_, sums_, memory_, schedule_, cap_, search_, balanced_);
    return within;
  }
  if (fits_cap(balanced_)) return balanced_;
  const auto leanest = leanest_partition(sums_, memory_, schedule_, budget_.visits);
  if (!leanest.empty() && !fits_cap(leanest))
    throw_no_fit(timed_, sums_, memory_, schedule_, cap_, search_, balanced_);
  return leanest;
}

}  // namespace conveyor::planning

namespace conveyor {

using planning::LayoutSearch;

PartitionChoice best_partition(const std::vector<UnitCost>& units,
                               const schedule::Schedule& schedule, const PartitionSearch& search) {
  LayoutSearch layout(units, schedule, search);
  layout.search();
  return layout.choice();
}

}  // namespace conveyor
