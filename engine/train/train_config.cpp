#include "engine/train/train_config.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "comm/transport_factory.h"
#include "engine/core/device_context.h"
#include "engine/core/enum_value.h"
#include "engine/core/number_text.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/input_file.h"
#include "engine/schedule/text_format.h"

namespace conveyor {
namespace {

// Bytes the device can still give, and where that figure comes from; 0 when unknown.
double device_available_bytes(Device device, std::string* source) {
  if (device.is_cuda()) {
    // A device this machine lacks has no free memory to compare with; creating its context
    // refuses it, naming the devices there are.
    if (device.index >= cuda_device_count()) return 0.0;
    const CudaMemoryInfo info = cuda_memory_info(device.index);
    if (info.total_bytes == 0) return 0.0;
    *source = "free memory of " + device.to_string();
    return static_cast<double>(info.free_bytes);
  }
  if (device.is_cpu()) {
    *source = "MemAvailable of /proc/meminfo";
    return cpu_available_bytes();
  }
  return 0.0;
}

}  // namespace

DeviceMemoryLimit device_memory_limit(Device device, size_t memory_limit_bytes) {
  DeviceMemoryLimit out;
  out.bytes = device_available_bytes(device, &out.source);
  if (memory_limit_bytes == 0) return out;
  const double cap = static_cast<double>(memory_limit_bytes);
  if (out.bytes <= 0.0 || cap <= out.bytes) return {cap, "the memory limit", ""};
  out.note = ", less than the memory limit (" + bytes_text(cap) + ")";
  return out;
}

double rank_context_bytes(Device device) {
  return device.is_cuda() ? static_cast<double>(DeviceContextOptions{}.cublas_workspace_bytes)
                          : 0.0;
}

int ranks_sharing_device_memory(Device device, int ranks, int cuda_devices,
                                bool one_rank_per_process) {
  if (device.is_cuda() && (one_rank_per_process || cuda_devices >= ranks)) return 1;
  return ranks;
}

RankMemoryShare rank_memory_share(double memory, int sharing, Device device,
                                  const std::string& memory_source) {
  if (!(memory > 0) || sharing < 1)
    throw std::invalid_argument("a memory share needs memory above 0 and 1 or more ranks, got " +
                                bytes_text(memory) + " and " + std::to_string(sharing));
  const double equal = memory / sharing;
  const double context = rank_context_bytes(device);
  if (context == 0) return {equal, memory_source};
  const std::string each = sharing > 1 ? "each rank's" : "the rank's";
  // Equal to the context leaves a share of 0, which a planner reads as no cap at all.
  if (equal <= context)
    throw std::invalid_argument(
        memory_source + (sharing > 1 ? " leaves each rank " : " is ") + bytes_text(equal) +
        ", no more than the cuBLASLt workspace (" + bytes_text(context) + ") that " + each +
        " context on " + device.to_string() +
        " takes from it before its stages hold anything; give more than " +
        bytes_text(context * sharing) +
        (sharing > 1 ? ", or fewer ranks on " + device.to_string() : std::string()));
  return {equal - context,
          memory_source + ", less " + each + " cuBLASLt workspace (" + bytes_text(context) + ")"};
}

namespace {

// What the first rank that does not fit needs against which limit, said in a clause; nothing
// when every rank fits.
std::optional<std::string> memory_shortfall(const ModelDescription& model,
                                            const std::vector<StageRange>& ranges,
                                            const schedule::Schedule& schedule,
                                            const std::vector<Device>& devices,
                                            const TrainConfig& config, bool one_device_per_process,
                                            bool one_rank_per_process) {
  // Every replica's rank r holds what the pipeline's rank r mod P does, with a sharded
  // optimizer state its replica's piece of each parameter, each rounded up on its own.
  const std::vector<RankMemoryEstimate> replicas = estimate_replica_memory(
      model, ranges, schedule, config.optimizer.kind, config.batch_tokens / config.microbatches,
      config.data_parallel, config.shard_optimizer, config.recompute);
  std::vector<RankMemoryEstimate> ranks;
  for (size_t r = 0; r < devices.size(); ++r) ranks.push_back(replicas[r % replicas.size()]);
  // A rank's context on a CUDA device takes its cuBLASLt workspace from the same allocator
  // (and cap) before the first step: 32 MiB, which on a model of a few MiB is most of it.
  for (size_t r = 0; r < ranks.size(); ++r)
    ranks[r].transient_bytes += rank_context_bytes(devices[r]);
  // Ranks sharing a device share its memory. CPU ranks as processes (one_rank_per_process
  // without one_device_per_process) may share one machine's memory, as far as a process can
  // tell, but each process's allocators hold the cap for its own rank alone.
  const bool cap_per_process = one_rank_per_process && !one_device_per_process;
  for (size_t r = 0; r < ranks.size(); ++r) {
    double on_device = 0.0, in_process = 0.0;
    int sharing = 0, sharing_in_process = 0;
    for (size_t q = 0; q < ranks.size(); ++q) {
      if (devices[q] != devices[r]) continue;
      if (q == r || !one_device_per_process) on_device += ranks[q].total(), ++sharing;
      if (q == r || !one_rank_per_process) in_process += ranks[q].total(), ++sharing_in_process;
    }
    const RankMemoryEstimate& e = ranks[r];
    const auto refuse = [&](double needed, int held, const DeviceMemoryLimit& limit) {
      // Incomplete when a unit's layer does not say what it keeps: its activations are then
      // counted as the tensor entering it.
      const std::string at_least = e.complete ? "" : "at least ";
      return std::optional<std::string>(
          "the run needs " + (e.complete ? std::string("about ") : at_least) + bytes_text(needed) +
          " on " + devices[r].to_string() + " (" + std::to_string(held) + " rank(s); rank " +
          std::to_string(r) + ": parameters " + bytes_text(e.parameter_bytes) + ", gradients " +
          bytes_text(e.gradient_bytes) + ", optimizer state " + bytes_text(e.optimizer_bytes) +
          ", in-flight activations " + at_least + bytes_text(e.activation_bytes) +
          ", the step's token ids and losses " + bytes_text(e.batch_bytes) +
          ", boundary tensors and workspace " + bytes_text(e.transient_bytes) + ") but " +
          limit.source + " is " + bytes_text(limit.bytes) + limit.note);
    };
    // A limit emulates a smaller device: one above what the device can give now would let
    // through a run the device cannot hold, which the system then ends (on the CPU, the
    // kernel's out-of-memory killer).
    if (!cap_per_process) {
      const DeviceMemoryLimit limit = device_memory_limit(devices[r], config.memory_limit_bytes);
      if (limit.bytes > 0.0 && on_device > limit.bytes) return refuse(on_device, sharing, limit);
      continue;
    }
    const DeviceMemoryLimit available = device_memory_limit(devices[r], 0);
    if (available.bytes > 0.0 && on_device > available.bytes)
      return refuse(on_device, sharing, available);
    const double cap = static_cast<double>(config.memory_limit_bytes);
    if (cap > 0.0 && in_process > cap)
      return refuse(in_process, sharing_in_process, {cap, "the memory limit", ""});
  }
  return std::nullopt;
}

}  // namespace

void check_memory_fits(const ModelDescription& model, const std::vector<StageRange>& ranges,
                       const schedule::Schedule& schedule, const std::vector<Device>& devices,
                       const TrainConfig& config, bool one_device_per_process,
                       bool one_rank_per_process) {
  const std::optional<std::string> shortfall = memory_shortfall(
      model, ranges, schedule, devices, config, one_device_per_process, one_rank_per_process);
  if (!shortfall) return;
  // A schedule holding more micro-batches' activations than 1F1B (GPipe's m, an edited file's
  // order) may be all that keeps the run from fitting; on one chunk per rank 1F1B runs on the
  // same stages, so whether it fits is known, not guessed.
  std::string fewer_activations;
  if (schedule.placement.chunks == 1) {
    try {
      const schedule::Schedule one_f_one_b =
          schedule::generate(schedule::ScheduleKind::k1F1B, schedule.num_ranks(),
                             schedule.num_microbatches, 1, schedule.replicas);
      if (!memory_shortfall(model, ranges, one_f_one_b, devices, config, one_device_per_process,
                            one_rank_per_process))
        fewer_activations = "a schedule that holds fewer activations at once (1f1b fits), ";
    } catch (const schedule::ScheduleError&) {
      // Too large to generate: the advice goes without it.
    }
  }
  // Replicas that each keep the whole optimizer state can keep 1/D of it each instead; whether
  // that alone is enough is known, not guessed.
  std::string shared_state;
  if (config.data_parallel > 1 && !config.shard_optimizer) {
    TrainConfig sharded = config;
    sharded.shard_optimizer = true;
    const bool fits = !memory_shortfall(model, ranges, schedule, devices, sharded,
                                        one_device_per_process, one_rank_per_process);
    shared_state = "the optimizer state shared by the replicas (TrainConfig::shard_optimizer" +
                   std::string(fits ? ", which fits" : "") + "), ";
  }
  throw std::invalid_argument(*shortfall +
                              "; use a smaller model, fewer tokens per micro-batch or per step, "
                              "more stages, " +
                              fewer_activations + shared_state + "or sgd");
}

int cpu_threads_per_rank(int requested, int ranks) {
  // Else 0 ranks shared the cores as if they were one, and a negative request meant "all".
  if (ranks < 1)
    throw std::invalid_argument("cpu_threads_per_rank needs a rank count of 1 or more, got " +
                                std::to_string(ranks));
  if (requested < 0)
    throw std::invalid_argument(
        "cpu_threads_per_rank needs a thread count of 1 or more (or 0: the cores shared), got " +
        std::to_string(requested));
  if (requested > 0) return requested;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / ranks);
}

