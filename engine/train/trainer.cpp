#include "engine/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>
#include <thread>
#include <utility>

#include "comm/transport_factory.h"
#include "engine/core/number_text.h"
#include "layers/ops.h"
#ifdef CONVEYOR_WITH_CUDA
#include "engine/core/cuda_device_guard.h"
#endif

namespace conveyor {
namespace {

// A PipelineError's first line names the rank, the action and the cause; the lines after it
// draw where every rank stood, too much to repeat in a later refusal.
std::string first_line(const std::string& message) { return message.substr(0, message.find('\n')); }

// The sentence of the exception being handled.
std::string current_error() {
  try {
    throw;
  } catch (const std::exception& e) {
    return error_sentence(e);
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// A value for a divergence's message: a NaN's sign bit means nothing, and printed as "-nan"
// it reads like a value.
double shown(double value) { return std::isnan(value) ? std::fabs(value) : value; }

// Marks the trainer busy for a step() or evaluate(): two at once on one trainer (from two
// threads) would share its ranks' threads and buffers, and hang or mix their numbers.
class OneAtATime {
 public:
  OneAtATime(std::atomic<bool>& busy, const char* action) : busy_(busy) {
    if (busy_.exchange(true))
      throw std::logic_error("the trainer cannot " + std::string(action) +
                             ": another step() or evaluate() of it is running on another "
                             "thread; a trainer runs one at a time (two trainers may run side "
                             "by side)");
  }
  ~OneAtATime() { busy_.store(false); }
  OneAtATime(const OneAtATime&) = delete;
  OneAtATime& operator=(const OneAtATime&) = delete;

 private:
  std::atomic<bool>& busy_;
};

}  // namespace

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
  set_accepted_ids();
  if (!source_) {
    source_ = make_token_source(config_, model_.vocab);
  } else if (source_->vocab() < 1) {
    throw std::invalid_argument("the data source (" + source_->describe() +
                                ") says its vocab() is " + std::to_string(source_->vocab()) +
                                "; a TokenSource's vocab() is the number of token ids it draws, at "
                                "least 1");
  } else {
    check_source_vocab(*source_, "the data source");
  }
  schedule::Schedule sched = make_schedule(config_);
  if (sched.num_stages() > sched.num_ranks() && sched.num_stages() > model_.num_units) {
    // partition_blocks would say so in stages alone, which the user did not ask for.
    const int chunks = sched.num_stages() / sched.num_ranks();
    throw std::invalid_argument(
        "the pipeline has " + std::to_string(sched.num_stages()) + " stages (" +
        std::to_string(sched.num_ranks()) + " ranks x " + std::to_string(chunks) + " chunks of " +
        sched.name + ") but the model has " + std::to_string(model_.num_units) +
        " units, at least one for each stage; use fewer ranks (TrainConfig::stages)" +
        (config_.schedule == schedule::ScheduleKind::kZBV ? ""
                                                          : " or chunks (TrainConfig::chunks)") +
        ", or more layers");
  }
  ranges_ = conveyor::stage_ranges(model_,
                                   partition_blocks(model_, sched.num_stages(), config_.partition));
  set_gradient_buckets(sched, model_, ranges_, config_);
  const int p = sched.num_ranks() * sched.replicas;  // every replica's ranks
  // GPU ranks as processes (NCCL over MPI): whichever rank this process holds runs on the
  // GPU the process was given; the other ranks run in other processes, on theirs.
  const bool one_rank_per_process = comm::one_rank_per_process(config_.transport);
  const bool one_device_per_process = device_.is_cuda() && one_rank_per_process;
  const bool spread = device_.is_cuda() && config_.placement == RankPlacement::kAuto &&
                      !one_device_per_process && cuda_device_count() >= device_.index + p;
  for (int r = 0; r < p; ++r)
    devices_.push_back(spread ? Device::cuda(device_.index + r) : device_);
  check_memory_fits(model_, ranges_, sched, devices_, config_, one_device_per_process,
                    one_rank_per_process);
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
    // An id no source gives, so that one its next() leaves unwritten (a source that ran out
    // and wrote what it had) is refused by check_token_ids instead of trained on as token 0.
    mb.tokens.assign(n, kUnwrittenId);
    mb.targets.assign(n, kUnwrittenId);
    source.next(mb.tokens.data(), mb.targets.data(), n);
  }
  return microbatches;
}

void Trainer::check_usable(const char* action) const {
  if (!failure_.empty())
    throw std::logic_error("the trainer cannot " + std::string(action) + ": " + failure_ +
                           "; build a new Trainer (from the last checkpoint to go on)");
}

void Trainer::put_back_source(uint64_t position, std::optional<int32_t> token, int64_t step,
                              const std::string& why) {
  try {
    source_->restore(position, token);
  } catch (const std::exception& e) {
    // Where the source stands now is unknown: the next steps would train on other tokens than
    // their own, without a word.
    failure_ = "step " + std::to_string(step) +
               "'s data source could not be put back where the step began (" +
               first_line(error_sentence(e)) + ")";
    throw std::runtime_error("step " + std::to_string(step) + " stopped (" + first_line(why) +
                             ") and its data source could not be put back where the step "
                             "began (" +
                             first_line(error_sentence(e)) +
                             "): the steps after it would read other tokens than their own; "
                             "build a new Trainer (from the last checkpoint to go on)");
  }
}

bool Trainer::has_target(const std::vector<MicroBatchData>& microbatches) {
  const int32_t ignored = MicroBatchInputs().ignore_index;
  for (const MicroBatchData& mb : microbatches)
    for (const int32_t t : mb.targets)
      if (t != ignored) return true;
  return false;
}

void Trainer::check_some_target(const std::vector<MicroBatchData>& microbatches,
                                int64_t step) const {
  if (has_target(microbatches)) return;
  throw std::invalid_argument("every target of step " + std::to_string(step) +
                              "'s batch is the ignored target " +
                              std::to_string(MicroBatchInputs().ignore_index) +
                              ": a step has nothing to learn from it (its loss would read 0); "
                              "check the data source");
}

void Trainer::refuse_evaluation_without_target(const std::string& what, const char* check) {
  throw std::invalid_argument("every target of " + what + " is the ignored target " +
                              std::to_string(MicroBatchInputs().ignore_index) +
                              ": an evaluation has nothing to measure (its loss would read 0); "
                              "check the " +
                              check);
}

void Trainer::set_accepted_ids() {
  if (model_.vocab > 0) {
    token_ids_ = {model_.vocab, "the model's vocabulary"};
    target_ids_ = token_ids_;
    return;
  }
  // A model that does not say its vocab: the ids its first unit (an embedding) and its last
  // (a loss head) say they accept, so that an id past their tables is refused on the host
  // as a vocab would refuse it, rather than read past them by a kernel.
  const int64_t last = model_.num_units - 1;
  if (const std::optional<int64_t> ids = model_.unit(0)->accepted_ids())
    token_ids_ = {*ids, "the ids unit 0 of the model accepts"};
  if (const std::optional<int64_t> ids = model_.unit(last)->accepted_ids())
    target_ids_ = {*ids, "the ids unit " + std::to_string(last) + " of the model accepts"};
}

void Trainer::check_source_vocab(const TokenSource& source, const std::string& label) const {
  // Its ids are both tokens and targets: the narrower of the two ranges bounds them.
  for (const std::optional<AcceptedIds>* range : {&token_ids_, &target_ids_}) {
    if (!*range || source.vocab() <= (*range)->end) continue;
    const std::string need = std::to_string(source.vocab());
    throw std::invalid_argument(
        label + " has token ids up to " + std::to_string(source.vocab() - 1) + " but " +
        (model_.vocab > 0 ? "the model takes ids below " + std::to_string(model_.vocab) +
                                "; use a model of vocab " + need + " or more"
                          : "the model's " + std::string(range == &token_ids_ ? "first" : "last") +
                                " unit takes ids below " + std::to_string((*range)->end) +
                                "; use a model whose units take " + need + " ids or more"));
  }
}

void Trainer::check_token_ids(const std::vector<MicroBatchData>& microbatches) const {
  // Checked here, once on the host: a CUDA embedding or loss kernel cannot report an id out
  // of range, it would read past its table. A model that says neither its vocab nor the ids
  // its units accept leaves the range to its own units.
  const int32_t ignored = MicroBatchInputs().ignore_index;
  auto check = [&](const std::vector<int32_t>& ids, size_t m, bool targets) {
    const std::optional<AcceptedIds>& range = targets ? target_ids_ : token_ids_;
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      if (id == kUnwrittenId)
        throw std::invalid_argument(
            std::string(targets ? "the target" : "the token id") + " at position " +
            std::to_string(i) + " of micro-batch " + std::to_string(m) +
            " was not written by the data source; TokenSource::next must write all the pairs "
            "it is asked for (one that has run out throws)");
      if (!range || (id >= 0 && id < range->end) || (targets && id == ignored)) continue;
      throw std::invalid_argument(
          std::string(targets ? "target id " : "token id ") + std::to_string(id) + " at position " +
          std::to_string(i) + " of micro-batch " + std::to_string(m) + " is outside [0, " +
          std::to_string(range->end) + "), " + range->what +
          (targets ? " (and is not the ignored target " + std::to_string(ignored) + ")"
                   : std::string()));
    }
  };
  for (size_t m = 0; m < microbatches.size(); ++m) {
    check(microbatches[m].tokens, m, false);
    check(microbatches[m].targets, m, true);
  }
}

