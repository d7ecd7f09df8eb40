#include "tools/train_report.h"

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/transport_factory.h"
#include "engine/core/number_text.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/schedule/chrome_trace.h"
#include "engine/schedule/measured_timing.h"
#include "engine/schedule/schedule.h"
#include "engine/schedule/simulator.h"
#include "engine/train/trainer.h"
#include "tools/cli_common.h"
#include "tools/interrupt.h"
#include "tools/output_file.h"
#include "tools/run_trace.h"

namespace conveyor::cli {

std::string human_rate(double per_second) {
  char buf[32];
  if (per_second >= 1e6)
    std::snprintf(buf, sizeof buf, "%.2fM", per_second / 1e6);
  else if (per_second >= 1e3)
    std::snprintf(buf, sizeof buf, "%.1fk", per_second / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.0f", per_second);
  return buf;
}

namespace {

// A per-stage or per-rank list of a long pipeline shows its first and last kListEnds entries
// and counts the rest: a line per run, not a screen per line.
constexpr size_t kListEnds = 8;

bool shown_in_list(size_t i, size_t n) {
  return n <= 2 * kListEnds || i < kListEnds || i >= n - kListEnds;
}

// What stands for the entries left out, before entry `i`; empty elsewhere.
std::string left_out_before(size_t i, size_t n) {
  if (n <= 2 * kListEnds || i != n - kListEnds) return "";
  return " ... (" + std::to_string(n - 2 * kListEnds) + " more)";
}

}  // namespace

void print_data_parallel(Trainer& trainer) {
  const auto& sched = trainer.executor().schedule();
  if (sched.replicas == 1) return;
  std::string buckets;
  const auto stages = static_cast<size_t>(sched.num_stages());
  for (size_t s = 0; s < stages; ++s) {
    if (!shown_in_list(s, stages)) continue;
    buckets += left_out_before(s, stages) + (s == 0 ? "" : ",") +
               std::to_string(schedule::gradient_buckets(sched, static_cast<int>(s)));
  }
  // Sharded, each replica receives only its part's sum and keeps only that part's state: the
  // run says so, as nothing else it prints would show the flag took effect.
  const bool sharded = trainer.config().shard_optimizer;
  const std::string state = sharded ? ", each replica keeping the optimizer state of 1/" +
                                          std::to_string(sched.replicas) +
                                          " of every parameter (--shard-optimizer)"
                                    : "";
  std::printf(
      "data   %d replicas x %s = %d ranks (rank r: pipeline rank r mod %d of "
      "replica r div %d), %s each, gradients %s per stage over the replicas "
      "in %s bucket(s)%s\n",
      sched.replicas, counted(sched.num_ranks(), "pipeline rank").c_str(),
      sched.replicas * sched.num_ranks(), sched.num_ranks(), sched.num_ranks(),
      counted(sched.num_microbatches, "micro-batch", "micro-batches").c_str(),
      sharded ? "reduce-scattered" : "summed", buckets.c_str(), state.c_str());
}

namespace {

// Where rank `rank` runs, as this process knows it: a GPU rank of another process (NCCL over
// MPI) runs on that process's GPU, which only that process knows.
std::string rank_device_text(Trainer& trainer, int rank) {
  const PipelineExecutor& executor = trainer.executor();
  const Device device = trainer.rank_devices()[rank];
  if (!device.is_cuda() || executor.holds_all_ranks() || executor.local_ranks().front() == rank)
    return device.to_string();
  return "rank " + std::to_string(rank) + "'s GPU";
}

// When the step's first action, of any rank of any replica, started, in microseconds from the
// start of the step's pipeline: the origin the step's trace counts from.
double first_action_us(const std::vector<std::vector<schedule::ActionTiming>>& timing) {
  double first = INFINITY;
  for (const auto& rank : timing)
    for (const auto& t : rank) first = std::min(first, t.start);
  return std::isfinite(first) ? first : 0.0;
}

}  // namespace

void print_pipeline(Trainer& trainer) {
  const auto& sched = trainer.executor().schedule();
  // A --schedule-file's own name, and the file, which a generated schedule of that name is not.
  // A hand-written file need not name its schedule.
  std::string schedule = sched.name.empty() ? "(unnamed)" : escaped_for_message(sched.name);
  if (const std::string& file = trainer.config().schedule_file; !file.empty())
    schedule += " from '" + escaped_for_message(file) + "'";
  std::printf("pipeline %d rank(s) x %d chunk(s), schedule %s, transport %s, stages (units):",
              sched.num_ranks(), sched.placement.chunks, schedule.c_str(),
              trainer.executor().transport_kind() == TransportKind::kMpi ? "mpi"
              : trainer.executor().uses_nccl()                           ? "nccl"
                                                                         : "in-process");
  const auto& ranges = trainer.stage_ranges();
  for (size_t s = 0; s < ranges.size(); ++s) {
    if (!shown_in_list(s, ranges.size())) continue;
    std::printf("%s %zu:[%lld,%lld)@%s", left_out_before(s, ranges.size()).c_str(), s,
                static_cast<long long>(ranges[s].begin), static_cast<long long>(ranges[s].end),
                rank_device_text(trainer, sched.placement.rank_of(static_cast<int>(s))).c_str());
  }
  std::printf("\n");
  // Every generated schedule adds each stage's weight gradients in ascending micro-batch
  // order, which is what makes runs of any schedule bitwise alike; a file may not, and then
  // its run is its own.
  std::string why;
  if (const std::string& file = trainer.config().schedule_file;
      !file.empty() && !schedule::weight_grads_ascending(sched, &why))
    std::printf(
        "note   schedule file '%s' applies weight gradients out of micro-batch order (%s): "
        "they add up in another order than under any generated schedule, so from step 2 on the "
        "losses and weights may differ in their last bits from those of other schedules, and a "
        "resume without this file does not go on bit for bit\n",
        escaped_for_message(file).c_str(), why.c_str());
}

void report_bubble(Trainer& trainer, PipelineStepResult& last, ReplacedFile* trace,
                   const RunTrace& run, const std::vector<SaveTiming>& saves) {
  const auto& sched = trainer.executor().schedule();
  // Under MPI every process takes part; rank 0 prints and writes the trace.
  trainer.executor().gather_timing(last);
  // The printed figures are replica 0's, the trace draws every replica.
  const auto replica0 = schedule::replica_timeline(sched, last.timing, 0);
  const schedule::SimResult measured = summarize_timing(sched, replica0);
  // The simulated step the printed figures come from, drawn into the trace beside the
  // measured one; a one-stage run prints none, and its trace claims none either.
  std::string simulated_trace;
  if (sched.num_ranks() > 1) {
    const schedule::SimResult predicted =
        schedule::simulate(sched, measured_costs(sched, replica0));
    if (trace) {
      // Flow ids past every replica's measured ones, so that no arrow joins the two.
      const schedule::TraceProcesses processes{
          .first_pid = RunTrace::kSimulatedPid,
          .first_flow_id = schedule::trace_flow_ids(sched, sched.replicas),
          .name_prefix = "simulated "};
      simulated_trace =
          schedule::chrome_trace_json(sched, predicted, /*us_per_unit=*/1.0, processes);
    }
    std::printf(
        "bubble last step: measured %.3f, simulated %.3f | idle per rank, measured "
        "(simulated):",
        measured.bubble_fraction, predicted.bubble_fraction);
    const auto ranks = static_cast<size_t>(sched.num_ranks());
    for (size_t r = 0; r < ranks; ++r) {
      if (!shown_in_list(r, ranks)) continue;
      const double m_idle = measured.makespan > 0 ? measured.ranks[r].idle / measured.makespan : 0;
      const double p_idle =
          predicted.makespan > 0 ? predicted.ranks[r].idle / predicted.makespan : 0;
      std::printf("%s r%zu %.3f (%.3f)", left_out_before(r, ranks).c_str(), r, m_idle, p_idle);
    }
    std::printf("\n");
    const schedule::ReductionOverlap m_reduce = reduction_overlap(sched, measured);
    if (m_reduce.reduce_time > 0) {
      const schedule::ReductionOverlap p_reduce = reduction_overlap(sched, predicted);
      std::printf(
          "all-reduce last step: %.1f ms in all, hidden behind compute: measured %.3f, "
          "simulated %.3f\n",
          m_reduce.reduce_time / 1e3,  // the step's timeline is in microseconds
          m_reduce.hidden_fraction(), p_reduce.hidden_fraction());
    }
  }
  if (trace) {
    trace->commit(
        run.to_json(schedule::chrome_trace_json(sched, summarize_replicas(sched, last.timing),
                                                /*us_per_unit=*/1.0),
                    simulated_trace, first_action_us(last.timing), saves));
    std::printf(
        "trace  %s (the run's steps, held-out evaluations and checkpoint saves, and the last "
        "step's measured timeline of every rank%s)\n",
        escaped_for_message(trace->path()).c_str(),
        simulated_trace.empty() ? "" : " with its simulation under the measured costs");
  }
}

namespace {

// Three significant digits (0.0268, 1.43, 12.3, 1234): a short run's time shown as "0.0"
// would contradict the rate printed beside it.
std::string seconds_text(double seconds) {
  int decimals = 0;
  if (seconds > 0 && seconds < 100)
    decimals = std::min(9, 2 - static_cast<int>(std::floor(std::log10(seconds))));
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, seconds);
  return buf;
}

}  // namespace

void print_summary(Trainer& trainer, const TrainConfig& config, const RunTotals& t, int signal,
                   bool logging_steps) {
  const double tokens = static_cast<double>(t.steps * config.batch_tokens);
  if (signal != 0)
    std::printf("%s at step %lld of %lld by %s;%s\n",
                sigterm_under_a_launcher(signal) ? "stopped" : "interrupted",
                static_cast<long long>(t.last_step), static_cast<long long>(config.steps),
                signal_name(signal),
                logging_steps ? " the log holds every finished step"
                              : " the step in progress finished first");
  std::printf("done   %s, %.0f tokens in %s s (%s tok/s), allocator peak %s\n",
              counted(static_cast<long long>(t.steps), "step").c_str(), tokens,
              seconds_text(t.seconds).c_str(),
              human_rate(t.seconds > 0 ? tokens / t.seconds : 0.0).c_str(),
              bytes_text(static_cast<double>(t.peak)).c_str());
  if (t.steps == 0) return;
  const size_t tail = std::min<size_t>(10, t.losses.size());
  double tail_loss = 0.0;
  for (size_t i = t.losses.size() - tail; i < t.losses.size(); ++i)
    tail_loss += t.losses[i] / static_cast<double>(tail);
  std::printf("loss   final %.4f, mean of last %s %.4f", t.last_loss, counted(tail, "step").c_str(),
              tail_loss);
  if (const auto entropy = trainer.source().entropy()) {
    // A chain whose every row has one successor has entropy 0, against which a gap in percent
    // would be infinite: its gap is said in nats.
    if (*entropy > 0)
      std::printf(" | source entropy %.4f, gap %+.1f%%", *entropy,
                  100.0 * (tail_loss - *entropy) / *entropy);
    else
      std::printf(" | source entropy 0 (a deterministic chain), gap %+.4f nats/token", tail_loss);
  }
  if (const auto* file = dynamic_cast<const FileSource*>(&trainer.source()))
    std::printf(" | %.3f bits/byte (the file's unigram entropy: %.3f bits/byte)",
                tail_loss / std::log(2.0), file->unigram_entropy() / std::log(2.0));
  std::printf("\n");
}

}  // namespace conveyor::cli