namespace {

void check_data_parallel(const TrainConfig& c) {
  if (c.data_parallel < 1)
    throw std::invalid_argument("TrainConfig::data_parallel must be at least 1, got " +
                                std::to_string(c.data_parallel));
  if (c.shard_optimizer && c.data_parallel < 2)
    throw std::invalid_argument(
        "a sharded optimizer shares its state between data-parallel replicas; it needs "
        "TrainConfig::data_parallel 2 or more, got " +
        std::to_string(c.data_parallel));
  if (c.microbatches % c.data_parallel != 0)
    throw std::invalid_argument(
        counted(c.microbatches, "micro-batch", "micro-batches") + " cannot be shared equally by " +
        std::to_string(c.data_parallel) +
        " data-parallel replicas; use a micro-batch count that is a multiple of " +
        std::to_string(c.data_parallel));
}

// A value made by a cast would fall through the switches that read these fields: a placement
// ran as kShared without a word, a partition kind cut no stages at all.
void check_enum_fields(const TrainConfig& c) {
  check_enum_value(c.schedule,
                   {schedule::ScheduleKind::kGPipe, schedule::ScheduleKind::k1F1B,
                    schedule::ScheduleKind::kInterleaved, schedule::ScheduleKind::kZBH1,
                    schedule::ScheduleKind::kZBV},
                   "TrainConfig::schedule",
                   "schedule::ScheduleKind::kGPipe, k1F1B, kInterleaved, kZBH1 or kZBV");
  c.partition.check_kind("TrainConfig::partition.kind");
  check_enum_value(c.placement, {RankPlacement::kAuto, RankPlacement::kShared},
                   "TrainConfig::placement", "RankPlacement::kAuto or kShared");
  comm::check_transport_kind(c.transport, "TrainConfig::transport");
  c.recompute.check_kind("TrainConfig::recompute.kind");
  if (c.device)
    check_enum_value(c.device->kind, {DeviceKind::kCpu, DeviceKind::kCuda},
                     "TrainConfig::device.kind", "DeviceKind::kCpu or kCuda");
}

}  // namespace

