#include "engine/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include "comm/transport_factory.h"
#include "engine/pipeline/memory_estimate.h"
#include "engine/schedule/input_file.h"
#include "engine/schedule/text_format.h"
#include "layers/ops.h"
#ifdef CONVEYOR_WITH_CUDA
#include "engine/core/cuda_device_guard.h"
#endif

namespace conveyor {
namespace {

std::string format_readable(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// Bytes the device can still give, and where that figure comes from; 0 when unknown.
double device_available_bytes(Device device, std::string* source) {
#ifdef CONVEYOR_WITH_CUDA
  if (device.is_cuda()) {
    detail::CudaDeviceGuard guard(device.index);
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
      // Unknown is an answer here; the error must not stay behind as the thread's last one,
      // which the next kernel launch check would throw.
      (void)cudaGetLastError();
      return 0.0;
    }
    *source = "free memory of " + device.to_string();
    return static_cast<double>(free_bytes);
  }
#endif
  if (device.is_cpu()) {
    *source = "MemAvailable of /proc/meminfo";
    return cpu_available_bytes();
  }
  return 0.0;
}

}  // namespace

void check_memory_fits(const ModelDescription& model, const std::vector<StageRange>& ranges,
                       const schedule::Schedule& schedule, const std::vector<Device>& devices,
                       const TrainConfig& config, bool one_device_per_process) {
  const std::vector<RankMemoryEstimate> pipeline =
      estimate_rank_memory(model, ranges, schedule, config.optimizer.kind,
                           config.batch_tokens / config.microbatches, config.recompute);
  // Every replica's rank r holds what the pipeline's rank r mod P does, with a sharded
  // optimizer state 1/D of its moments (a piece of each, rounded up).
  std::vector<RankMemoryEstimate> ranks;
  for (size_t r = 0; r < devices.size(); ++r) ranks.push_back(pipeline[r % pipeline.size()]);
  if (config.shard_optimizer && config.data_parallel > 1)
    for (RankMemoryEstimate& e : ranks)
      e.optimizer_bytes = std::ceil(e.optimizer_bytes / config.data_parallel);
  // Ranks sharing a device share its memory.
  for (size_t r = 0; r < ranks.size(); ++r) {
    double on_device = 0.0;
    int sharing = 0;
    for (size_t q = 0; q < ranks.size(); ++q)
      if (devices[q] == devices[r] && (q == r || !one_device_per_process))
        on_device += ranks[q].total(), ++sharing;
    // A limit emulates a smaller device: one above what the device can give now would let
    // through a run the device cannot hold, which the system then ends (on the CPU, the
    // kernel's out-of-memory killer).
    std::string source, below_the_limit;
    double limit = device_available_bytes(devices[r], &source);
    if (config.memory_limit_bytes > 0) {
      const double cap = static_cast<double>(config.memory_limit_bytes);
      if (limit <= 0.0 || cap <= limit) {
        limit = cap;
        source = "the memory limit";
      } else {
        below_the_limit = ", less than the memory limit (" + bytes_text(cap) + ")";
      }
    }
    if (limit <= 0.0 || on_device <= limit) continue;
    const RankMemoryEstimate& e = ranks[r];
    // Incomplete when a unit's layer does not say what it keeps: its activations are then
    // counted as the tensor entering it.
    const std::string at_least = e.complete ? "" : "at least ";
    throw std::invalid_argument(
        "the run needs " + (e.complete ? std::string("about ") : at_least) + bytes_text(on_device) +
        " on " + devices[r].to_string() + " (" + std::to_string(sharing) + " rank(s); rank " +
        std::to_string(r) + ": parameters " + bytes_text(e.parameter_bytes) + ", gradients " +
        bytes_text(e.gradient_bytes) + ", optimizer state " + bytes_text(e.optimizer_bytes) +
        ", in-flight activations " + at_least + bytes_text(e.activation_bytes) +
        ", the step's token ids and losses " + bytes_text(e.batch_bytes) +
        ", boundary tensors and workspace " + bytes_text(e.transient_bytes) + ") but " + source +
        " is " + bytes_text(limit) + below_the_limit +
        "; use a smaller model, fewer tokens per micro-batch, more stages, or sgd");
  }
}

int cpu_threads_per_rank(int requested, int ranks) {
  if (requested > 0) return requested;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks));
}

