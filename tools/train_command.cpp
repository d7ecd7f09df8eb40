// `conveyor train`: builds a TrainConfig from a preset and flags, trains, prints one line per
// logged step and a summary, and optionally writes one JSON object per step.

#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "comm/launch_environment.h"
#include "comm/mpi_transport.h"
#include "comm/transport_factory.h"
#include "engine/core/test_pause.h"
#include "engine/core/version.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/schedule/chrome_trace.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/measured_timing.h"
#include "engine/schedule/simulator.h"
#include "engine/schedule/text_format.h"
#include "engine/schedule/validator.h"
#include "engine/train/checkpoint_shard.h"
#include "engine/train/trainer.h"
#include "tools/checkpoint_flags.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "tools/interrupt.h"
#include "tools/mpi_launch.h"
#include "tools/output_file.h"
#include "tools/plan_command.h"
#include "tools/run_flags.h"
#include "tools/run_trace.h"

namespace conveyor::cli {
namespace {

// Typed settings are spelled as words on the command line and parsed here.
struct TrainFlags {
  RunFlags run;    // model, batch, device, memory cap, TF32, recomputation (shared with plan)
  int chunks = 0;  // 0: 2 for interleaved (as `conveyor schedule`), else 1
  std::string schedule = "1f1b";
  std::string partition = "uniform";
  std::string placement = "auto";
  std::string transport = "auto";
  TrainConfig config;
  std::string log_json;
  int64_t log_every = 10;
  double timeout_s = 120.0;
  std::string trace;
  bool quiet = false;
  CheckpointFlags checkpoint;
  std::string plan_file;  // --plan FILE
  bool weights_checksum = false;
  int64_t eval_batches = 0;  // held-out batches after the training data; 0: none
};

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

// Data parallelism: how the ranks make up the replicas, and each replica's share.
void print_data_parallel(Trainer& trainer) {
  const auto& sched = trainer.executor().schedule();
  if (sched.replicas == 1) return;
  std::string buckets;
  for (int s = 0; s < sched.num_stages(); ++s)
    buckets += (s == 0 ? "" : ",") + std::to_string(schedule::gradient_buckets(sched, s));
  std::printf(
      "data   %d replicas x %d pipeline ranks = %d ranks (rank r: pipeline rank r mod %d of "
      "replica r div %d), %d micro-batches each, gradients summed per stage over the replicas "
      "in %s bucket(s)\n",
      sched.replicas, sched.num_ranks(), sched.replicas * sched.num_ranks(), sched.num_ranks(),
      sched.num_ranks(), sched.num_microbatches, buckets.c_str());
}

// Where rank `rank` runs, as this process knows it: a GPU rank of another process (NCCL over
// MPI) runs on that process's GPU, which only that process knows.
std::string rank_device_text(Trainer& trainer, int rank) {
  const PipelineExecutor& executor = trainer.executor();
  const Device device = trainer.rank_devices()[rank];
  if (!device.is_cuda() || executor.holds_all_ranks() || executor.local_ranks().front() == rank)
    return device.to_string();
  return "rank " + std::to_string(rank) + "'s GPU";
}

void print_pipeline(Trainer& trainer) {
  const auto& sched = trainer.executor().schedule();
  std::printf("pipeline %d rank(s) x %d chunk(s), schedule %s, transport %s, stages (units):",
              sched.num_ranks(), sched.placement.chunks, sched.name.c_str(),
              trainer.executor().transport_kind() == TransportKind::kMpi ? "mpi"
              : trainer.executor().uses_nccl()                           ? "nccl"
                                                                         : "in-process");
  const auto& ranges = trainer.stage_ranges();
  for (size_t s = 0; s < ranges.size(); ++s)
    std::printf(" %zu:[%lld,%lld)@%s", s, static_cast<long long>(ranges[s].begin),
                static_cast<long long>(ranges[s].end),
                rank_device_text(trainer, sched.placement.rank_of(static_cast<int>(s))).c_str());
  std::printf("\n");
}

// Measured bubble of the last step per rank, next to the simulator's prediction for the
// costs measured in that step (a one-stage run has no bubble); optionally the measured
// timeline as a Chrome trace. Under MPI it first gathers every rank's timeline into `last`.
void report_bubble(Trainer& trainer, PipelineStepResult& last, OutputFile* trace,
                   const RunTrace& run, const std::vector<SaveTiming>& saves) {
  const auto& sched = trainer.executor().schedule();
  // Under MPI every process takes part; rank 0 prints and writes the trace.
  trainer.executor().gather_timing(last);
  // The printed figures are replica 0's, the trace draws every replica.
  const auto replica0 = schedule::replica_timeline(sched, last.timing, 0);
  const schedule::SimResult measured = summarize_timing(sched, replica0);
  if (sched.num_ranks() > 1) {
    const schedule::SimResult predicted =
        schedule::simulate(sched, measured_costs(sched, replica0));
    std::printf(
        "bubble last step: measured %.3f, simulated %.3f | idle per rank, measured "
        "(simulated):",
        measured.bubble_fraction, predicted.bubble_fraction);
    for (int r = 0; r < sched.num_ranks(); ++r) {
      const double m_idle = measured.makespan > 0 ? measured.ranks[r].idle / measured.makespan : 0;
      const double p_idle =
          predicted.makespan > 0 ? predicted.ranks[r].idle / predicted.makespan : 0;
      std::printf(" r%d %.3f (%.3f)", r, m_idle, p_idle);
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
    trace->write(
        run.to_json(schedule::chrome_trace_json(sched, summarize_replicas(sched, last.timing),
                                                /*us_per_unit=*/1.0),
                    saves));
    trace->close();
    std::printf(
        "trace  %s (the run's steps and checkpoint saves, and the last step's measured "
        "timeline of every rank)\n",
        escape_for_message(trace->path()).c_str());
  }
}

// --schedule-file fixes the ranks, chunks and kind; flags given next to it must agree.
// A flag given next to a file that decides its setting (a schedule or a plan file) and says
// otherwise: refused, naming the flag, the file (`shown`), the file's value and which of
// them decides.
[[noreturn]] void refuse_disagreement(const std::string& flag, const std::string& given,
                                      const std::string& shown, const std::string& has,
                                      const std::string& decider) {
  throw UsageError(flag + " " + given + " disagrees with " + shown + ", which has " + has + "; " +
                   decider + " decides, so leave " + flag + " out or make it agree");
}

void check_schedule_file_agrees(const TrainFlags& f, const CLI::App& cmd) {
  const std::string& file = f.config.schedule_file;
  schedule::Schedule loaded;
  try {
    loaded = schedule::load_schedule(file);
  } catch (const schedule::ScheduleError& e) {
    throw UsageError(e.what());
  }
  const std::string shown = "schedule file '" + escape_for_message(file) + "'";
  // The trainer validates it too, but its message would not say which input was wrong.
  try {
    schedule::validate(loaded);
  } catch (const schedule::ScheduleError& e) {
    throw UsageError(shown + " is not a valid schedule: " + e.what());
  }
  auto disagree = [&](const std::string& flag, const std::string& given, const std::string& has) {
    refuse_disagreement(flag, given, shown, has, "the file");
  };
  if (cmd.count("--stages") && f.config.stages != loaded.num_ranks())
    disagree("--stages", std::to_string(f.config.stages),
             std::to_string(loaded.num_ranks()) + " rank(s)");
  if (cmd.count("--chunks") && f.chunks != loaded.placement.chunks)
    disagree("--chunks", std::to_string(f.chunks),
             std::to_string(loaded.placement.chunks) + " chunk(s) per rank");
  if (cmd.count("--schedule") && !loaded.name.empty() && f.schedule != loaded.name)
    disagree("--schedule", f.schedule, "schedule '" + escape_for_message(loaded.name) + "'");
}

schedule::ScheduleKind parse_schedule(const std::string& name) {
  if (const auto kind = schedule::parse_schedule_kind(name)) return *kind;
  throw UsageError("unknown schedule '" + name + "', expected " +
                   schedule::schedule_kind_choices());
}

// "uniform", "params", or blocks per stage such as "3,5,5,3".
PartitionSpec parse_partition(const std::string& text) {
  if (text == "auto") return PartitionSpec::uniform();  // replaced by apply_planning
  if (text == "uniform") return PartitionSpec::uniform();
  if (text == "params") return PartitionSpec::by_parameters();
  std::vector<int64_t> counts;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    // Digits only, as every integer flag.
    const std::optional<uint64_t> value = parse_decimal_digits(item);
    if (!value || *value > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw UsageError("partition '" + text +
                       "' is not uniform, params or a list of block counts such as 3,5,5,3");
    counts.push_back(static_cast<int64_t>(*value));
  }
  // getline drops an empty last item: "3,5," would run as "3,5".
  if (counts.empty() || text.back() == ',')
    throw UsageError("partition '" + text +
                     "' is not uniform, params or a list of block counts such as 3,5,5,3");
  return PartitionSpec::explicit_blocks(std::move(counts));
}

RankPlacement parse_placement(const std::string& name) {
  if (name == "auto") return RankPlacement::kAuto;
  if (name == "shared") return RankPlacement::kShared;
  throw UsageError("placement must be auto or shared, got '" + name + "'");
}

TransportKind parse_transport(const std::string& name) {
  if (name == "auto") return TransportKind::kAuto;
  if (name == "inproc") return TransportKind::kInProcess;
  if (name == "nccl") return TransportKind::kNccl;
  if (name == "mpi") return TransportKind::kMpi;
  throw UsageError("transport must be auto, inproc or nccl, or mpi under mpirun, got '" + name +
                   "'");
}

// Threads of one process cannot be spread over the processes of a launch: each process
// would run every rank and train the whole job alone.
void refuse_in_process_under_a_launcher(TransportKind transport) {
  const comm::LaunchEnvironment launch = comm::launch_environment();
  if (transport != TransportKind::kInProcess || launch.processes <= 1) return;
  throw UsageError(
      "--transport inproc runs every rank as a thread of one process, but the "
      "launcher started " +
      std::string(launch.at_least ? "at least " : "") + std::to_string(launch.processes) +
      " processes (" + launch.source +
      "), each of which would train the whole job alone; leave --transport out "
      "(auto gives each process one rank) or run without mpirun or srun");
}

TrainConfig resolve_config(TrainFlags& f, const CLI::App& cmd) {
  TrainConfig config = f.config;
  f.run.apply(cmd, config);
  config.schedule = parse_schedule(f.schedule);
  config.partition = parse_partition(f.partition);
  config.placement = parse_placement(f.placement);
  config.transport = parse_transport(f.transport);
  refuse_in_process_under_a_launcher(config.transport);
  config.chunks =
      f.chunks > 0 ? f.chunks : (config.schedule == schedule::ScheduleKind::kInterleaved ? 2 : 1);
  // A plan chooses the micro-batch count; until then any count the batch allows stands in,
  // so a batch the default of 4 does not divide is not refused before planning.
  if ((f.partition == "auto" || !f.plan_file.empty()) && !cmd.count("--microbatches"))
    config.microbatches = config.data_parallel;
  if (!config.schedule_file.empty()) check_schedule_file_agrees(f, cmd);
  // Byte-level tokens of a file need 256 ids unless --vocab says otherwise.
  if (!cmd.count("--vocab") && !config.data_path.empty() && config.model.vocab < 256)
    config.model.vocab = 256;
  // Said with the flags' names here; the optimizer's and the transport's own checks name
  // their fields (min_lr, "transport timeout"), not what the user typed.
  OptimizerConfig& opt = config.optimizer;
  // The default final rate is for the default peak: a smaller --lr given alone decays to
  // itself, rather than being refused for a --min-lr the user never gave.
  if (!cmd.count("--min-lr")) opt.min_lr = std::min(opt.min_lr, opt.lr);
  if (opt.kind != "adamw" && opt.kind != "sgd")
    throw UsageError("--optimizer must be adamw or sgd, got '" + escape_for_message(opt.kind) +
                     "'");
  if (opt.min_lr > opt.lr)
    throw UsageError("--min-lr " + format_number(opt.min_lr) + " is more than --lr " +
                     format_number(opt.lr) +
                     "; the learning rate decays from --lr to --min-lr, which must be in [0, "
                     "--lr]");
  if (f.timeout_s * 1000 < 1)
    throw UsageError("--timeout " + format_number(f.timeout_s) +
                     " is less than 1 ms, the shortest wait accepted (seconds, such as 0.5)");
  config.transport_timeout = std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000));
  // One replica all-reduces nothing, so a bucket size would be ignored without a word, as
  // --shard-optimizer without --dp is refused. The default, written out, changes nothing.
  if (cmd.count("--bucket-mb") && config.data_parallel < 2 &&
      f.run.bucket_mb != kDefaultGradientBucketMiB)
    throw UsageError("--bucket-mb " + escape_for_message(f.run.bucket_mb_text) +
                     " sizes the gradient all-reduce buckets of data-parallel replicas, but this "
                     "run has one replica; give --dp 2 or more, or leave --bucket-mb out");
  try {
    config.model.validate();
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  return config;
}

// "3,5,5,3": the blocks per stage of an explicit partition.
std::string block_counts_text(const PartitionSpec& partition) {
  std::string out;
  for (const int64_t b : partition.blocks) out += (out.empty() ? "" : ",") + std::to_string(b);
  return out;
}

// What the ranks must run alike once a plan has set it.
std::string layout_text(const TrainConfig& c) {
  return "stages=" + std::to_string(c.stages) +
         " schedule=" + schedule::schedule_kind_name(c.schedule) +
         " chunks=" + std::to_string(c.chunks) + " microbatches=" + std::to_string(c.microbatches) +
         " partition=" + block_counts_text(c.partition) + " recompute=" + to_string(c.recompute);
}

// One replica's pipeline: 1/D of the batch, what a plan (a file or --partition auto) is made
// for. config.validate() has checked that the replicas share the batch equally.
TrainConfig replica_share(const TrainConfig& config) {
  TrainConfig share = config;
  share.batch_tokens = config.batch_tokens / config.data_parallel;
  return share;
}

// The planned layout of one replica's pipeline, taken by the run: every replica runs it, so
// the run's --microbatches is D times the planned count.
void take_planned_layout(TrainConfig& config, const TrainConfig& share) {
  config.stages = share.stages;
  config.schedule = share.schedule;
  config.chunks = share.chunks;
  config.microbatches = share.microbatches * config.data_parallel;
  config.partition = share.partition;
  config.recompute = share.recompute;
}

// --plan FILE and --partition auto: the pipeline settings come from a plan (a file, or one
// made now by profiling on `device`); an explicit block list or --recompute still wins.
void apply_planning(const TrainFlags& f, const CLI::App& cmd, const MpiSession& mpi, Device device,
                    TrainConfig& config) {
  if (!f.plan_file.empty() && f.partition == "auto")
    throw UsageError("--plan and --partition auto both choose the layout; give one of them");
  if (!config.schedule_file.empty() && (!f.plan_file.empty() || f.partition == "auto"))
    throw UsageError(std::string(f.plan_file.empty() ? "--partition auto" : "--plan") +
                     " chooses the schedule, and so does --schedule-file; give one of them");
  const PartitionSpec given = config.partition;
  const schedule::ScheduleKind flags_schedule = config.schedule;
  if (!f.plan_file.empty()) {
    // A plan file describes one pipeline over the batch it was planned for, as --partition
    // auto plans one: with --dp D each replica runs it on its batch/D tokens, and the run's
    // --microbatches is D times the file's.
    const TrainConfig flags = config;
    const int64_t replicas = config.data_parallel;
    TrainConfig share = replica_share(config);
    apply_plan_file(f.plan_file, share, replicas);
    take_planned_layout(config, share);
    // The plan decides the layout, as a schedule file does; a flag that says otherwise is
    // refused rather than ignored. Explicit block counts and --recompute win over the plan.
    const std::string shown = "plan file '" + escape_for_message(f.plan_file) + "'";
    auto agree = [&](const char* flag, const std::string& given, const std::string& planned) {
      if (cmd.count(flag) && given != planned)
        refuse_disagreement(flag, given, shown, planned, "the plan");
    };
    agree("--stages", std::to_string(flags.stages), std::to_string(config.stages));
    agree("--schedule", schedule::schedule_kind_name(flags.schedule),
          schedule::schedule_kind_name(config.schedule));
    agree("--chunks", std::to_string(flags.chunks), std::to_string(config.chunks));
    agree("--microbatches", std::to_string(flags.microbatches),
          replicas > 1
              ? std::to_string(share.microbatches) + " per replica, " +
                    std::to_string(config.microbatches) + " over --dp " + std::to_string(replicas)
              : std::to_string(config.microbatches));
    if (given.kind == PartitionSpec::Kind::kBlocks)
      config.partition = given;
    else if (cmd.count("--partition"))
      throw UsageError("--partition " + f.partition + " disagrees with " + shown +
                       ", which has block counts " + block_counts_text(config.partition) +
                       "; leave --partition out, or give block counts, which win over the plan");
    if (cmd.count("--recompute")) config.recompute = flags.recompute;
    // Under mpirun each process reads the file at its own path (a node's own copy, maybe).
    check_same_configuration(
        mpi, {{"the layout of --plan (each process reads the file)", layout_text(config)}});
  } else if (f.partition == "auto") {
    // What is given explicitly limits the search, as it must agree with a plan file.
    // With --dp D each replica's pipeline runs 1/D of the batch in M/D micro-batches: that
    // share is what is planned, and the run's --microbatches is D times the planned count.
    // config.validate() has checked that a given --microbatches divides by D.
    const int64_t replicas = config.data_parallel;
    TrainConfig share = replica_share(config);
    PlanConstraints constraints;
    if (cmd.count("--schedule")) constraints.schedule = flags_schedule;
    if (cmd.count("--chunks")) constraints.chunks = f.chunks;
    if (cmd.count("--microbatches")) constraints.microbatches = f.config.microbatches / replicas;
    constraints.replicas = static_cast<int>(replicas);
    // A schedule the flags fix whole that cannot be generated says why, as it does without
    // auto, before profiling; the planner would only find no layout. Interleaved without
    // --chunks is left to the planner, which tries several chunk counts.
    const bool whole =
        constraints.schedule && constraints.microbatches &&
        (constraints.chunks || *constraints.schedule != schedule::ScheduleKind::kInterleaved);
    if (whole) {
      try {
        make_schedule(config);
      } catch (const schedule::ScheduleError& e) {
        throw UsageError(e.what());
      }
    }
    const PlannedRun run = plan_training(share, device, 3, !f.quiet, constraints);
    const PlanCandidate& best = best_pipeline(run);
    // Under mpirun every process profiles its own device, and close candidates can swap
    // places between processes: all run rank 0's plan.
    apply_plan_text(rank_zero_text(mpi, plan_text(best, share), "the plan"), "rank 0's plan",
                    share);
    take_planned_layout(config, share);
    if (replicas > 1)
      std::printf(
          "plan   %s, %lld micro-batches of each replica's %lld tokens (--microbatches %lld "
          "over --dp %lld), predicted step %.3f ms\n",
          best.layout.c_str(), static_cast<long long>(share.microbatches),
          static_cast<long long>(share.batch_tokens), static_cast<long long>(config.microbatches),
          static_cast<long long>(replicas), best.step_seconds * 1e3);
    else
      std::printf("plan   %s, %lld micro-batches, predicted step %.3f ms\n", best.layout.c_str(),
                  static_cast<long long>(config.microbatches), best.step_seconds * 1e3);
  } else {
    return;
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

// One rank among several processes (mpirun, srun): MPI starts when --transport mpi asks for
// it, or, with auto or nccl (which MPI bootstraps then), when the launcher started several
// processes.
bool wants_mpi(const TrainConfig& config) { return comm::one_rank_per_process(config.transport); }

// A GPU process under mpirun takes the GPU of its node-local rank, modulo the GPUs it sees;
// --device cuda:N pins it. Ranks that end up on one GPU are refused next
// (check_gpus_not_shared).
Device process_device(const MpiSession& mpi, const std::string& device_flag, Device resolved) {
  if (!mpi.active() || !resolved.is_cuda() || device_flag.find(':') != std::string::npos)
    return resolved;
  return Device::cuda(comm::node_local_rank() % cuda_device_count());
}

// The shortest text that reads back as `value`: 0.0010001, not %.17g's 0.0010001000000000001.
std::string exact(double value) {
  char buf[40];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, value).ptr);
}

// What every rank must agree on for the ranks to compute one model's step: a rank with
// another model, cut, schedule, batch or seed would compute something else, or deadlock.
ConfigFields configuration_fields(const TrainFlags& f, const TrainConfig& c) {
  const auto& m = c.model;
  const auto& o = c.optimizer;
  return {
      {"the model (--preset, --d-model, --layers, --hidden, --vocab, --activation)",
       "d_model=" + std::to_string(m.d_model) + " layers=" + std::to_string(m.n_layers) +
           " hidden=" + std::to_string(m.hidden) + " vocab=" + std::to_string(m.vocab) +
           " activation=" + ops::activation_name(m.activation) + " ln_eps=" + exact(m.ln_eps)},
      {"--stages", std::to_string(c.stages)},
      {"--chunks", std::to_string(c.chunks)},
      {"--schedule", f.schedule},
      file_field("--schedule-file", c.schedule_file),
      {"--partition", f.partition},
      {"--batch-tokens", std::to_string(c.batch_tokens)},
      {"--microbatches", std::to_string(c.microbatches)},
      {"--seed", std::to_string(c.seed)},
      {"--steps", std::to_string(c.steps)},
      file_field("--data", c.data_path),
      {"the optimizer (--optimizer, --lr, --min-lr, --warmup, --weight-decay, --clip)",
       o.kind + " lr=" + exact(o.lr) + " min_lr=" + exact(o.min_lr) +
           " warmup=" + std::to_string(o.warmup_steps) + " weight_decay=" + exact(o.weight_decay) +
           " clip=" + exact(o.clip_norm)},
      {"--device", f.run.device},
      {"--tf32", c.allow_tf32 ? "on" : "off"},
      {"--transport", f.transport},
      {"--dp", std::to_string(c.data_parallel)},
      {"--shard-optimizer", c.shard_optimizer ? "on" : "off"},
      {"--bucket-mb", c.gradient_bucket_mib ? exact(*c.gradient_bucket_mib) : "not given"},
      {"--eval-batches", std::to_string(f.eval_batches)},
      {"--plan", f.plan_file},
      // Last: a rank whose binary reads files or saves checkpoints otherwise may still agree
      // on every flag above.
      {"the build (Conveyor version and commit, checkpoint and schedule file formats)",
       std::string("conveyor ") + version() + " commit " + build_commit() + ", checkpoint format " +
           std::to_string(kCheckpointFormatVersion) + ", schedule text format " +
           std::to_string(schedule::kScheduleTextFormatVersion)},
  };
}

// Rank 0 alone prints and writes files; the others stay quiet unless they fail (errors go
// to stderr, which stays open).
void quiet_unless_rank_zero(const MpiSession& mpi, TrainFlags& f) {
  if (!mpi.active() || mpi.rank() == 0) return;
  if (std::freopen("/dev/null", "w", stdout) == nullptr)
    throw std::runtime_error("cannot silence the output of rank " + std::to_string(mpi.rank()));
  f.log_json.clear();
  f.trace.clear();
}

// The summary after the last step or an interrupt: tokens, time, losses and references.
struct RunTotals {
  int64_t steps = 0;      // run by this process (a resumed run starts later)
  int64_t last_step = 0;  // the number of the last finished step
  double seconds = 0.0, last_loss = 0.0;
  std::vector<double> losses;
  size_t peak = 0;
};

void print_summary(Trainer& trainer, const TrainConfig& config, const RunTotals& t, int signal) {
  const double tokens = static_cast<double>(t.steps * config.batch_tokens);
  if (signal != 0)
    std::printf("interrupted at step %lld of %lld by %s; the log holds every finished step\n",
                static_cast<long long>(t.last_step), static_cast<long long>(config.steps),
                signal == SIGINT ? "SIGINT" : "SIGTERM");
  std::printf("done   %lld steps, %.0f tokens in %.1f s (%s tok/s), allocator peak %s\n",
              static_cast<long long>(t.steps), tokens, t.seconds,
              human_rate(t.seconds > 0 ? tokens / t.seconds : 0.0).c_str(),
              bytes_text(static_cast<double>(t.peak)).c_str());
  if (t.steps == 0) return;
  const size_t tail = std::min<size_t>(10, t.losses.size());
  double tail_loss = 0.0;
  for (size_t i = t.losses.size() - tail; i < t.losses.size(); ++i)
    tail_loss += t.losses[i] / static_cast<double>(tail);
  std::printf("loss   final %.4f, mean of last %zu steps %.4f", t.last_loss, tail, tail_loss);
  if (const auto entropy = trainer.source().entropy())
    std::printf(" | source entropy %.4f, gap %+.1f%%", *entropy,
                100.0 * (tail_loss - *entropy) / *entropy);
  if (const auto* file = dynamic_cast<const FileSource*>(&trainer.source()))
    std::printf(" | %.3f bits/byte (the file's unigram entropy: %.3f bits/byte)",
                tail_loss / std::log(2.0), file->unigram_entropy() / std::log(2.0));
  std::printf("\n");
}

// With --data, the held-out batches must follow the training data within the file: past its
// end the source wraps and would evaluate on bytes the run trained on.
void check_eval_fits(Trainer& trainer, const TrainConfig& config, int64_t eval_batches) {
  const auto* file = dynamic_cast<const FileSource*>(&trainer.source());
  if (eval_batches == 0 || file == nullptr) return;
  const uint64_t needed = static_cast<uint64_t>(config.steps + eval_batches) *
                          static_cast<uint64_t>(config.batch_tokens);
  // One token per byte: the file's length is its token count.
  const uint64_t have = static_cast<uint64_t>(std::filesystem::file_size(config.data_path));
  if (needed > have)
    throw UsageError("--eval-batches " + std::to_string(eval_batches) + " needs " +
                     std::to_string(needed) + " tokens of --data (" + std::to_string(config.steps) +
                     " training and " + std::to_string(eval_batches) + " held-out batches of " +
                     std::to_string(config.batch_tokens) + ") but the file has " +
                     std::to_string(have) + "; use fewer --eval-batches or --steps");
}

// A process started with CONVEYOR_TEST_PAUSE_AT=<point> in its environment stops for good at
// that point: "setup" (before the model, the data and the transport are made), "evaluation"
// (as the held-out evaluation starts), "checksum" (before the weights' checksum over every
// rank) or "end" (before the processes meet at the end of the run), while the other
// processes go on into what waits for it: what the failure tests stop or kill, to see every
// other rank end by itself instead of waiting forever.
void pause_if_asked_at(const char* point) { pause_if_asked("CONVEYOR_TEST_PAUSE_AT", point, "at"); }

// Held-out loss on the `batches` batches that follow the trained ones in a fresh copy of the
// run's source, so a resumed run evaluates on the same tokens as an uninterrupted one. A
// collective under MPI.
double evaluate_after_training(Trainer& trainer, int64_t batches) {
  std::unique_ptr<TokenSource> held_out =
      make_token_source_at(trainer.config(), trainer.model().vocab, trainer.source());
  pause_if_asked_at("evaluation");
  return trainer.evaluate(*held_out, batches);
}

// Whether `path` is checkpoint folder `root` itself or a name its checkpoints own there
// (`latest`, step_<N>, step_<N>.tmp and what they hold). Other files in the folder, such as
// a log kept next to the checkpoints, are the user's.
bool in_checkpoint_layout(const std::string& path, const std::string& root) {
  const std::filesystem::path rel = resolved_path(path).lexically_relative(resolved_path(root));
  if (rel.empty()) return false;
  if (rel == ".") return true;
  const std::string first = rel.begin()->string();
  return first == "latest" || first.rfind("step_", 0) == 0;
}

// The output files are opened, and emptied, before any work: one that names an input of the
// run, the other output or a checkpoint would destroy it before the run reads it (a --data
// file read as empty, a `latest` emptied before --resume reads it).
void refuse_outputs_over_inputs(const TrainFlags& f) {
  const std::vector<std::pair<const char*, const std::string*>> outputs = {
      {"--log-json", &f.log_json}, {"--trace", &f.trace}};
  const std::vector<std::pair<const char*, const std::string*>> inputs = {
      {"--data", &f.config.data_path},
      {"--schedule-file", &f.config.schedule_file},
      {"--plan", &f.plan_file}};
  // --resume DIR/latest or DIR/step_<N>: the checkpoints of DIR.
  std::string resumed = f.checkpoint.resume == "latest" ? "" : f.checkpoint.resume;
  if (!resumed.empty()) {
    const std::string name = resolved_path(resumed).filename().string();
    if (name == "latest" || name.rfind("step_", 0) == 0)
      resumed = resolved_path(resumed).parent_path().string();
  }
  // (flag, its value as given, the checkpoint folder it names)
  const std::vector<std::tuple<const char*, const std::string*, std::string>> checkpoints = {
      {"--save-dir", &f.checkpoint.save_dir, f.checkpoint.save_dir},
      {"--resume", &f.checkpoint.resume, resumed}};
  for (size_t o = 0; o < outputs.size(); ++o) {
    const auto& [flag, path] = outputs[o];
    if (path->empty()) continue;
    // A device or a FIFO (/dev/null for both) holds nothing to destroy.
    std::error_code error;
    const auto type = std::filesystem::status(*path, error).type();
    if (!error && type != std::filesystem::file_type::regular &&
        type != std::filesystem::file_type::directory)
      continue;
    const std::string shown = "'" + escape_for_message(*path) + "'";
    for (size_t other = o + 1; other < outputs.size(); ++other)
      if (!outputs[other].second->empty() && same_file(*path, *outputs[other].second))
        throw UsageError(std::string(flag) + " and " + outputs[other].first + " both name " +
                         shown + "; each writes a file of its own, so give each its own name");
    for (const auto& [input, input_path] : inputs)
      if (!input_path->empty() && same_file(*path, *input_path))
        throw UsageError(std::string(flag) + " file " + shown + " is the file " + input +
                         " reads, which writing it would destroy; give " + flag +
                         " a file of its own");
    for (const auto& [folder_flag, given, folder] : checkpoints)
      if (!folder.empty() && in_checkpoint_layout(*path, folder))
        throw UsageError(std::string(flag) + " file " + shown +
                         " would overwrite the checkpoints of " + folder_flag + " '" +
                         escape_for_message(*given) +
                         "' (the folder itself, its latest or a step_<N>); give " + flag +
                         " a file outside them");
  }
}

void run_train(TrainFlags& f, const CLI::App& cmd) {
  check_checkpoint_flags(f.checkpoint, cmd);
  refuse_outputs_over_inputs(f);
  TrainConfig config = resolve_config(f, cmd);
  // Before the trainer, which builds this rank's MPI transport; after it, MPI_Finalize.
  MpiSession mpi(wants_mpi(config), config.transport_timeout);
  // Only under MPI: the fields read every file the run names.
  if (mpi.active()) check_same_configuration(mpi, configuration_fields(f, config));
  quiet_unless_rank_zero(mpi, f);
  std::string note;
  Device device;
  try {
    device = resolve_device(config.device, &note);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (!note.empty()) std::printf("conveyor: %s\n", note.c_str());
  device = process_device(mpi, f.run.device, device);
  // A collective: every rank asks or none, which the agreed --device flag decides; CPU runs
  // have no GPU to share and skip its round trip.
  if (f.run.device != "cpu") check_gpus_not_shared(mpi, device);
  config.device = device;
  apply_planning(f, cmd, mpi, device, config);
  // Under a launcher of several processes each process holds one rank.
  check_threads_in_process(
      config.cpu_threads,
      comm::launched_process_count() > 1 ? 1 : int64_t{config.stages} * config.data_parallel,
      device,
      "--stages " + std::to_string(config.stages) + " x --dp " +
          std::to_string(config.data_parallel));

  // Every output file is opened (and the log locked) before any work, not after the last step.
  std::optional<OutputFile> json_log, trace;
  if (!f.log_json.empty()) json_log.emplace(f.log_json, "--log-json", /*lock=*/true);
  if (!f.trace.empty()) trace.emplace(f.trace, "--trace", /*lock=*/true);

  std::unique_ptr<Trainer> trainer;
  pause_if_asked_at("setup");
  try {
    trainer = std::make_unique<Trainer>(config);
  } catch (const comm::ProcessCountMismatch& e) {
    refuse_on_every_rank(mpi, e.what());
  } catch (const std::invalid_argument& e) {  // schedule, partition, placement, memory too
    throw UsageError(e.what());
  } catch (const std::bad_alloc&) {
    throw UsageError(
        "out of memory while building the model, its optimizer state and the pipeline; use a "
        "smaller model or --memory-cap to see the estimate");
  }
  std::printf("model  %s\n", trainer->model().name.c_str());
  std::printf("data   %s\n", trainer->source().describe().c_str());
  std::printf("device %s | %lld steps x %lld tokens in %lld micro-batches | %s lr %s\n",
              device.to_string().c_str(), static_cast<long long>(config.steps),
              static_cast<long long>(config.batch_tokens),
              static_cast<long long>(config.microbatches), config.optimizer.kind.c_str(),
              format_number(config.optimizer.lr).c_str());
  print_pipeline(*trainer);
  if (config.recompute.any())
    std::printf("recompute %s (forward re-run in the backward)\n",
                to_string(config.recompute).c_str());
  print_data_parallel(*trainer);
  check_eval_fits(*trainer, config, f.eval_batches);
  std::unique_ptr<TrainerCheckpointer> checkpointer = setup_checkpoints(f.checkpoint, *trainer);
  const int64_t first_step = trainer->steps_done() + 1;
  const int64_t last_step_to_run =
      f.checkpoint.stop_after > 0 ? std::min(f.checkpoint.stop_after, config.steps) : config.steps;
  const int64_t steps_run = last_step_to_run - first_step + 1;
  if (steps_run < 1)
    throw UsageError("nothing to train: the run is at step " + std::to_string(first_step - 1) +
                     " and stops at step " + std::to_string(last_step_to_run) +
                     "; raise --steps or --stop-after");
  if (checkpointer) {
    // A first save the folder would refuse (the same command run again, into a folder whose
    // `latest` is at or past that step) is refused now, not once training has reached it:
    // a final save refused lost the whole run. Rank 0 looks, as it prepares the saves.
    const int64_t every = f.checkpoint.save_every;
    const int64_t first_save =
        every > 0 ? std::min(last_step_to_run, (first_step + every - 1) / every * every)
                  : last_step_to_run;
    std::string why;
    if (!mpi.active() || mpi.rank() == 0)
      if (const auto refusal = save_refusal(f.checkpoint.save_dir, first_save))
        why = "--save-dir " + escape_for_message(f.checkpoint.save_dir) +
              " would refuse this run's first save: " + *refusal;
    why = rank_zero_text(mpi, why, "the check of --save-dir");
    if (!why.empty()) refuse_on_every_rank(mpi, why);
  }
  std::fflush(stdout);

  install_interrupt_handlers();
  // Asked by every rank in each step's all-reduce, so all processes stop after the same step.
  trainer->executor().set_stop_request([] { return interrupt_signal(); });
  RunTrace run_trace;
  PipelineStepResult last_step;
  RunTotals t;
  int signal = 0;
  for (int64_t s = first_step; s <= last_step_to_run; ++s) {
    StepStats st;
    const auto step_begin = RunTrace::Clock::now();
    try {
      st = trainer->step();
    } catch (const std::bad_alloc&) {
      throw std::runtime_error("out of memory in training step " + std::to_string(s) +
                               "; use a smaller model or fewer tokens per micro-batch");
    }
    run_trace.add_step(s, step_begin, RunTrace::Clock::now());
    if (checkpointer) {
      checkpointer->after_step();
      if (checkpointer->last_saved_step() == s && !f.quiet)
        std::printf("saved  step %lld (training held %.3f s)\n", static_cast<long long>(s),
                    checkpointer->last_stall_seconds());
    }
    ++t.steps;
    t.last_step = s;
    t.seconds += st.seconds;
    t.peak = std::max(t.peak, st.peak_bytes);
    t.last_loss = st.loss;
    t.losses.push_back(st.loss);
    if (json_log) {
      nlohmann::json row = {{"step", st.step},
                            {"loss", st.loss},
                            {"tokens", st.tokens},
                            {"seconds", st.seconds},
                            {"lr", st.lr},
                            {"grad_norm", st.grad_norm},
                            {"peak_bytes", st.peak_bytes}};
      json_log->write(row.dump() + "\n");
    }
    if (!f.quiet && (s % f.log_every == 0 || s == 1 || s == config.steps)) {
      const double rate = st.tokens / st.seconds;
      const double eta =
          t.seconds / static_cast<double>(t.steps) * static_cast<double>(last_step_to_run - s);
      std::printf("step %5lld/%lld | loss %.4f | %s tok/s | lr %.2e | alloc peak %s | eta %.0fs\n",
                  static_cast<long long>(s), static_cast<long long>(config.steps), st.loss,
                  human_rate(rate).c_str(), st.lr,
                  bytes_text(static_cast<double>(st.peak_bytes)).c_str(), eta);
      std::fflush(stdout);
    }
    // A signal ends the run after the step it came in (or the next one, when it came after
    // the step's all-reduce): the step in progress finishes on every rank.
    signal = st.pipeline.stop_signal;
    last_step = std::move(st.pipeline);
    if (signal != 0) break;
  }
  // An interrupted run stops at once: no evaluation; a signal during it ends it too (between
  // groups of batches, as the steps end after the one in progress).
  std::optional<double> eval_loss;
  const int64_t eval_tokens = f.eval_batches * config.batch_tokens;
  if (f.eval_batches > 0 && signal == 0) {
    try {
      eval_loss = evaluate_after_training(*trainer, f.eval_batches);
    } catch (const EvaluationStopped& e) {
      signal = e.signal();
    }
    if (eval_loss && json_log) {
      char hex[40];
      std::snprintf(hex, sizeof hex, "%a", *eval_loss);
      const nlohmann::json row = {{"eval_loss", *eval_loss},
                                  {"eval_loss_hex", hex},
                                  {"eval_batches", f.eval_batches},
                                  {"eval_tokens", eval_tokens}};
      json_log->write(row.dump() + "\n");
    }
  }
  if (json_log) json_log->close();
  // An interrupted run saves the last finished step too, when it saves at all.
  if (checkpointer) {
    checkpointer->finish();
    std::printf("saved  step %lld into %s\n",
                static_cast<long long>(checkpointer->last_saved_step()),
                f.checkpoint.save_dir.c_str());
  }
  print_summary(*trainer, config, t, signal);
  if (eval_loss)
    std::printf("eval   loss %.6f over %lld batch(es) (%lld tokens), exactly %a\n", *eval_loss,
                static_cast<long long>(f.eval_batches), static_cast<long long>(eval_tokens),
                *eval_loss);
  if (t.steps > 0)
    report_bubble(*trainer, last_step, trace ? &*trace : nullptr, run_trace,
                  checkpointer ? checkpointer->save_timings() : std::vector<SaveTiming>{});
  if (f.weights_checksum) {
    pause_if_asked_at("checksum");
    // The checksum is replica 0's: the other replicas must hold the same bits.
    if (trainer->executor().num_replicas() > 1) {
      trainer->executor().check_replicas_agree();
      std::printf("replicas agree: all %d hold replica 0's weights, bit for bit\n",
                  trainer->executor().num_replicas());
    }
    const uint64_t checksum = weights_checksum(trainer->executor(), mpi);
    std::printf("weights xxh3 %016llx\n", static_cast<unsigned long long>(checksum));
  }
  std::fflush(stdout);
  if (signal != 0) throw ExitRequest(signal == SIGTERM ? kExitSigterm : kExitSigint);
  pause_if_asked_at("end");
  mpi.meet_at_the_end();
}

}  // namespace

void register_train_command(CLI::App& app) {
  auto flags = std::make_shared<TrainFlags>();
  TrainConfig& c = flags->config;
  CLI::App* cmd = app.add_subcommand("train", "Train the reference model");
  add_run_flags(cmd, flags->run, RunFlagsFor::kTrain);
  add_int_flag(cmd, "--steps", c.steps, 1, 1000000000, "Optimizer steps");
  add_int_flag(cmd, "--microbatches", c.microbatches, 1, 65536, "Micro-batches per step");
  cmd->add_option("--optimizer", c.optimizer.kind, "adamw or sgd")->capture_default_str();
  constexpr double kMax = std::numeric_limits<double>::max();
  add_float_flag(cmd, "--lr", c.optimizer.lr, 0.0, kMax, true, "Peak learning rate");
  add_float_flag(cmd, "--min-lr", c.optimizer.min_lr, 0.0, kMax, false,
                 "Final learning rate of the cosine decay (left out: 0.0003, or --lr when "
                 "that is smaller)");
  add_int_flag(cmd, "--warmup", c.optimizer.warmup_steps, 0, 1000000000, "Linear warm-up steps");
  add_float_flag(cmd, "--weight-decay", c.optimizer.weight_decay, 0.0, kMax, false,
                 "Decoupled weight decay");
  add_float_flag(cmd, "--clip", c.optimizer.clip_norm, 0.0, kMax, false,
                 "Clip the global gradient norm to this (0 disables clipping)");
  add_int_flag(cmd, "--seed", c.seed, 0, std::numeric_limits<int64_t>::max(),
               "Seed of the weights and of the Markov source");
  add_path_flag(cmd, "--data", c.data_path,
                "Train on the bytes of FILE (a regular file of at most 1024 MiB) instead of "
                "the Markov source")
      ->type_name("FILE");
  add_path_flag(cmd, "--log-json", flags->log_json,
                "Write one JSON object per step to FILE (locked; flushed every line)")
      ->type_name("FILE");
  add_int_flag(cmd, "--log-every", flags->log_every, 1, 1000000000, "Print every N steps");
  cmd->add_flag("--quiet", flags->quiet, "Only print the summary (default off)");
  add_int_flag(cmd, "--stages", c.stages, 1, 1024, "Pipeline ranks (p)");
  add_int_flag(cmd, "--chunks", flags->chunks, 1, 64,
               "Virtual stages per rank (interleaved; zbv always has 2)")
      ->default_str("2 for interleaved, else 1");
  cmd->add_option("--schedule", flags->schedule, "Schedule: " + schedule_choices_text())
      ->capture_default_str();
  add_path_flag(cmd, "--schedule-file", c.schedule_file,
                "Run the schedule in FILE (text or CSV, see `conveyor schedule --dump`); it "
                "fixes the ranks, chunks and kind, and --stages, --chunks or --schedule given "
                "with it must agree")
      ->type_name("FILE");
  cmd->add_option(
         "--partition", flags->partition,
         "Blocks per stage: uniform, params, auto (profile and plan), or counts such as 3,5,5,3")
      ->capture_default_str();
  cmd->add_option("--placement", flags->placement,
                  "auto (one rank per GPU when there are enough) or shared (all on one GPU)")
      ->capture_default_str();
  cmd->add_option("--transport", flags->transport,
                  "auto (under mpirun or srun with several processes: NCCL bootstrapped over "
                  "MPI for CUDA ranks, MPI for CPU ranks; else NCCL when every rank has its own "
                  "GPU), inproc (one process only), nccl or mpi")
      ->capture_default_str();
  add_float_flag(cmd, "--timeout", flags->timeout_s, 0.0, 1000000.0, true,
                 "Seconds a rank waits for a peer before failing");
  add_path_flag(cmd, "--trace", flags->trace,
                "Write a Chrome trace to FILE: the run's steps and checkpoint saves (a "
                "background save on its own thread), and the last step's measured timeline "
                "per rank")
      ->type_name("FILE");
  add_checkpoint_flags(cmd, flags->checkpoint);
  add_path_flag(cmd, "--plan", flags->plan_file,
                "Run the plan in FILE (written by `conveyor plan --out`)")
      ->type_name("FILE");
  add_int_flag(cmd, "--eval-batches", flags->eval_batches, 0, 1000000,
               "After the last step, print the mean loss on the N batches that follow the "
               "training data in the same source (held out; with --data they must fit in the "
               "file)");
  cmd->add_flag("--weights-checksum", flags->weights_checksum,
                "Print an XXH3 checksum of the final weights (to compare runs bit for bit)");
  // Data parallelism.
  add_int_flag(cmd, "--dp", c.data_parallel, 1, 1024,
               "Data-parallel replicas D: --stages x D ranks (rank r is pipeline rank r mod "
               "--stages of replica r div --stages; under mpirun -np stages x D), each on "
               "--microbatches / D of the step's micro-batches (a multiple of D)");
  cmd->add_flag("--shard-optimizer", c.shard_optimizer,
                "With --dp: each replica keeps the AdamW/SGD state of 1/D of every "
                "parameter, receives only the sum of that part of the gradients (a "
                "reduce-scatter), and the replicas gather the updated weights (ZeRO-1; "
                "default off)");
  cmd->footer(std::string("Example: conveyor train --stages 4 --schedule zbh1 --microbatches 8 "
                          "--log-json steps.jsonl\n") +
              kExitStatusText);
  cmd->callback([flags, cmd] { run_train(*flags, *cmd); });
}

}  // namespace conveyor::cli