void apply_plan(const PlanCandidate& candidate, TrainConfig& config) {
  const std::string shown = "plan candidate '" + candidate.layout + "'";
  if (!candidate.pipelined)
    throw std::invalid_argument(shown + " is not a pipeline; train it as " + candidate.layout +
                                " replicas (stages 1, data_parallel " +
                                std::to_string(candidate.peak_bytes.size()) + ")");
  if (!candidate.rejected.empty())
    throw std::invalid_argument(shown + " cannot run: " + candidate.rejected);
  const size_t chunks = static_cast<size_t>(std::max(candidate.chunks, 1));
  if (candidate.ranges.empty() || candidate.ranges.size() % chunks != 0 ||
      candidate.microbatches < 1)
    throw std::invalid_argument(shown + " has " + std::to_string(candidate.ranges.size()) +
                                " stage ranges for " + std::to_string(chunks) + " chunks and " +
                                std::to_string(candidate.microbatches) +
                                " micro-batches; expected a whole number of ranks and at least "
                                "one micro-batch");
  config.stages = static_cast<int>(candidate.ranges.size() / chunks);
  config.schedule = candidate.kind;
  config.chunks = static_cast<int>(chunks);
  config.schedule_file.clear();
  config.microbatches = static_cast<int64_t>(candidate.microbatches) * config.data_parallel;
  config.partition = PartitionSpec::explicit_blocks(blocks_of(candidate.ranges));
  config.recompute = candidate.recompute;
}