namespace {

// A PipelineError's first line names the rank, the action and the cause; the lines after it
// draw where every rank stood, too much to repeat in a later refusal.
std::string first_line(const std::string& message) { return message.substr(0, message.find('\n')); }

void check_data_parallel(const TrainConfig& c) {
  if (c.data_parallel < 1)
    throw std::invalid_argument("data-parallel replicas must be at least 1, got " +
                                std::to_string(c.data_parallel));
  if (c.shard_optimizer && c.data_parallel < 2)
    throw std::invalid_argument(
        "a sharded optimizer shares its state between data-parallel replicas; it needs --dp 2 "
        "or more, got " +
        std::to_string(c.data_parallel));
  if (c.microbatches % c.data_parallel != 0)
    throw std::invalid_argument(
        std::to_string(c.microbatches) + " micro-batches cannot be shared equally by " +
        std::to_string(c.data_parallel) +
        " data-parallel replicas; use a micro-batch count that is a multiple of " +
        std::to_string(c.data_parallel));
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
  optimizer.validate();
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  if (cpu_threads < 0)
    fail("CPU threads must be at least 1 (or 0: all cores), got " + std::to_string(cpu_threads));
  if (steps < 1) fail("steps must be at least 1, got " + std::to_string(steps));
  if (batch_tokens < 1)
    fail("batch tokens must be at least 1, got " + std::to_string(batch_tokens));
  if (microbatches < 1)
    fail("micro-batches must be at least 1, got " + std::to_string(microbatches));
  if (batch_tokens % microbatches != 0)
    fail("batch of " + std::to_string(batch_tokens) + " tokens cannot be split into " +
         std::to_string(microbatches) + " equal micro-batches; choose a divisor of the batch");
  if (stages < 1) fail("stages must be at least 1, got " + std::to_string(stages));
  if (chunks < 1) fail("chunks must be at least 1, got " + std::to_string(chunks));
  // What a checkpoint records must load again: its manifest takes no larger counts.
  for (const auto& [what, value, max] :
       {std::tuple{"micro-batches", microbatches, kMaxMicrobatches},
        {"stages", int64_t{stages}, kMaxStages},
        {"chunks", int64_t{chunks}, kMaxChunks},
        {"data-parallel replicas", int64_t{data_parallel}, kMaxReplicas}})
    if (value > max)
      fail(std::string(what) + " must be at most " + std::to_string(max) + ", got " +
           std::to_string(value));
  // Negative clipping would silently mean "off"; only 0 says that.
  if (!std::isfinite(optimizer.clip_norm) || optimizer.clip_norm < 0)
    fail("clip norm must be a finite number >= 0 (0 disables clipping), got " +
         format_readable(optimizer.clip_norm));
  if (!std::isfinite(optimizer.lr) || !std::isfinite(optimizer.weight_decay))
    fail("learning rate and weight decay must be finite");
  check_data_parallel(*this);
  if (gradient_bucket_mib) {
    const double b = *gradient_bucket_mib;
    if (!std::isfinite(b) || b < 0 || b > kMaxGradientBucketMiB ||
        (b > 0 && b < kMinGradientBucketMiB))
      fail(
          "a gradient bucket must be 0 MiB (one bucket per stage) or from 0.0009765625 MiB "
          "(1 KiB) to 1e6 MiB, got " +
          format_readable(b) + " MiB");
  }
  if (transport_timeout.count() < 1)
    fail("transport timeout must be at least 1 ms, got " +
         std::to_string(transport_timeout.count()) + " ms");
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
          std::string(e.what()) + ", where m is each replica's share: " + "--microbatches " +
          std::to_string(config.microbatches) + " over --dp " + std::to_string(d) +
          "; --microbatches must be " + std::to_string(d) + " times such an m");
    }
  }
  schedule::Schedule loaded = schedule::load_schedule(config.schedule_file);
  if (loaded.num_microbatches != m)
    throw std::invalid_argument("schedule file " + quoted_file_name(config.schedule_file) +
                                " has " + std::to_string(loaded.num_microbatches) +
                                " micro-batches but the run uses " + std::to_string(m) +
                                (d > 1 ? " per replica (--microbatches " +
                                             std::to_string(config.microbatches) + " over --dp " +
                                             std::to_string(d) + ")"
                                       : std::string(" (--microbatches)")));
  if (loaded.replicas != d)
    throw std::invalid_argument("schedule file " + quoted_file_name(config.schedule_file) +
                                " is for " + std::to_string(loaded.replicas) +
                                " data-parallel replica(s) but the run uses " + std::to_string(d) +
                                " (--dp); dump one with `conveyor schedule --dp " +
                                std::to_string(d) + " --dump FILE`");
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

