#include "engine/pipeline/planner.h"

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>

#include "engine/core/number_text.h"
#include "engine/pipeline/layout_search.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/pipeline/partition_search.h"
#include "engine/pipeline/plan_format.h"
#include "engine/pipeline/plan_ties.h"
#include "engine/pipeline/planner_memory.h"
#include "engine/schedule/simulator.h"

namespace conveyor {
namespace {

using namespace planning;

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
  // NaN would pass every comparison the cap is in, and print as "nan B".
  const std::pair<const char*, double> amounts[] = {
      {"memory cap", options.memory_cap},
      {"memory cap reserve", options.cap_reserve},
      {"time error", options.time_error.value_or(0)},
      {"all-reduce bandwidth", options.allreduce_bandwidth},
      {"all-reduce latency", options.allreduce_latency}};
  for (const auto& [what, value] : amounts)
    if (!(value >= 0.0 && value < std::numeric_limits<double>::infinity()))
      throw PlanError(std::string(what) + " of " + std::to_string(value) +
                      "; expected a finite amount, at least 0 (0: none)");
  // Each of these was otherwise taken for something else without a word: a bucket size that
  // is NaN or negative for one bucket, a count that cannot be run for none at all.
  const double bucket = options.gradient_bucket_bytes;
  if (!(bucket >= 0.0 && bucket < std::numeric_limits<double>::infinity()))
    throw PlanError(
        "PlanOptions::gradient_bucket_bytes must be a finite number of bytes, at "
        "least 0 (0: one bucket), got " +
        number_text(bucket));
  for (const int v : options.interleaved_chunks)
    if (v < 2)
      throw PlanError(
          "PlanOptions::interleaved_chunks must list chunk counts of at least 2 "
          "(one chunk per rank is 1F1B, planned anyway), got " +
          std::to_string(v));
  for (const int m : options.microbatch_counts)
    if (m < 1 || options.batch_tokens % m != 0)
      throw PlanError(
          "PlanOptions::microbatch_counts must list counts of at least 1 that "
          "divide PlanOptions::batch_tokens (" +
          std::to_string(options.batch_tokens) + "), got " + std::to_string(m));
}

// Every device a replica of the whole model; with `shard_optimizer` each keeps its piece of
// every parameter's optimizer state (ZeRO stage 1, --shard-optimizer), about 1/p of it, each
// piece rounded up by the allocator (sharded_optimizer_bytes). Its traffic is a reduce-scatter of
// the gradients and an all-gather of the updated weights, p - 1 ring steps of 1/p of them each: the
// 2(p - 1) steps of the ring all-reduce it replaces, so the step time is the same. `costs` is the
// table measured at a replica's share of the batch; `nearest` gives the one measured nearest a
// smaller micro-batch, whose allocations round up differently.
PlanCandidate data_parallel(const UnitCosts& costs,
                            const std::function<const UnitCosts&(int64_t)>& nearest,
                            const PlanOptions& options, bool shard_optimizer) {
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
  double state = 0, parameters = 0, compute = 0;
  for (const auto& u : costs.units)
    state += u.state_bytes, parameters += u.parameter_bytes, compute += u.compute();
  // Sharded, replica d keeps its pieces of the optimizer state, each rounded up on its own:
  // the pieces of replicas differ by an element, and so may their bytes.
  std::vector<double> replica_state(static_cast<size_t>(p), state);
  if (shard_optimizer)
    for (int d = 0; d < p; ++d)
      for (const auto& u : costs.units)
        replica_state[static_cast<size_t>(d)] -=
            u.optimizer_bytes - sharded_optimizer_bytes(u, d, p);
  state = *std::max_element(replica_state.begin(), replica_state.end());
  // Each replica runs its share one micro-batch after another, accumulating gradients: a
  // one-rank 1F1B (the run's default schedule), which holds one micro-batch at a time. The
  // fewest micro-batches that fit, beside the step's token ids and losses (a replica holds the
  // first unit and the last), counted as the check before a run counts them: the pipeline's
  // memory model on one stage, whose backward holds what the weight gradients read and whose
  // largest workspace comes on top. Its activation bytes scale with the tokens, so its peak is
  // taken per token of the table nearest the micro-batch, without the state.
  const double per_token = 1.0 / static_cast<double>(costs.microbatch_tokens);
  const schedule::Schedule one_rank = schedule::generate(schedule::ScheduleKind::k1F1B, 1, 1);
  std::vector<std::pair<const UnitCosts*, double>> held_per_token;
  auto held = [&](int64_t tokens) {
    const UnitCosts* table = &nearest(tokens);
    for (const auto& [known, bytes] : held_per_token)
      if (known == table) return bytes * static_cast<double>(tokens);
    std::vector<UnitCost> one_token =
        scaled(table->units, 1.0 / static_cast<double>(table->microbatch_tokens));
    for (auto& u : one_token) u.state_bytes = 0;
    held_per_token.emplace_back(table, rank_memory(one_token, c.ranges, one_rank)[0]);
    return held_per_token.back().second * static_cast<double>(tokens);
  };
  // The least any count needs, for the refusal: more micro-batches hold fewer activations
  // but more loss tensors, each rounded up by the allocator.
  c.microbatches = 0;
  double least = std::numeric_limits<double>::infinity();
  int least_at = 0;
  for (int m = 1; m <= replica_tokens; ++m) {
    if (replica_tokens % m) continue;
    const StepInputBytes step = step_input_bytes(replica_tokens / m, m);
    const double bytes = state + step.first_unit + step.last_unit + held(replica_tokens / m);
    if (bytes < least) least = bytes, least_at = m;
    if (fits(bytes, options.memory_cap)) {
      c.microbatches = m;
      for (const double own : replica_state) c.peak_bytes.push_back(bytes - state + own);
      break;
    }
  }
  if (c.microbatches == 0) {
    c.short_of_memory = true;
    c.rejected = "a replica does not fit the cap of " + bytes_text(options.memory_cap) +
                 " per rank: it needs at least " + bytes_text(least) + " (the model's state " +
                 bytes_text(state) + ", and the step's token ids, losses and activations in " +
                 counted(least_at, "micro-batch", "micro-batches") + " of its " +
                 std::to_string(replica_tokens) + " tokens)";
    c.peak_bytes = std::vector<double>(p, least);
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
  std::shared_ptr<const std::vector<UnitCost>> units;  // the costs searched, before recomputation
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

// Moves the candidate at `from` to `to`, when that is before it, the ones between one down.
void move_up(std::vector<PlanCandidate>::iterator from, std::vector<PlanCandidate>::iterator to) {
  if (from > to) std::rotate(to, from, from + 1);
}

// The first feasible candidate `in` takes, and the fastest of them; end() when none is.
template <class In>
std::pair<std::vector<PlanCandidate>::iterator, std::vector<PlanCandidate>::iterator>
first_and_fastest(std::vector<PlanCandidate>& candidates, In in) {
  auto first = candidates.end(), fastest = candidates.end();
  for (auto it = candidates.begin(); it != candidates.end(); ++it) {
    if (!it->rejected.empty() || !in(*it)) continue;
    if (first == candidates.end()) first = it;
    if (fastest == candidates.end() || it->step_seconds < fastest->step_seconds) fastest = it;
  }
  return {first, fastest};
}

bool is_pipeline(const PlanCandidate& c) { return c.pipelined; }

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
  const auto [first_pipeline, fastest_pipeline] = first_and_fastest(candidates, is_pipeline);
  move_up(fastest_pipeline, first_pipeline);
  const auto [first, fastest] =
      first_and_fastest(candidates, [](const PlanCandidate&) { return true; });
  move_up(fastest, first);
}

// Where pipelines tie with the fastest (the candidates ranked), the one chosen of them
// (choose_among_tied) takes the fastest's place. The fastest pipeline's step time when it
// gave way, else 0.
double give_way_to_tied(std::vector<PlanCandidate>& candidates) {
  const auto pipeline = first_and_fastest(candidates, is_pipeline).first;
  if (pipeline == candidates.end()) return 0;
  const double fastest = pipeline->step_seconds;
  const auto chosen = choose_among_tied(candidates, *pipeline);
  if (chosen == candidates.end() || chosen == pipeline) return 0;
  move_up(chosen, pipeline);
  return fastest;
}

// For the feasible pipelines that could tie with the fastest, the partition chosen among
// those tied with their own fastest (partition_among_tied), and its step errors
// (PlanCandidate::step_errors). A step time moves by at most its units' largest error, so a
// pipeline further from the fastest than kTieErrors times that, for both, cannot tie.
void fill_step_errors(std::vector<PipelineRow>& rows) {
  double fastest = kInf, largest = 0;
  for (const PipelineRow& row : rows) {
    if (!row.candidate.rejected.empty()) continue;
    fastest = std::min(fastest, row.candidate.step_seconds);
    for (const UnitCost& u : *row.units) largest = std::max(largest, u.time_error);
  }
  for (PipelineRow& row : rows) {
    PlanCandidate& c = row.candidate;
    if (!c.rejected.empty() || !c.pipelined || !c.partition_proven || largest <= 0) continue;
    if (c.step_seconds - fastest > kTieErrors * largest * (c.step_seconds + fastest)) continue;
    const LayoutSearch& layout = *row.search;
    TimedPartition own{c.ranges, c.peak_bytes, c.step_seconds,
                       step_errors(layout, *row.units, c.ranges, c.step_seconds)};
    if (own.errors.empty()) continue;
    const TimedPartition chosen = partition_among_tied(layout, *row.units, own);
    c.step_errors = chosen.errors;
    if (chosen.ranges == c.ranges) continue;
    c.partition_tied = true;
    c.ranges = chosen.ranges;
    c.peak_bytes = chosen.peak_bytes;
    const auto sim = layout.simulate(chosen.ranges);
    c.step_seconds = sim.makespan;
    c.bubble = sim.bubble_fraction;
    c.busy_seconds.clear();
    for (const auto& rank : sim.ranks) c.busy_seconds.push_back(rank.busy);
  }
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

Plan plan(const UnitCosts& costs, const PlanOptions& options) {
  return plan(std::vector<UnitCosts>{costs}, options);
}

std::vector<int> default_microbatch_counts(int num_ranks, int64_t batch_tokens) {
  std::vector<int> counts;
  for (const int64_t target : {1, 2, 4, 8}) {
    const int64_t from = target * num_ranks;
    for (int64_t m = from; m <= 2 * from && m <= batch_tokens; ++m)
      if (batch_tokens % m == 0) {
        if (std::find(counts.begin(), counts.end(), m) == counts.end())
          counts.push_back(static_cast<int>(m));
        break;
      }
  }
  if (counts.empty()) counts.push_back(1);
  return counts;
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
  if (counts.empty()) counts = default_microbatch_counts(p, options.batch_tokens);
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
    kinds.push_back({schedule::ScheduleKind::kInterleaved, v});
  std::erase_if(kinds, [&](const Kind& k) {
    return (options.schedule && k.kind != *options.schedule) ||
           (options.chunks && k.chunks != *options.chunks);
  });
  std::vector<PipelineRow> rows;
  for (int m : counts) {
    const UnitCosts& costs = nearest(options.batch_tokens / m);
    const double factor = static_cast<double>(options.batch_tokens / m) /
                          static_cast<double>(costs.microbatch_tokens);
    auto units = scaled(costs.units, factor);
    if (options.time_error)
      for (UnitCost& u : units) u.time_error = *options.time_error;
    // The step's token ids live where the first stage does, its targets and per-token losses
    // where the last one does, for the whole step.
    const StepInputBytes step = step_input_bytes(options.batch_tokens / m, m);
    units.front().state_bytes += step.first_unit;
    units.back().state_bytes += step.last_unit;
    const auto shared = std::make_shared<const std::vector<UnitCost>>(units);
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
        c.costs_tokens = costs.microbatch_tokens;
        c.layout = schedule::schedule_kind_name(k.kind);
        if (k.kind == schedule::ScheduleKind::kInterleaved)
          c.layout += " v=" + std::to_string(k.chunks);
        PartitionSearch search;
        search.memory_cap = options.memory_cap;
        search.cap_shared_by_ranks = options.cap_shared_by_ranks;
        search.cap_reserve = options.cap_reserve;
        search.transfer_seconds = costs.transfer_seconds * factor;
        search.max_simulations = options.max_simulations;
        if (recompute.any())
          search.recomputed = recompute.per_unit(static_cast<int64_t>(units.size()));
        row.units = shared;
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
  for (PipelineRow& row : rows) finish(row);
  {
    // Proven of the fastest partitions the searches found, before a tie may take the place
    // of one: what the proof is of.
    std::vector<PlanCandidate> exact;
    for (const PipelineRow& row : rows) exact.push_back(row.candidate);
    rank(exact);
    out.fastest_pipeline_proven = fastest_pipeline_proven(exact);
  }
  fill_step_errors(rows);
  for (PipelineRow& row : rows) out.candidates.push_back(std::move(row.candidate));
  if (options.include_data_parallel && p > 1) {
    const UnitCosts& costs = nearest(options.batch_tokens / p);
    PlanCandidate replicas = data_parallel(costs, nearest, options, false);
    // Short of memory: replicas that share the optimizer state may fit.
    double optimizer = 0;
    for (const auto& u : costs.units) optimizer += u.optimizer_bytes;
    const bool retry = replicas.short_of_memory && optimizer > 0;
    out.candidates.push_back(std::move(replicas));
    if (retry) out.candidates.push_back(data_parallel(costs, nearest, options, true));
  }
  rank(out.candidates);
  out.fastest_pipeline_seconds = give_way_to_tied(out.candidates);
  return out;
}

}  // namespace conveyor