void TrainConfig::validate() const {
  optimizer.validate("TrainConfig::optimizer.");
  check_enum_fields(*this);
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  if (cpu_threads < 0 || cpu_threads > kMaxCpuThreads)
    fail("TrainConfig::cpu_threads must be from 1 to " + std::to_string(kMaxCpuThreads) +
         " (or 0: all cores), got " + std::to_string(cpu_threads));
  if (steps < 1) fail("TrainConfig::steps must be at least 1, got " + std::to_string(steps));
  if (batch_tokens < 1)
    fail("TrainConfig::batch_tokens must be at least 1, got " + std::to_string(batch_tokens));
  if (microbatches < 1)
    fail("TrainConfig::microbatches must be at least 1, got " + std::to_string(microbatches));
  if (batch_tokens % microbatches != 0)
    fail("the batch of TrainConfig::batch_tokens " + std::to_string(batch_tokens) +
         " cannot be split into TrainConfig::microbatches " + std::to_string(microbatches) +
         " equal micro-batches; give a micro-batch count that divides " +
         std::to_string(batch_tokens));
  if (stages < 1) fail("TrainConfig::stages must be at least 1, got " + std::to_string(stages));
  if (chunks < 1) fail("TrainConfig::chunks must be at least 1, got " + std::to_string(chunks));
  // What a checkpoint records must load again: its manifest takes no larger counts.
  for (const auto& [what, value, max] :
       {std::tuple{"TrainConfig::batch_tokens", batch_tokens, kMaxBatchTokens},
        {"TrainConfig::microbatches", microbatches, kMaxMicrobatches},
        {"TrainConfig::stages", int64_t{stages}, kMaxStages},
        {"TrainConfig::chunks", int64_t{chunks}, kMaxChunks},
        {"TrainConfig::data_parallel", int64_t{data_parallel}, kMaxReplicas}})
    if (value > max)
      fail(std::string(what) + " must be at most " + std::to_string(max) + ", got " +
           std::to_string(value));
  check_data_parallel(*this);
  if (gradient_bucket_mib) {
    const double b = *gradient_bucket_mib;
    if (!std::isfinite(b) || b < 0 || b > kMaxGradientBucketMiB ||
        (b > 0 && b < kMinGradientBucketMiB))
      fail(
          "a gradient bucket must be 0 MiB (one bucket per stage) or from 0.0009765625 MiB "
          "(1 KiB) to 1e6 MiB, got " +
          number_text(b) + " MiB");
  }
  comm::check_timeout(transport_timeout, "TrainConfig::transport_timeout");
}

schedule::Schedule make_schedule(const TrainConfig& config) {
  // With data parallelism the schedule is one replica's: its share of the micro-batches.
  const int d = std::max(config.data_parallel, 1);
  const int m = static_cast<int>(config.microbatches) / d;
  if (config.schedule_file.empty()) {
    try {
      return schedule::generate(config.schedule, config.stages, m, config.chunks, d);
    } catch (const schedule::ScheduleError& e) {
      if (d == 1) throw;
      // The generator speaks of one replica's m, which no flag sets directly.
      throw schedule::ScheduleError(
          std::string(e.what()) + ", where m is each replica's share: " +
          "TrainConfig::microbatches " + std::to_string(config.microbatches) +
          " over TrainConfig::data_parallel " + std::to_string(d) +
          "; TrainConfig::microbatches must be " + std::to_string(d) + " times such an m");
    }
  }
  schedule::Schedule loaded = schedule::load_schedule(config.schedule_file);
  // Replicas first: each replica's share of the micro-batches is counted with the run's
  // replica count, which a file for another count makes the wrong divisor.
  if (loaded.replicas != d)
    throw std::invalid_argument("schedule file " + quoted_file_name(config.schedule_file) +
                                " is for " + counted(loaded.replicas, "data-parallel replica") +
                                " but the run uses " + std::to_string(d) +
                                " (TrainConfig::data_parallel); write one for " +
                                counted(d, "replica") + " with save_schedule");
  if (loaded.num_microbatches != m)
    throw std::invalid_argument(
        "schedule file " + quoted_file_name(config.schedule_file) + " has " +
        counted(loaded.num_microbatches, "micro-batch", "micro-batches") + " but the run uses " +
        std::to_string(m) +
        (d > 1 ? " per replica (TrainConfig::microbatches " + std::to_string(config.microbatches) +
                     " over TrainConfig::data_parallel " + std::to_string(d) + ")"
               : std::string(" (TrainConfig::microbatches)")));
  // The file decides the ranks, the chunks and the kind. A config that asks for others is
  // refused rather than run under the file's without a word; left at their defaults, these
  // fields ask for nothing.
  const TrainConfig defaults;
  const auto refuse = [&](const std::string& field, const std::string& given,
                          const std::string& has) {
    throw std::invalid_argument("schedule file " + quoted_file_name(config.schedule_file) +
                                " has " + has + " but " + field + " is " + given +
                                "; leave it at its default or give the file's");
  };
  if (config.stages != defaults.stages && config.stages != loaded.num_ranks())
    refuse("TrainConfig::stages", std::to_string(config.stages),
           std::to_string(loaded.num_ranks()) + " rank(s)");
  if (config.chunks != defaults.chunks && config.chunks != loaded.placement.chunks)
    refuse("TrainConfig::chunks", std::to_string(config.chunks),
           std::to_string(loaded.placement.chunks) + " chunk(s) per rank");
  const std::string kind = schedule::schedule_kind_name(config.schedule);
  if (config.schedule != defaults.schedule && !loaded.name.empty() && loaded.name != kind)
    refuse("TrainConfig::schedule", kind,
           "the schedule '" + escaped_for_message(loaded.name) + "'");
  return loaded;
}