namespace {

// A generated schedule gets the buckets of the config's size; a schedule file keeps its own,
// and a size given next to it must give the same counts.
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
        "--bucket-mb " + format_readable(*config.gradient_bucket_mib) + " gives stage " +
        std::to_string(s) + " " + std::to_string(wanted[static_cast<size_t>(s)]) +
        " gradient bucket(s) but schedule file " + quoted_file_name(config.schedule_file) +
        " has " + std::to_string(has) +
        "; the file decides, so leave --bucket-mb out or make it agree");
  }
}

}  // namespace

Device resolve_device(const std::optional<Device>& requested, std::string* note) {
  if (requested) {
    if (requested->is_cuda() && requested->index >= cuda_device_count())
      throw std::invalid_argument("device " + requested->to_string() + " requested but " +
                                  std::to_string(cuda_device_count()) +
                                  " CUDA device(s) are usable");
    return *requested;
  }
  if (cuda_device_count() > 0) return Device::cuda(0);
  if (note && built_with_cuda()) *note = "no CUDA device found; running on the CPU backend";
  return Device::cpu();
}

std::unique_ptr<TokenSource> make_token_source(const TrainConfig& config, int64_t vocab) {
  if (!config.data_path.empty()) {
    auto source = std::make_unique<FileSource>(config.data_path);
    if (vocab < source->vocab())
      throw std::invalid_argument("data file tokens are bytes (vocab 256) but the model vocab is " +
                                  std::to_string(vocab) + "; use --vocab 256 or more");
    // A batch is a run of consecutive (input, target) pairs: a file with fewer would wrap
    // around inside every batch, training on its bytes over and over in one step.
    const uint64_t pairs = source->bytes() - 1;
    if (pairs < static_cast<uint64_t>(config.batch_tokens))
      throw std::invalid_argument(
          "data file " + quoted_file_name(config.data_path) + " has " +
          std::to_string(source->bytes()) + " bytes, " + std::to_string(pairs) +
          " (input, target) pairs, but one step's batch of " + std::to_string(config.batch_tokens) +
          " tokens needs " + std::to_string(config.batch_tokens + 1) +
          " bytes; give a larger file or --batch-tokens " + std::to_string(pairs) + " or fewer");
    return source;
  }
  if (vocab < 1)
    throw std::invalid_argument(
        "the model description does not say its vocab, so no built-in data source can be made "
        "for it; set ModelDescription::vocab or give the trainer a TokenSource");
  return std::make_unique<MarkovSource>(vocab, config.seed);
}

std::unique_ptr<TokenSource> make_token_source_at(const TrainConfig& config, int64_t vocab,
                                                  const TokenSource& run) {
  std::unique_ptr<TokenSource> source = make_token_source(config, vocab);
  source->restore(run.position(), run.current_token());
  return source;
}

// model_ is declared before config_, so it is built from the argument before that moves.
Trainer::Trainer(TrainConfig config, std::shared_ptr<TokenSource> source)
    : model_(reference_model(config.model)),
      config_(std::move(config)),
      source_(std::move(source)) {
  build();
}

Trainer::Trainer(ModelDescription model, TrainConfig config, std::shared_ptr<TokenSource> source)
    : model_(std::move(model)), config_(std::move(config)), source_(std::move(source)) {
  build();
}

