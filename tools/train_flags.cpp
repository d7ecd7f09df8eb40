#include "tools/train_flags.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "comm/launch_environment.h"
#include "comm/mpi_transport.h"
#include "comm/transport_factory.h"
#include "engine/core/number_text.h"
#include "engine/core/version.h"
#include "engine/pipeline/partition.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/text_format.h"
#include "engine/schedule/validator.h"
#include "engine/train/checkpoint_shard.h"
#include "engine/train/trainer.h"
#include "tools/cli_common.h"
#include "tools/cli_flags.h"
#include "tools/mpi_launch.h"
#include "tools/plan_command.h"
#include "tools/resume_settings.h"

namespace conveyor::cli {
namespace {

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

// Returns the file's schedule, valid and agreeing with the flags given.
schedule::Schedule check_schedule_file_agrees(const TrainFlags& f, const CLI::App& cmd) {
  const std::string& file = f.config.schedule_file;
  schedule::Schedule loaded;
  try {
    loaded = schedule::load_schedule(file);
  } catch (const schedule::ScheduleError& e) {
    throw UsageError(e.what());
  }
  const std::string shown = "schedule file '" + escaped_for_message(file) + "'";
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
    disagree("--schedule", f.schedule, "schedule '" + escaped_for_message(loaded.name) + "'");
  return loaded;
}

schedule::ScheduleKind parse_schedule(const std::string& name) {
  if (const auto kind = schedule::parse_schedule_kind(name)) return *kind;
  throw not_one_of("--schedule", schedule_choices_text(), name);
}

// "uniform", "params", "auto", or blocks per stage such as "3,5,5,3".
PartitionSpec parse_partition(const std::string& text) {
  const auto refused = [&text] {
    return not_one_of("--partition", "uniform, params, auto or block counts such as 3,5,5,3", text);
  };
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
      throw refused();
    counts.push_back(static_cast<int64_t>(*value));
  }
  // getline drops an empty last item: "3,5," would run as "3,5".
  if (counts.empty() || text.back() == ',') throw refused();
  return PartitionSpec::explicit_blocks(std::move(counts));
}

RankPlacement parse_placement(const std::string& name) {
  if (name == "auto") return RankPlacement::kAuto;
  if (name == "shared") return RankPlacement::kShared;
  throw not_one_of("--placement", "auto or shared", name);
}

TransportKind parse_transport(const std::string& name) {
  if (name == "auto") return TransportKind::kAuto;
  if (name == "inproc") return TransportKind::kInProcess;
  if (name == "nccl") return TransportKind::kNccl;
  if (name == "mpi") return TransportKind::kMpi;
  throw not_one_of("--transport", "auto, inproc, nccl or mpi", name);
}

// Threads of one process cannot be spread over the processes of a launch: each process
// would run every rank and train the whole job alone.
void refuse_in_process_under_a_launcher(TransportKind transport) {
  const comm::LaunchEnvironment launch = comm::launch_environment();
  if (transport != TransportKind::kInProcess || launch.processes <= 1) return;
  throw ErrorOfEveryProcess(
      "--transport inproc runs every rank as a thread of one process, but the "
      "launcher started " +
          std::string(launch.at_least ? "at least " : "") + std::to_string(launch.processes) +
          " processes (" + launch.source +
          "), each of which would train the whole job alone; leave --transport out "
          "(auto gives each process one rank) or run without mpirun or srun",
      kExitUsage);
}

}  // namespace

bool microbatches_chosen_elsewhere(const TrainFlags& f, const TrainConfig& config) {
  return !config.schedule_file.empty() || !f.plan_file.empty() || f.partition == "auto";
}