namespace {

// The weights of the units in `range`: the gradient elements its stage's all-reduce sums.
int64_t stage_parameters(const std::vector<int64_t>& unit_params, const StageRange& range) {
  int64_t params = 0;
  for (int64_t u = range.begin; u < range.end; ++u) params += unit_params[static_cast<size_t>(u)];
  return params;
}

}  // namespace

std::vector<int> gradient_buckets_per_stage(const ModelDescription& model,
                                            const std::vector<StageRange>& ranges,
                                            double bucket_mib) {
  const std::vector<int64_t> unit_params = model.unit_parameter_counts();
  std::vector<int> out;
  for (const StageRange& r : ranges) {
    // One f32 gradient per weight, as the executor sums them.
    const double bytes = 4.0 * static_cast<double>(stage_parameters(unit_params, r));
    out.push_back(schedule::gradient_bucket_count(bytes, bucket_mib * 1024.0 * 1024.0));
  }
  return out;
}

void set_gradient_buckets(schedule::Schedule& sched, const ModelDescription& model,
                          const std::vector<StageRange>& ranges, const TrainConfig& config) {
  if (sched.replicas == 1) return;
  const std::vector<int> wanted = gradient_buckets_per_stage(
      model, ranges, config.gradient_bucket_mib.value_or(kDefaultGradientBucketMiB));
  if (config.schedule_file.empty()) {
    schedule::add_gradient_all_reduces(&sched, sched.replicas, wanted);
    return;
  }
  // Each bucket is a slice of the stage's gradients; more buckets than elements would leave
  // one empty, which the all-reduce refuses only at the first step.
  const std::vector<int64_t> unit_params = model.unit_parameter_counts();
  for (int s = 0; s < sched.num_stages(); ++s) {
    const int64_t elements = stage_parameters(unit_params, ranges[static_cast<size_t>(s)]);
    const int has = schedule::gradient_buckets(sched, s);
    if (has > std::max<int64_t>(elements, 1))
      throw std::invalid_argument(
          "schedule file " + quoted_file_name(config.schedule_file) + " has " +
          std::to_string(has) + " all-reduce buckets for stage " + std::to_string(s) +
          ", which has " + std::to_string(elements) +
          " gradient elements; a stage takes at most one bucket per gradient element");
  }
  if (!config.gradient_bucket_mib) return;
  for (int s = 0; s < sched.num_stages(); ++s) {
    const int has = schedule::gradient_buckets(sched, s);
    if (has == wanted[static_cast<size_t>(s)]) continue;
    throw std::invalid_argument(
        "TrainConfig::gradient_bucket_mib " + number_text(*config.gradient_bucket_mib) +
        " gives stage " + std::to_string(s) + " " + std::to_string(wanted[static_cast<size_t>(s)]) +
        " gradient bucket(s) but schedule file " + quoted_file_name(config.schedule_file) +
        " has " + std::to_string(has) +
        "; the file decides, so leave TrainConfig::gradient_bucket_mib unset or make it agree");
  }
}