void Trainer::build() {
  config_.validate();
  model_.validate();
  device_ = resolve_device(config_.device);
  if (!source_) {
    source_ = make_token_source(config_, model_.vocab);
  } else if (model_.vocab > 0 && source_->vocab() > model_.vocab) {
    throw std::invalid_argument(
        "the data source has token ids up to " + std::to_string(source_->vocab() - 1) +
        " but the model takes ids below " + std::to_string(model_.vocab) +
        "; use a model of vocab " + std::to_string(source_->vocab()) + " or more");
  }
  schedule::Schedule sched = make_schedule(config_);
  if (sched.num_stages() > sched.num_ranks() && sched.num_stages() > model_.num_units) {
    // partition_blocks would say so in stages alone, which the user did not ask for.
    const int chunks = sched.num_stages() / sched.num_ranks();
    throw std::invalid_argument(
        "the pipeline has " + std::to_string(sched.num_stages()) + " stages (" +
        std::to_string(sched.num_ranks()) + " ranks x " + std::to_string(chunks) + " chunks of " +
        sched.name + ") but the model has " + std::to_string(model_.num_units) +
        " units, at least one for each stage; use fewer ranks (--stages)" +
        (config_.schedule == schedule::ScheduleKind::kZBV ? "" : " or chunks (--chunks)") +
        ", or more layers");
  }
  ranges_ = conveyor::stage_ranges(model_,
                                   partition_blocks(model_, sched.num_stages(), config_.partition));
  set_gradient_buckets(sched, model_, ranges_, config_);
  const int p = sched.num_ranks() * sched.replicas;  // every replica's ranks
  // GPU ranks as processes (NCCL over MPI): whichever rank this process holds runs on the
  // GPU the process was given; the other ranks run in other processes, on theirs.
  const bool one_device_per_process =
      device_.is_cuda() && comm::one_rank_per_process(config_.transport);
  const bool spread = device_.is_cuda() && config_.placement == RankPlacement::kAuto &&
                      !one_device_per_process && cuda_device_count() >= device_.index + p;
  for (int r = 0; r < p; ++r)
    devices_.push_back(spread ? Device::cuda(device_.index + r) : device_);
  check_memory_fits(model_, ranges_, sched, devices_, config_, one_device_per_process);
  ExecutorOptions options;
  options.transport_timeout = config_.transport_timeout;
  options.transport = config_.transport;
  options.shard_optimizer = config_.shard_optimizer;
  options.device_options.memory_limit_bytes = config_.memory_limit_bytes;
  options.device_options.allow_tf32 = config_.allow_tf32;
  options.device_options.cpu_threads = cpu_threads_per_rank(config_.cpu_threads, p);
  options.recompute = config_.recompute;
  executor_ = std::make_unique<PipelineExecutor>(model_, std::move(sched), ranges_, devices_,
                                                 config_.optimizer, config_.seed, options);
}

std::vector<MicroBatchData> Trainer::draw_batch(TokenSource& source) const {
  const int64_t n = config_.batch_tokens / config_.microbatches;
  std::vector<MicroBatchData> microbatches(config_.microbatches);
  for (auto& mb : microbatches) {
    mb.tokens.resize(n);
    mb.targets.resize(n);
    source.next(mb.tokens.data(), mb.targets.data(), n);
  }
  return microbatches;
}

void Trainer::check_usable(const char* action) const {
  if (!failure_.empty())
    throw std::logic_error("the trainer cannot " + std::string(action) + ": " + failure_ +
                           ", which left its stages and transports unusable; build a new "
                           "Trainer (from the last checkpoint to go on)");
}

void Trainer::check_token_ids(const std::vector<MicroBatchData>& microbatches) const {
  if (model_.vocab <= 0) return;  // the model does not say; its own units must check
  // Checked here, once on the host: a CUDA embedding or loss kernel cannot report an id out
  // of range, it would read past its table.
  const int32_t ignored = MicroBatchInputs().ignore_index;
  auto check = [&](const std::vector<int32_t>& ids, size_t m, bool targets) {
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      if ((id >= 0 && id < model_.vocab) || (targets && id == ignored)) continue;
      throw std::invalid_argument(
          std::string(targets ? "target id " : "token id ") + std::to_string(id) + " at position " +
          std::to_string(i) + " of micro-batch " + std::to_string(m) + " is outside [0, " +
          std::to_string(model_.vocab) + "), the model's vocabulary" +
          (targets ? " (and is not the ignored target " + std::to_string(ignored) + ")"
                   : std::string()));
    }
  };
  for (size_t m = 0; m < microbatches.size(); ++m) {
    check(microbatches[m].tokens, m, false);
    check(microbatches[m].targets, m, true);
  }
}