namespace {

// Byte-level tokens of a file need 256 ids unless --vocab says otherwise.
void raise_vocab_for_data(const CLI::App& cmd, TrainConfig& config) {
  if (!cmd.count("--vocab") && !config.data_path.empty() && config.model.vocab < 256)
    config.model.vocab = 256;
}

// The flags' settings, with a resume's inherited ones in place, completed and checked.
TrainConfig checked_config(TrainFlags& f, const CLI::App& cmd, TrainConfig config) {
  config.schedule = parse_schedule(f.schedule);
  config.partition = parse_partition(f.partition);
  config.placement = parse_placement(f.placement);
  config.transport = parse_transport(f.transport);
  refuse_in_process_under_a_launcher(config.transport);
  config.chunks =
      f.chunks > 0 ? f.chunks : (config.schedule == schedule::ScheduleKind::kInterleaved ? 2 : 1);
  // Where the flags fix the schedule kind; a plan, a schedule file or --partition auto
  // without --schedule choose it, and check --chunks against their choice.
  if (cmd.count("--chunks") && config.schedule_file.empty() && f.plan_file.empty() &&
      (f.partition != "auto" || cmd.count("--schedule")))
    check_chunks_flag(config.schedule, f.chunks);
  // A plan chooses the micro-batch count; until then any count the batch allows stands in,
  // so a batch the default of 4 does not divide is not refused before planning.
  if ((f.partition == "auto" || !f.plan_file.empty()) && !cmd.count("--microbatches"))
    config.microbatches = config.data_parallel;
  if (!config.schedule_file.empty()) {
    // The file fixes the ranks and chunks; its micro-batches and replicas stand too where no
    // flag gives them (one that does must agree, which make_schedule checks with the
    // numbers), as a plan file's do: the defaults (4, 1) would only be refused.
    const schedule::Schedule loaded = check_schedule_file_agrees(f, cmd);
    config.stages = loaded.num_ranks();
    config.chunks = loaded.placement.chunks;
    if (!cmd.count("--dp")) config.data_parallel = loaded.replicas;
    if (!cmd.count("--microbatches")) {
      config.microbatches = int64_t{loaded.num_microbatches} * config.data_parallel;
      // Said of the file: a --microbatches the user never typed cannot be the one to change.
      if (config.batch_tokens % config.microbatches != 0)
        throw UsageError("schedule file " + quoted_file_name(config.schedule_file) + " has " +
                         counted(loaded.num_microbatches, "micro-batch", "micro-batches") +
                         (config.data_parallel > 1
                              ? " per replica, " + std::to_string(config.microbatches) +
                                    " over --dp " + std::to_string(config.data_parallel)
                              : std::string()) +
                         ", which cannot split the batch of --batch-tokens " +
                         std::to_string(config.batch_tokens) +
                         " into equal micro-batches; give a --batch-tokens that " +
                         std::to_string(config.microbatches) +
                         " divides, or a schedule file whose micro-batch count divides it");
    }
  }
  raise_vocab_for_data(cmd, config);
  // Said with the flag the user typed; the source's own check names its field.
  if (config.data_path.empty() && config.model.vocab > MarkovSource::kMaxVocab)
    throw UsageError("--vocab " + std::to_string(config.model.vocab) +
                     " is more than the Markov chain (the data without --data) takes, " +
                     std::to_string(MarkovSource::kMaxVocab) +
                     " (its set-up grows with the vocab and takes seconds at the top); give "
                     "--vocab " +
                     std::to_string(MarkovSource::kMaxVocab) +
                     " or less, or train on a file's bytes (--data FILE)");
  // Said with the flags' names here; the optimizer's and the transport's own checks name
  // their fields (min_lr, "transport timeout"), not what the user typed.
  OptimizerConfig& opt = config.optimizer;
  // The default final rate is for the default peak: a smaller --lr given alone decays to
  // itself, rather than being refused for a --min-lr the user never gave.
  if (!cmd.count("--min-lr") && opt.min_lr > opt.lr) {
    opt.min_lr = opt.lr;
    // Not the checkpoint's final rate after all: the resume says the change it makes.
    std::erase_if(f.checkpoint.inherited,
                  [](const std::string& setting) { return setting.starts_with("--min-lr "); });
  }
  check_optimizer_flag(opt.kind);
  const std::string lr = given_number(cmd, "--lr", opt.lr);
  if (opt.min_lr > opt.lr)
    throw UsageError("--min-lr " + given_number(cmd, "--min-lr", opt.min_lr) +
                     " is more than --lr " + lr +
                     "; the learning rate decays from --lr to --min-lr, which must be in [0, "
                     "--lr]");
  if (opt.lr * opt.weight_decay >= 1.0)
    throw UsageError("--lr " + lr + " x --weight-decay " +
                     given_number(cmd, "--weight-decay", opt.weight_decay) + " is " +
                     format_number(opt.lr * opt.weight_decay) +
                     ": each step multiplies every decayed weight by 1 - lr x weight decay, "
                     "which zeroes or flips the weights from a product of 1 on; lower either so "
                     "the product is below 1 (weight decays are usually 0.01 to 0.1)");
  if (f.timeout_s * 1000 < 1)
    throw UsageError("--timeout " + given_number(cmd, "--timeout", f.timeout_s) +
                     " is less than 1 ms, the shortest wait accepted (seconds, such as 0.5)");
  config.transport_timeout = std::chrono::milliseconds(static_cast<int64_t>(f.timeout_s * 1000));
  // One replica all-reduces nothing, so a bucket size would be ignored without a word, as
  // --shard-optimizer without --dp is refused. The default, written out, changes nothing.
  if (cmd.count("--bucket-mb") && config.data_parallel < 2 &&
      f.run.bucket_mb != kDefaultGradientBucketMiB)
    throw UsageError("--bucket-mb " + escaped_for_message(f.run.bucket_mb_text) +
                     " sizes the gradient all-reduce buckets of data-parallel replicas, but this "
                     "run has one replica; give --dp 2 or more, or leave --bucket-mb out");
  // Without held-out batches an evaluation would measure nothing, and the flag would be
  // ignored without a word.
  if (f.eval_every > 0 && f.eval_batches == 0)
    throw UsageError("--eval-every " + std::to_string(f.eval_every) +
                     " evaluates on the held-out batches of --eval-batches, which is 0; give "
                     "--eval-batches 1 or more");
  try {
    config.model.validate();
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  return config;
}

}  // namespace

TrainConfig resolve_config(TrainFlags& f, const CLI::App& cmd) {
  TrainConfig config = f.config;
  f.run.apply(cmd, config);
  if (!f.checkpoint.resume.empty()) {
    f.checkpoint.model_flags_given = model_flags_given(cmd);
    f.checkpoint.left_to_checkpoint =
        settings_left_to_checkpoint(cmd, microbatches_chosen_elsewhere(f, config));
    // The model the flags give with --data, so that a checkpoint's equal one is not said to
    // be taken from it.
    raise_vocab_for_data(cmd, config);
    f.checkpoint.inherited = inherit_resumed_settings(
        resume_path(f.checkpoint), cmd, microbatches_chosen_elsewhere(f, config), config);
    // --recompute units:LIST counts the units of the model the run trains.
    config.recompute = parse_recompute(f.run.recompute, config.model.num_units());
  }
  try {
    return checked_config(f, cmd, std::move(config));
  } catch (const UsageError& e) {
    throw UsageError(with_inherited_origin(e.what(), f.checkpoint.inherited));
  }
}

// "3,5,5,3": the blocks per stage of an explicit partition.
namespace {

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

// Block counts given with --partition, refused in the words of the flags: the partitioner
// compares them with the pipeline's stages and the model's blocks, which it names without
// saying which flags set them. `stages_from` says what set the stage count ("--stages 2", a
// plan file), for layouts that no flag of the run gives.
void check_block_counts(const TrainConfig& config, const std::string& stages_from) {
  if (config.partition.kind != PartitionSpec::Kind::kBlocks) return;
  const std::vector<int64_t>& counts = config.partition.blocks;
  const std::string given = "--partition " + block_counts_text(config.partition);
  // A schedule file's chunks are its own; a generated schedule's are those its kind runs.
  const int64_t per_rank = config.schedule_file.empty()
                               ? schedule::chunks_per_rank(config.schedule, config.chunks)
                               : config.chunks;
  const int64_t stages = int64_t{config.stages} * per_rank;
  if (static_cast<int64_t>(counts.size()) != stages)
    throw UsageError(given + " has " + counted(counts.size(), "block count") +
                     ", but the pipeline of " + stages_from + " has " + counted(stages, "stage") +
                     "; give one count per stage");
  const int64_t blocks = config.model.n_layers;
  const std::string model =
      "the model has " + counted(blocks, "block") + " (--layers " + std::to_string(blocks) + ")";
  // Each count at most the model's blocks first, so that their sum cannot overflow.
  for (size_t s = 0; s < counts.size(); ++s)
    if (counts[s] > blocks)
      throw UsageError(given + " gives stage " + std::to_string(s) + " " +
                       counted(counts[s], "block") + ", but " + model +
                       "; the counts must add up to --layers");
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total != blocks)
    throw UsageError(given + " places " + counted(total, "block") + ", but " + model +
                     "; the counts must add up to --layers");
  // What else the partitioner refuses (an empty middle stage) speaks of the counts alone.
  try {
    partition_blocks(reference_model(config.model), static_cast<int>(stages), config.partition);
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    throw UsageError(what.rfind("partition ", 0) == 0 ? "--" + what : given + ": " + what);
  }
}

// What set the stage count of a pipeline that the flags lay out: --stages, times --chunks
// where the schedule has several per rank, or the schedule file.
std::string stages_from_flags(const TrainConfig& config) {
  if (!config.schedule_file.empty())
    return "--schedule-file " + quoted_file_name(config.schedule_file) + " (" +
           std::to_string(config.stages) + " ranks x " + std::to_string(config.chunks) +
           (config.chunks == 1 ? " chunk)" : " chunks)");
  const std::string stages = "--stages " + std::to_string(config.stages);
  // zbv's chunks are its own, whatever --chunks says.
  if (config.schedule == schedule::ScheduleKind::kZBV)
    return stages + " x " +
           std::to_string(schedule::chunks_per_rank(config.schedule, config.chunks)) +
           " chunks of zbv";
  if (config.chunks > 1)
    return stages + " x --chunks " + std::to_string(config.chunks) + " of " +
           schedule::schedule_kind_name(config.schedule);
  return stages;
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

}  // namespace

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
    const std::string shown = "plan file '" + escaped_for_message(f.plan_file) + "'";
    auto agree = [&](const char* flag, const std::string& given, const std::string& planned) {
      if (cmd.count(flag) && given != planned)
        refuse_disagreement(flag, given, shown, planned, "the plan");
    };
    agree("--stages", std::to_string(flags.stages), std::to_string(config.stages));
    agree("--schedule", schedule::schedule_kind_name(flags.schedule),
          schedule::schedule_kind_name(config.schedule));
    // A chunk count the plan's schedule takes as its own agrees: zbv's --chunks 1 is its V of 2.
    const bool same_chunks =
        schedule::takes_chunks(config.schedule, flags.chunks) &&
        schedule::chunks_per_rank(config.schedule, flags.chunks) == config.chunks;
    if (!same_chunks)
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
    // Counts given with the plan are the user's, refused as theirs, against the plan's stages.
    if (given.kind == PartitionSpec::Kind::kBlocks)
      check_block_counts(config, shown + " (stages=" + std::to_string(config.stages) +
                                     " schedule=" + schedule::schedule_kind_name(config.schedule) +
                                     " chunks=" + std::to_string(config.chunks) + ")");
    // What the run refuses of the planned layout names the plan: the counts are the file's,
    // not flags the user typed. After the processes agree on the layout, so that all refuse it
    // alike.
    try {
      config.validate();
      const schedule::Schedule planned = make_schedule(config);
      if (given.kind != PartitionSpec::Kind::kBlocks)
        partition_blocks(reference_model(config.model), planned.num_stages(), config.partition);
    } catch (const std::invalid_argument& e) {
      throw UsageError(shown + " does not fit this run: " + e.what());
    }
    // As --partition auto says what it planned, a run says what it took from the file (with
    // the flags that win over it applied).
    std::printf("plan   from '%s': %s\n", escaped_for_message(f.plan_file).c_str(),
                layout_text(config).c_str());
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
    constraints.one_rank_per_process = wants_mpi(config);
    // A schedule the flags fix whole that cannot be generated says why, as it does without
    // auto, before profiling; the planner would only find no layout. Interleaved without
    // --chunks is left to the planner, which tries several chunk counts.
    const bool whole =
        constraints.schedule && constraints.microbatches &&
        (constraints.chunks || *constraints.schedule != schedule::ScheduleKind::kInterleaved);
    try {
      if (whole) make_schedule(config);
      // A chunk count the kind never takes is refused whatever the micro-batches.
      if (constraints.schedule && constraints.chunks)
        check_chunks_flag(*constraints.schedule, *constraints.chunks);
    } catch (const schedule::ScheduleError& e) {
      throw UsageError(e.what());
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
          "plan   %s, %s of each replica's %lld tokens (--microbatches %lld "
          "over --dp %lld), predicted step %.3f ms of each replica's pipeline, before the "
          "gradients' all-reduce between the replicas\n",
          best.layout.c_str(), counted(share.microbatches, "micro-batch", "micro-batches").c_str(),
          static_cast<long long>(share.batch_tokens), static_cast<long long>(config.microbatches),
          static_cast<long long>(replicas), best.step_seconds * 1e3);
    else
      std::printf("plan   %s, %s, predicted step %.3f ms\n", best.layout.c_str(),
                  counted(config.microbatches, "micro-batch", "micro-batches").c_str(),
                  best.step_seconds * 1e3);
  } else {
    check_block_counts(config, stages_from_flags(config));
    return;
  }
  try {
    config.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

bool wants_mpi(const TrainConfig& config) { return comm::one_rank_per_process(config.transport); }

Device process_device(const MpiSession& mpi, const std::string& device_flag, Device resolved) {
  if (!mpi.active() || !resolved.is_cuda() || device_flag.find(':') != std::string::npos)
    return resolved;
  return Device::cuda(comm::node_local_rank() % cuda_device_count());
}

namespace {

// The shortest text that reads back as `value`: 0.0010001, not %.17g's 0.0010001000000000001.
std::string exact(double value) {
  char buf[40];
  return std::string(buf, std::to_chars(buf, buf + sizeof buf, value).ptr);
}

// A folder flag compared by whether it is given: each process may name the folder by a path
// of its own (a shared file system mounted elsewhere), which the save and the resume check.
ConfigField given_or_not(const std::string& flag, const std::string& path) {
  return {flag, path.empty() ? "not given" : "given",
          path.empty() ? "not given" : escaped_for_message(path)};
}

}  // namespace

ConfigFields configuration_fields(const TrainFlags& f, const TrainConfig& c) {
  // A resume's settings that the command line left out come from each process's copy of the
  // checkpoint, which the resume compares between the processes: here they are compared as
  // left out, so that copies of two checkpoints are refused as such, and a flag left out on
  // one process and given on another is refused, whatever the checkpoint holds.
  const std::vector<std::string>& left = f.checkpoint.left_to_checkpoint;
  auto resumed = [&](std::string name, std::string value) {
    const std::string setting = name.starts_with("the model") ? "the model" : name;
    if (std::find(left.begin(), left.end(), setting) == left.end())
      return ConfigField{std::move(name), std::move(value)};
    return ConfigField{std::move(name), "not given",
                       "not given, so --resume takes the checkpoint's"};
  };
  const auto& m = c.model;
  const auto& o = c.optimizer;
  return {
      resumed("the model (--preset, --d-model, --layers, --hidden, --vocab, --activation)",
              "d_model=" + std::to_string(m.d_model) + " layers=" + std::to_string(m.n_layers) +
                  " hidden=" + std::to_string(m.hidden) + " vocab=" + std::to_string(m.vocab) +
                  " activation=" + ops::activation_name(m.activation) +
                  " ln_eps=" + exact(m.ln_eps)),
      {"--stages", std::to_string(c.stages)},
      {"--chunks", std::to_string(c.chunks)},
      {"--schedule", f.schedule},
      file_field("--schedule-file", c.schedule_file),
      {"--partition", f.partition},
      resumed("--batch-tokens", std::to_string(c.batch_tokens)),
      resumed("--microbatches", std::to_string(c.microbatches)),
      resumed("--seed", std::to_string(c.seed)),
      resumed("--steps", std::to_string(c.steps)),
      file_field("--data", c.data_path),
      resumed("--optimizer", o.kind),
      resumed("--lr", exact(o.lr)),
      resumed("--min-lr", exact(o.min_lr)),
      resumed("--warmup", std::to_string(o.warmup_steps)),
      resumed("--weight-decay", exact(o.weight_decay)),
      resumed("--clip", exact(o.clip_norm)),
      {"--device", f.run.device},
      {"--tf32", c.allow_tf32 ? "on" : "off"},
      {"--transport", f.transport},
      {"--dp", std::to_string(c.data_parallel)},
      {"--shard-optimizer", c.shard_optimizer ? "on" : "off"},
      {"--bucket-mb", c.gradient_bucket_mib ? exact(*c.gradient_bucket_mib) : "not given"},
      {"--eval-batches", std::to_string(f.eval_batches)},
      {"--eval-every", std::to_string(f.eval_every)},
      // Written by rank 0's process alone: given to another process only, the file would never
      // be written, without a word. By whether given, as only rank 0's path is used.
      given_or_not("--log-json", f.log_json),
      given_or_not("--trace", f.trace),
      // By whether it is given, as the folders below: each process may hold its own copy at a
      // path of its own, and the layouts the processes read from their plans are compared once
      // they have read them.
      given_or_not("--plan", f.plan_file),
      // What decides the collectives after the last step (the checksum's) and the saves' and
      // resume's meetings: a rank that differs would wait in one the others never start.
      {"--weights-checksum", f.weights_checksum ? "on" : "off"},
      given_or_not("--save-dir", f.checkpoint.save_dir),
      {"--save-every", std::to_string(f.checkpoint.save_every)},
      {"--keep", std::to_string(f.checkpoint.keep)},
      {"--on-save-error", f.checkpoint.on_save_error},
      {"--async-save", f.checkpoint.async_save ? "on" : "off"},
      // Which checkpoint each process opens is compared as it resumes, by its manifest.
      given_or_not("--resume", f.checkpoint.resume),
      {"--stop-after", std::to_string(f.checkpoint.stop_after)},
      // Last: a rank whose binary reads files or saves checkpoints otherwise may still agree
      // on every flag above.
      {"the build (Conveyor version and commit, checkpoint and schedule file formats)",
       std::string("conveyor ") + version() + " commit " + build_commit() + ", checkpoint format " +
           std::to_string(kCheckpointFormatVersion) + ", schedule text format " +
           std::to_string(schedule::kScheduleTextFormatVersion)},
  };
}

}  // namespace conveyor::cli