Device resolve_device(const std::optional<Device>& requested, std::string* note) {
  if (requested) {
    // One CPU device: another index would pass for it in names ("cpu") and fail as another
    // device in the kernels' checks.
    if (requested->is_cpu() && requested->index != 0)
      throw std::invalid_argument("the CPU is device index 0, got index " +
                                  std::to_string(requested->index) + "; use Device::cpu()");
    if (requested->is_cuda() && (requested->index < 0 || requested->index >= cuda_device_count()))
      throw std::invalid_argument("device " + requested->to_string() + " requested but " +
                                  std::to_string(cuda_device_count()) +
                                  " CUDA device(s) are usable");
    return *requested;
  }
  if (cuda_device_count() > 0) return Device::cuda(0);
  if (note && built_with_cuda()) *note = "no CUDA device found; running on the CPU backend";
  return Device::cpu();
}

namespace {

void check_markov_vocab(int64_t vocab) {
  if (vocab < 1)
    throw std::invalid_argument(
        "the model description does not say its vocab, so no built-in data source can be made "
        "for it; set ModelDescription::vocab or give the trainer a TokenSource");
}

}  // namespace

std::unique_ptr<TokenSource> make_token_source(const TrainConfig& config, int64_t vocab) {
  if (!config.data_path.empty()) {
    auto source = std::make_unique<FileSource>(config.data_path);
    if (vocab < source->vocab())
      throw std::invalid_argument(
          "data file tokens are bytes (vocab 256) but the model vocab is " + std::to_string(vocab) +
          "; use a model vocab of 256 or more (TrainConfig::model.vocab, or "
          "ModelDescription::vocab for a model of one's own)");
    // A batch is a run of consecutive (input, target) pairs: a file with fewer would wrap
    // around inside every batch, training on its bytes over and over in one step.
    const uint64_t pairs = source->bytes() - 1;
    if (pairs < static_cast<uint64_t>(config.batch_tokens)) {
      // The batch suggested must still split into the run's micro-batches.
      const auto m = static_cast<uint64_t>(config.microbatches);
      const uint64_t fits = pairs / m * m;
      const std::string fix =
          fits == 0 ? "give a larger file, or at most " + std::to_string(pairs) +
                          " TrainConfig::microbatches and a TrainConfig::batch_tokens of " +
                          std::to_string(pairs) + " or fewer that they divide"
          : m == 1 ? "give a larger file or TrainConfig::batch_tokens " + std::to_string(fits) +
                         " or fewer"
                   : "give a larger file or TrainConfig::batch_tokens " + std::to_string(fits) +
                         " or fewer, a multiple of TrainConfig::microbatches " + std::to_string(m);
      throw std::invalid_argument(
          "data file " + quoted_file_name(config.data_path) + " has " +
          std::to_string(source->bytes()) + " bytes, " + std::to_string(pairs) +
          " (input, target) pairs, but one step's batch of " + std::to_string(config.batch_tokens) +
          " tokens needs " + std::to_string(config.batch_tokens + 1) + " bytes; " + fix);
    }
    return source;
  }
  check_markov_vocab(vocab);
  return std::make_unique<MarkovSource>(vocab, config.seed);
}

std::unique_ptr<TokenSource> make_held_out_source(const TrainConfig& config, int64_t vocab,
                                                  const TokenSource& run) {
  if (const auto* file = dynamic_cast<const FileSource*>(&run)) {
    auto source = std::make_unique<FileSource>(*file);
    source->seek(static_cast<uint64_t>(config.steps) * static_cast<uint64_t>(config.batch_tokens));
    return source;
  }
  if (!config.data_path.empty())
    throw std::invalid_argument("the run's source is not the data file of TrainConfig::data_path");
  check_markov_vocab(vocab);
  return std::make_unique<MarkovSource>(vocab, config.seed, MarkovSource::kDefaultFanout,
                                        MarkovSource::Walk::held_out);
}

std::unique_ptr<TokenSource> make_token_source_at(const TrainConfig& config, int64_t vocab,
                                                  const TokenSource& run) {
  // The bytes the run read, not the file read again: it may have been replaced, cut short or
  // removed since, which would evaluate other bytes (or training data, wrapped) as held out.
  if (const auto* file = dynamic_cast<const FileSource*>(&run))
    return std::make_unique<FileSource>(*file);
  std::unique_ptr<TokenSource> source = make_token_source(config, vocab);
  source->restore(run.position(), run.current_token());
  return source;
}

}  // namespace conveyor