StepStats Trainer::step() {
  check_usable("run a step");
  const int64_t step = steps_done_ + 1;
  const std::vector<MicroBatchData> microbatches = draw_batch(*source_);
  check_token_ids(microbatches);
  for (int r : executor_->local_ranks()) executor_->context(r).allocator().reset_peak();
  const double lr = learning_rate(config_.optimizer, step, config_.steps);
  PipelineStepResult result;
  try {
    result = executor_->run_step(microbatches, 1.0f / static_cast<float>(config_.batch_tokens),
                                 step, lr);
  } catch (const std::exception& e) {
    failure_ = "step " + std::to_string(step) + " failed (" + first_line(e.what()) + ")";
    throw;
  }
  const double loss = result.loss_sum / static_cast<double>(config_.batch_tokens);
  if (result.diverged) {
    std::ostringstream msg;
    msg << "loss became " << loss << " (gradient norm " << result.grad_norm << ") at step " << step
        << "; lower the learning rate (--lr)";
    if (config_.optimizer.clip_norm > 0)
      msg << " or the clipping norm (--clip, now " << config_.optimizer.clip_norm << ")";
    else
      msg << " or enable clipping (--clip)";
    throw TrainingDiverged(msg.str());
  }
  steps_done_ = step;

  StepStats stats;
  stats.step = step;
  stats.loss = loss;
  stats.tokens = config_.batch_tokens;
  stats.seconds = result.seconds;
  stats.lr = lr;
  stats.grad_norm = result.grad_norm;
  for (size_t bytes : result.peak_allocated_bytes)
    stats.peak_bytes = std::max(stats.peak_bytes, bytes);
  stats.pipeline = std::move(result);
  return stats;
}

void Trainer::resume_at(int64_t steps_done) {
  if (steps_done < 0 || steps_done > config_.steps)
    throw std::invalid_argument("cannot resume at step " + std::to_string(steps_done) +
                                ": the run has " + std::to_string(config_.steps) +
                                " steps; raise --steps to train past the checkpoint");
  steps_done_ = steps_done;
}

double Trainer::evaluate(TokenSource& source, int64_t batches, int64_t tokens_at_once) {
  check_usable("evaluate");
  if (batches < 1)
    throw std::invalid_argument("evaluation needs at least 1 batch, got " +
                                std::to_string(batches));
  if (model_.vocab > 0 && source.vocab() > model_.vocab)
    throw std::invalid_argument("the evaluation source has token ids up to " +
                                std::to_string(source.vocab() - 1) +
                                " but the model takes ids below " + std::to_string(model_.vocab));
  if (tokens_at_once < 1)
    throw std::invalid_argument("evaluation needs at least 1 token at once, got " +
                                std::to_string(tokens_at_once));
  // A bounded number of batches at a time: all of them at once held every id in memory
  // (--eval-batches 1000000 asked for 32 GB), and their losses on the device. The running
  // sum goes on in micro-batch order, so the value does not depend on the grouping.
  const int64_t at_once = std::max<int64_t>(1, tokens_at_once / config_.batch_tokens);
  double loss_sum = 0.0;
  for (int64_t done = 0; done < batches;) {
    const int64_t now = std::min(at_once, batches - done);
    std::vector<MicroBatchData> microbatches;
    for (int64_t b = 0; b < now; ++b)
      for (MicroBatchData& mb : draw_batch(source)) microbatches.push_back(std::move(mb));
    loss_sum = local_loss_sum(microbatches, loss_sum);
    done += now;
    if (done < batches)
      if (const int signal = agreed_stop_request()) throw EvaluationStopped(signal);
  }
  std::vector<double> total{loss_sum};
  executor_->sum_over_processes(total);
  return total[0] / static_cast<double>(batches * config_.batch_tokens);
}