Trainer::~Trainer() {
  if (destroy_handler_) destroy_handler_();
}

StepStats Trainer::step() {
  const OneAtATime one(busy_, "run a step");
  check_usable("run a step");
  if (!diverged_.empty())
    throw std::logic_error("the trainer cannot run a step: the " + diverged_ +
                           ", which applied no update, so the same step would diverge again on "
                           "the same weights and batch; restore a checkpoint into the trainer "
                           "(resume_trainer) or build a new Trainer");
  const int64_t step = steps_done_ + 1;
  if (step > config_.steps)
    throw std::logic_error("the trainer has run all " + std::to_string(config_.steps) +
                           " steps of its run (TrainConfig::steps, which the learning-rate "
                           "schedule and a checkpoint's counters span); make a trainer of more "
                           "steps to go on (from a checkpoint of this one)");
  // A batch refused before it runs, or one the source failed to give whole, is put back, so
  // that the source is where it was and the step can be tried again.
  const uint64_t position_at_draw = source_->position();
  const std::optional<int32_t> token_at_draw = source_->current_token();
  std::vector<MicroBatchData> microbatches;
  try {
    microbatches = draw_batch(*source_);
  } catch (...) {
    // A source that fails part-way has given the micro-batches before the failure: trying the
    // step again must draw the batch from its start, not from the middle.
    put_back_source(position_at_draw, token_at_draw, step, current_error());
    throw;
  }
  try {
    check_token_ids(microbatches);
    check_some_target(microbatches, step);
  } catch (const std::invalid_argument& e) {
    put_back_source(position_at_draw, token_at_draw, step, e.what());
    throw;
  }
  for (int r : executor_->local_ranks()) executor_->context(r).allocator().reset_peak();
  const double lr = learning_rate(config_.optimizer, step, config_.steps);
  PipelineStepResult result;
  try {
    result = executor_->run_step(microbatches, 1.0f / static_cast<float>(config_.batch_tokens),
                                 step, lr);
  } catch (const std::exception& e) {
    failure_ = "step " + std::to_string(step) + " failed (" + first_line(e.what()) +
               "), which left its stages and transports unusable";
    throw;
  }
  const double loss = result.loss_sum / static_cast<double>(config_.batch_tokens);
  if (result.diverged) {
    // The step did not happen: its batch is the next step's, as for a batch refused above,
    // so that a checkpoint of the last good step saved now resumes on the right batch.
    put_back_source(position_at_draw, token_at_draw, step, "it diverged");
    std::ostringstream what;
    // Say which went non-finite: a finite loss with a NaN norm is the gradient's doing.
    if (std::isfinite(loss))
      what << "gradient norm became " << shown(result.grad_norm) << " (loss " << loss << ")";
    else
      what << "loss became " << shown(loss) << " (gradient norm " << shown(result.grad_norm) << ")";
    what << " at step " << step;
    diverged_ = what.str();
    std::ostringstream msg;
    msg << (std::isfinite(loss) ? "the " : "") << diverged_;
    // The first step's loss and gradient come before any update, so no rate or clipping
    // setting can be their cause: the model's own computation is.
    if (step == 1)
      msg << ", before any update, so not through the learning rate or clipping: a unit's "
             "forward or backward gives non-finite values on the weights the run starts from";
    else if (config_.optimizer.clip_norm > 0)
      msg << "; lower the learning rate (TrainConfig::optimizer.lr) or the clipping norm "
             "(TrainConfig::optimizer.clip_norm, now "
          << config_.optimizer.clip_norm << ")";
    else
      msg << "; lower the learning rate (TrainConfig::optimizer.lr) or enable clipping "
             "(TrainConfig::optimizer.clip_norm)";
    throw TrainingDiverged(msg.str(), loss);
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

void Trainer::check_not_busy(const char* member) const {
  if (busy_.load())
    throw std::logic_error(std::string("Trainer::") + member +
                           " cannot be called while a step() or evaluate() of the trainer runs "
                           "on another thread: the step changes what it reads or returns; call "
                           "it between steps");
}

const std::string& Trainer::failure() const {
  check_not_busy("failure()");
  return failure_;
}

void Trainer::mark_unusable(std::string what) {
  check_not_busy("mark_unusable()");
  // An empty failure_ means usable: an empty reason must still mark it.
  failure_ = what.empty() ? "marked unusable" : std::move(what);
}

void Trainer::save_now() {
  check_not_busy("save_now()");
  if (save_handler_) save_handler_();
}

TokenSource& Trainer::source() {
  check_not_busy("source()");
  return *source_;
}

const TokenSource& Trainer::source() const {
  check_not_busy("source()");
  return *source_;
}

PipelineExecutor& Trainer::executor() {
  check_not_busy("executor()");
  return *executor_;
}

void Trainer::resume_at(int64_t steps_done) {
  check_not_busy("resume_at()");
  if (steps_done < 0 || steps_done > config_.steps)
    throw std::invalid_argument("cannot resume at step " + std::to_string(steps_done) +
                                ": the run has " + counted(config_.steps, "step") +
                                "; raise TrainConfig::steps to train past the checkpoint");
  steps_done_ = steps_done;
  diverged_.clear();
}

double Trainer::evaluate(TokenSource& source, int64_t batches, int64_t tokens_at_once) {
  const OneAtATime one(busy_, "evaluate");
  check_usable("evaluate");
  // Its batches would be the next steps' own, which the training would then skip.
  if (&source == source_.get())
    throw std::invalid_argument(
        "Trainer::evaluate was given the trainer's own training source (Trainer::source()), "
        "whose next batches the steps would then skip; give a source of held-out data "
        "(make_held_out_source for the built-in ones)");
  // The mean divides by batches x batch_tokens, which must not wrap.
  const int64_t max_batches = std::numeric_limits<int64_t>::max() / config_.batch_tokens;
  if (batches < 1 || batches > max_batches)
    throw std::invalid_argument(
        "Trainer::evaluate's batches must be from 1 to " + std::to_string(max_batches) +
        " (batches x TrainConfig::batch_tokens " + std::to_string(config_.batch_tokens) +
        " must fit an int64_t), got " + std::to_string(batches));
  check_source_vocab(source, "the evaluation source");
  if (tokens_at_once < 1)
    throw std::invalid_argument("evaluation needs at least 1 token at once, got " +
                                std::to_string(tokens_at_once));
  // A bounded number of batches at a time: all of them at once held every id in memory
  // (--eval-batches 1000000 asked for 32 GB), and their losses on the device. The running
  // sum goes on in micro-batch order, so the value does not depend on the grouping.
  const int64_t at_once = std::max<int64_t>(1, tokens_at_once / config_.batch_tokens);
  double loss_sum = 0.0;
  bool some_target = false;
  for (int64_t done = 0; done < batches;) {
    const int64_t now = std::min(at_once, batches - done);
    std::vector<MicroBatchData> microbatches;
    for (int64_t b = 0; b < now; ++b)
      for (MicroBatchData& mb : draw_batch(source)) microbatches.push_back(std::move(mb));
    // Refused before the last group runs (the only one, usually), as a step is refused: the
    // ignored targets count as no loss, and a mean of only those would read 0.
    some_target = some_target || has_target(microbatches);
    if (done + now == batches && !some_target)
      refuse_evaluation_without_target("the evaluation's " + counted(batches, "batch", "batches"),
                                       "evaluation source");
    loss_sum = local_loss_sum(microbatches, loss_sum);
    done += now;
    if (done < batches)
      if (const int signal = stop_request_over_processes()) throw EvaluationStopped(signal);
  }
  std::vector<double> total{loss_sum};
  executor_->sum_over_processes(total);
  return evaluated_mean(total[0], batches * config_.batch_tokens);
}

double Trainer::evaluated_mean(double loss_sum, int64_t tokens) const {
  const double loss = loss_sum / static_cast<double>(tokens);
  if (std::isfinite(loss)) return loss;
  // Every process has the same sum, so every process throws alike.
  std::ostringstream msg;
  msg << "the evaluation's mean loss is " << shown(loss);
  if (steps_done_ == 0)
    msg << " with the weights the run starts from: a unit's forward gives non-finite values on "
           "them";
  else
    msg << " with the weights of step " << steps_done_
        << ", whose update diverged; lower the learning rate (TrainConfig::optimizer.lr)";
  throw TrainingDiverged(msg.str(), loss);
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
  const OneAtATime one(busy_, "evaluate");
  check_usable("evaluate");
  if (microbatches.empty()) throw std::invalid_argument("evaluation needs at least 1 micro-batch");
  int64_t tokens = 0;
  for (const MicroBatchData& mb : microbatches) {
    if (mb.tokens.empty() || mb.targets.size() != mb.tokens.size())
      throw std::invalid_argument(
          "an evaluation micro-batch needs as many targets as tokens, and at least one token");
    tokens += static_cast<int64_t>(mb.tokens.size());
  }
  if (!has_target(microbatches))
    refuse_evaluation_without_target(
        "the " + counted(microbatches.size(), "micro-batch", "micro-batches") + " evaluated",
        "batches");
  std::vector<double> total{local_loss_sum(microbatches, 0.0)};
  executor_->sum_over_processes(total);
  return evaluated_mean(total[0], tokens);
}

int Trainer::agreed_stop_request() {
  const OneAtATime one(busy_, "ask for the agreed stop request");
  check_usable("ask for the agreed stop request");
  return stop_request_over_processes();
}

int Trainer::stop_request_over_processes() {
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
    failure_ = "an evaluation failed (" + first_line(e.what()) +
               "), which left its stages and transports unusable";
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