namespace {

#ifdef CONVEYOR_WITH_CUDA
using DeviceScope = detail::CudaDeviceGuard;
#endif

// i32 ids on the context's device.
Tensor upload(DeviceContext& ctx, const std::vector<int32_t>& ids) {
  Tensor t = ctx.empty({static_cast<int64_t>(ids.size())}, DType::kI32);
  copy_from_host(t, ids.data(), ids.size() * sizeof(int32_t));
  return t;
}

// The forward of every stage of the ranks `local` (of those this process holds), micro-batch
// by micro-batch and stage by stage in ascending order; an activation whose next stage is
// one of theirs is copied (or kept, on the same rank), one whose next stage is another rank's
// goes over the sending rank's transport. Returns the sum of the token losses in micro-batch
// order after `start` when the last stage is one of theirs, else 0.0 (its holder's value is
// the one that counts).
//
// It cannot deadlock, whether the callers are processes or threads: each walks the
// (micro-batch, stage) pairs of its ranks in the same global order, a send never waits for
// its receiver (the transports enqueue it), and a receive waits only for the previous pair.
// So the lowest pair not yet done anywhere always has its input sent already, and its
// holder, having done every lower pair of its own, is waiting on exactly that pair: it
// moves. Each link carries its messages in that global order on both ends, so FIFO matching
// pairs them right.
double forward_losses(PipelineExecutor& executor, const ModelDescription& model,
                      const std::vector<StageRange>& ranges,
                      const std::vector<MicroBatchData>& microbatches, float loss_scale,
                      const std::vector<int>& local, double start) {
  const schedule::Schedule& sched = executor.schedule();
  const int last = sched.num_stages() - 1;
  // Replica 0's ranks run the stages (a rank of another replica holds none of them).
  std::vector<bool> here(sched.num_stages(), false);
  for (int s = 0; s <= last; ++s)
    here[s] = std::find(local.begin(), local.end(), sched.placement.rank_of(s)) != local.end();
  std::vector<Tensor> losses;
  for (const MicroBatchData& mb : microbatches) {
    const int64_t n = static_cast<int64_t>(mb.tokens.size());
    Tensor x;
    for (int s = 0; s <= last; ++s) {
      if (!here[s]) continue;
      const int rank = sched.placement.rank_of(s);
      Stage& stage = executor.stage(s);
      DeviceContext& ctx = stage.context();
#ifdef CONVEYOR_WITH_CUDA
      std::optional<DeviceScope> scope;
      if (ctx.is_cuda()) scope.emplace(ctx.device().index);
#endif
      if (s == 0) {
        x = upload(ctx, mb.tokens);
      } else if (!here[s - 1]) {
        const ActivationSpec spec = model.activation_at(ranges[s].begin, n);
        x = ctx.empty(spec.shape, spec.dtype);
        executor.transport(rank).recv(x, sched.placement.rank_of(s - 1), ctx.compute_stream());
      } else if (&executor.stage(s - 1).context() != &ctx) {
        // Another rank: its compute stream made `x`; a copy without a stream waits for it.
        Tensor moved = ctx.empty(x.shape(), x.dtype());
        copy_tensor(moved, x);
        x = moved;
      }
      MicroBatchInputs in;
      in.tokens = n;
      in.loss_scale = loss_scale;
      if (s == last) in.targets = upload(ctx, mb.targets);
      x = stage.forward_only(x, in);
      if (s == last)
        losses.push_back(x);
      else if (!here[s + 1])
        executor.transport(rank).send(x, sched.placement.rank_of(s + 1), ctx.compute_stream());
    }
  }
  // Bounded: a transfer that waits on a dead peer fails instead of hanging here.
  for (int r : local) executor.transport(r).synchronize(executor.context(r).compute_stream());
  if (!here[last]) return 0.0;
  DeviceContext& last_ctx = executor.stage(last).context();
  std::vector<double> sums;
  {
#ifdef CONVEYOR_WITH_CUDA
    std::optional<DeviceScope> scope;
    if (last_ctx.is_cuda()) scope.emplace(last_ctx.device().index);
#endif
    sums = ops::sum_each(last_ctx, losses);
  }
  // Micro-batch order, as the training step adds them.
  double loss_sum = start;
  for (double v : sums) loss_sum += v;
  return loss_sum;
}

}  // namespace

double Trainer::evaluate(const std::vector<MicroBatchData>& microbatches) {
  check_usable("evaluate");
  if (microbatches.empty()) throw std::invalid_argument("evaluation needs at least 1 micro-batch");
  int64_t tokens = 0;
  for (const MicroBatchData& mb : microbatches) {
    if (mb.tokens.empty() || mb.targets.size() != mb.tokens.size())
      throw std::invalid_argument(
          "an evaluation micro-batch needs as many targets as tokens, and at least one token");
    tokens += static_cast<int64_t>(mb.tokens.size());
  }
  std::vector<double> total{local_loss_sum(microbatches, 0.0)};
  executor_->sum_over_processes(total);
  return total[0] / static_cast<double>(tokens);
}

int Trainer::agreed_stop_request() {
  const int asked = executor_->stop_requested();
  if (executor_->holds_all_ranks()) return asked;
  // One slot per process (each holds one rank), so the sum gathers every answer as it is.
  const int me = executor_->local_ranks().front();
  std::vector<double> slots(static_cast<size_t>(executor_->transport(me).size()), 0.0);
  slots[static_cast<size_t>(me)] = asked;
  executor_->sum_over_processes(slots);
  for (const double s : slots)
    if (s != 0) return static_cast<int>(s);
  return 0;
}

double Trainer::local_loss_sum(const std::vector<MicroBatchData>& microbatches, double start) {
  check_token_ids(microbatches);
  try {
    return forward_loss_sum(microbatches, start);
  } catch (const std::exception& e) {
    failure_ = "an evaluation failed (" + first_line(e.what()) + ")";
    throw;
  }
}

double Trainer::forward_loss_sum(const std::vector<MicroBatchData>& microbatches, double start) {
  // The loss head's gradient scale, as in a training step; evaluation discards the gradient.
  const float loss_scale = 1.0f / static_cast<float>(config_.batch_tokens);
  double loss_sum = 0.0;
  if (!executor_->holds_all_ranks()) {
    // This process's ranks, in step with the other processes'.
    try {
      loss_sum = forward_losses(*executor_, model_, ranges_, microbatches, loss_scale,
                                executor_->local_ranks(), start);
    } catch (const std::exception& e) {
      // The other processes would otherwise wait for this one until their deadlines.
      executor_->transport(executor_->local_ranks().front()).abort(e.what());
      throw;
    }
  } else {
    // One thread per rank of the pipeline, as the processes would be: the stages overlap,
    // each rank's micro-batch b running while the next rank runs b - 1. A failure aborts the
    // transport, so that the others' waits end too; the first error is the one rethrown.
    // Replica 0's ranks are 0 .. P-1.
    const int ranks = executor_->schedule().num_ranks();
    std::vector<double> sums(ranks, 0.0);
    // Per rank: a failure of its own, or the abort another rank's failure caused.
    std::vector<std::exception_ptr> failures(ranks), aborts(ranks);
    std::vector<std::thread> workers;
    for (int r = 0; r < ranks; ++r)
      workers.emplace_back([&, r] {
        try {
          sums[r] =
              forward_losses(*executor_, model_, ranges_, microbatches, loss_scale, {r}, start);
        } catch (const comm::TransportAborted&) {
          aborts[r] = std::current_exception();
        } catch (const std::exception& e) {
          failures[r] = std::current_exception();
          executor_->transport(r).abort(e.what());
        } catch (...) {
          failures[r] = std::current_exception();
          executor_->transport(r).abort("evaluation failed");
        }
      });
    for (std::thread& w : workers) w.join();
    // The root failure, not the aborts it caused elsewhere.
    for (const auto* errors : {&failures, &aborts})
      for (const std::exception_ptr& e : *errors)
        if (e) std::rethrow_exception(e);
    // Only the last stage's rank gives a non-zero sum.
    for (double v : sums) loss_sum += v;
  }
  // Every process but the last stage's gives exactly 0.0, so the sum over processes is that
  // process's value.
  return loss_sum;
}

}  // namespace conveyor
