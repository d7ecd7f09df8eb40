#pragma once
// Training: the global batch of each step is split into micro-batches whose gradients
// accumulate, the step's loss is the mean over all its tokens, and one optimizer step (with
// clipping by the global gradient norm) follows on every rank. The model — the reference
// model of a ModelConfig or any ModelDescription — is cut into pipeline stages run by the
// executor under a schedule; one stage on one device is the plain single-device case
// (schedule 1f1b with p = 1: F0 B0 F1 B1 ...). Data comes from a TokenSource: the caller's,
// or a built-in one (a file's bytes, or a Markov chain over the model's vocabulary).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/device_context.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/optimizer.h"
#include "engine/pipeline/partition.h"
#include "engine/pipeline/planner.h"
#include "engine/schedule/generators.h"
#include "engine/train/data.h"
#include "engine/train/train_config.h"
#include "layers/model.h"

namespace conveyor {

// Training stopped because the loss or the gradient stopped being finite: a step's, or an
// evaluation's. loss() is the mean loss seen (finite when only a step's gradient norm was
// not; NaN when the thrower did not say).
class TrainingDiverged : public std::runtime_error {
 public:
  explicit TrainingDiverged(const std::string& message,
                            double loss = std::numeric_limits<double>::quiet_NaN())
      : std::runtime_error(message), loss_(loss) {}
  double loss() const { return loss_; }

 private:
  double loss_;
};

struct StepStats {
  int64_t step = 0;
  double loss = 0.0;
  int64_t tokens = 0;
  double seconds = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  size_t peak_bytes = 0;        // largest peak of live allocations over the ranks' devices
  PipelineStepResult pipeline;  // measured timeline, per-rank memory
};

// Trainer::evaluate stopped by the executor's stop request; `signal()` is what it gave.
class EvaluationStopped : public std::runtime_error {
 public:
  explicit EvaluationStopped(int signal)
      : std::runtime_error("evaluation stopped by signal " + std::to_string(signal)),
        signal_(signal) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

class Trainer {
 public:
  // The reference model of config.model.
  explicit Trainer(TrainConfig config, std::shared_ptr<TokenSource> source = nullptr);
  // Any model; config.model is not used. Without a `source`, the built-in one needs the
  // description's vocab.
  Trainer(ModelDescription model, TrainConfig config,
          std::shared_ptr<TokenSource> source = nullptr);
  // Runs the destroy handler first (set_destroy_handler).
  ~Trainer();
  // A TrainerCheckpointer and the executor's threads hold on to the trainer where it is.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // A trainer runs one step() or evaluate() at a time: one called while another runs (on
  // another thread) throws std::logic_error. Two trainers may run side by side.
  //
  // Runs the next step, up to config().steps (past it, std::logic_error: the learning-rate
  // schedule and a checkpoint's counters span those steps). The batch's ids are checked
  // against the model's vocab first (without one, against the ids its first and last units
  // accept: Layer::accepted_ids), and an id the source's next() left unwritten refused,
  // and a batch whose every target is the ignored one is
  // refused, as it has nothing to learn from (std::invalid_argument, nothing run, the source
  // put back where it was: TokenSource::restore). An exception from the source's next() comes
  // out as it is, the source put back the same way; a source that cannot be put back (its
  // restore() throws) leaves the trainer unusable, and a std::runtime_error says both. A step that
  // fails once it has started (a PipelineError, a transport error) leaves the trainer unusable:
  // step() and evaluate() then throw std::logic_error saying so. A diverged step (TrainingDiverged)
  // applied no update and puts the source back where the step began: the weights are those of
  // steps_done(), which may still be evaluated and saved, but the same step on them would diverge
  // again, so step() refuses (std::logic_error) until a checkpoint is restored into the trainer
  // (resume_at).
  StepStats step();

  // Mean loss per token over `batches` global batches drawn from `source` (held-out data),
  // each split into the config's micro-batches. Forward only: no backward, no update,
  // gradients and optimizer state untouched. Each rank of the pipeline runs the forward of
  // its stages, micro-batch by micro-batch, on a thread of its own (in one process) or in
  // its process (under MPI), passing activations to the next stage's rank over the
  // transport, so the stages overlap as a forward-only pipeline (no schedule is needed: a
  // forward pass has no backward to interleave). On the CPU the loss is bitwise the loss
  // that step() would report for the same batch. Replica 0's ranks evaluate; other
  // replicas' ranks do no work. A failure on one rank aborts the transport and is the error
  // that comes out.
  //
  // When the ranks are processes (MPI) this is a collective: every process calls it, at the
  // same point of the run, with the same batches. Each runs the stages it holds and passes
  // activations to the next stage's process over the transport; the last stage's process
  // adds the losses and one sum over all processes shares them, so every process returns
  // the same value, bit for bit the one a single process gives. A failure aborts the
  // transport, so every process ends with an error (comm::TransportError on the others).
  //
  // The batches are drawn and run at most `tokens_at_once` tokens at a time (at least one
  // batch), so that host memory for the ids does not grow with `batches`; the value is bit
  // for bit the same whatever it is. Between two such groups the executor's stop request
  // (PipelineExecutor::set_stop_request) is asked, on every process at the same point, and
  // when it asks on any, every process throws EvaluationStopped with the signal of the
  // lowest one asked: a long evaluation ends on a signal as a step does. The default keeps a
  // group to about the compute of five steps of 4096 tokens (a backward costs two forwards):
  // a group of 2^20 would run minutes to hours on the CPU for a model above the tiny preset
  // before a signal is heard, and more batches at once gain little once a group fills the
  // pipeline.
  //
  // `source` is not the trainer's own (Trainer::source(), std::invalid_argument): evaluating
  // on it would draw the next steps' batches, and the training would skip them.
  static constexpr int64_t kEvaluationTokensAtOnce = int64_t{1} << 16;
  double evaluate(TokenSource& source, int64_t batches = 1,
                  int64_t tokens_at_once = kEvaluationTokensAtOnce);
  // Both refuse batches whose every target is the ignored one, as step() does
  // (std::invalid_argument; the trainer stays usable): there is no loss to measure. A loss
  // that is not finite (weights an update ruined) throws TrainingDiverged, as a step does;
  // the trainer stays usable.
  //
  // The same over given micro-batches (any number, any sizes; under MPI the same on every
  // process).
  double evaluate(const std::vector<MicroBatchData>& microbatches);

  // The executor's stop request, agreed over the processes (a collective under MPI: every
  // process asks at the same point of the run, between steps): the signal of the lowest
  // process asked, or 0. evaluate() asks it between groups of batches, not after the last,
  // whose loss is then complete: a caller that stops on a signal whenever it came asks after.
  // Like step(), it refuses (std::logic_error) while a step() or evaluate() runs on another
  // thread, and on an unusable trainer.
  int agreed_stop_request();

  // While a step() or evaluate() runs (on another thread), the members below that read or
  // change what a step changes (the data source, the executor with its weights and buffers,
  // the failure, the step counter's reset, a save) throw std::logic_error instead; a
  // reference one of them returned before must not be used during a step either. What a
  // step never changes (config, model, device, stage ranges, rank devices) and steps_done()
  // may be read at any time, from any thread.

  // Steps run so far (or resumed at).
  int64_t steps_done() const { return steps_done_.load(); }
  // Empty while the trainer is usable; once a step or an evaluation has failed after it
  // started, what failed (step() and evaluate() then refuse with std::logic_error).
  const std::string& failure() const;
  // After restoring a checkpoint of `steps_done` steps: the next step() runs steps_done + 1,
  // even after a diverged step, whose weights the checkpoint's replaced.
  void resume_at(int64_t steps_done);
  // What a restore that failed part-way (some tensors the checkpoint's, some not) records:
  // step() and evaluate() then refuse, saying `what` ("marked unusable" when it is empty).
  void mark_unusable(std::string what);
  // A save on request (e.g. on a signal, between steps), by whatever the caller installed
  // (engine/train/trainer_checkpoint.h installs one); without a handler it does nothing.
  // Install the handlers before training starts: they are not guarded.
  void set_save_handler(std::function<void()> handler) { save_handler_ = std::move(handler); }
  // Called by the destructor before anything is freed: a TrainerCheckpointer waits there for
  // the background write that still reads the trainer, and forgets it.
  void set_destroy_handler(std::function<void()> handler) { destroy_handler_ = std::move(handler); }
  // Whether a destroy handler is installed: a TrainerCheckpointer refuses a trainer that has
  // one, since replacing it would leave the first checkpointer unwarned of the trainer's end.
  bool has_destroy_handler() const { return static_cast<bool>(destroy_handler_); }
  void save_now();
  const TrainConfig& config() const { return config_; }
  const ModelDescription& model() const { return model_; }
  Device device() const { return device_; }
  TokenSource& source();
  const TokenSource& source() const;
  PipelineExecutor& executor();
  const std::vector<StageRange>& stage_ranges() const { return ranges_; }
  const std::vector<Device>& rank_devices() const { return devices_; }

 private:
  void build();  // everything after the model, config and source are set
  std::vector<MicroBatchData> draw_batch(TokenSource& source) const;
  // This process's sum of the token losses of `microbatches`, added after `start` in
  // micro-batch order on the process that holds the last stage (0.0 on the others); the ids
  // checked first, and a failure of the forward recorded in failure_.
  double local_loss_sum(const std::vector<MicroBatchData>& microbatches, double start);
  double forward_loss_sum(const std::vector<MicroBatchData>& microbatches, double start);
  // Throws std::logic_error, saying what failed, once a step or an evaluation has failed.
  void check_usable(const char* action) const;
  // Moves the training source back to where step `step` began, after `why` stopped it. When
  // the source cannot go back, the trainer becomes unusable (the next steps would read other
  // tokens) and std::runtime_error says both.
  void put_back_source(uint64_t position, std::optional<int32_t> token, int64_t step,
                       const std::string& why);
  // The mean of an evaluation's `loss_sum` over `tokens`; TrainingDiverged when not finite.
  double evaluated_mean(double loss_sum, int64_t tokens) const;
  // agreed_stop_request's collective, for evaluate(), which holds the trainer.
  int stop_request_over_processes();
  // Throws std::logic_error naming `member` while a step() or evaluate() runs.
  void check_not_busy(const char* member) const;
  // What draw_batch fills the ids with before the source writes them.
  static constexpr int32_t kUnwrittenId = std::numeric_limits<int32_t>::min();
  // Token ids [0, end) that a batch may hold; `what` names where the bound comes from.
  struct AcceptedIds {
    int64_t end = 0;
    std::string what;
  };
  // token_ids_ and target_ids_: the model's vocab, or without one what its first and last
  // units accept (Layer::accepted_ids), when they say.
  void set_accepted_ids();
  // Throws std::invalid_argument when `source` draws ids past those ranges; `label` names it.
  void check_source_vocab(const TokenSource& source, const std::string& label) const;
  // Throws std::invalid_argument for an id outside the accepted ranges (a target may be the
  // ignored one) or left unwritten by the source, naming the micro-batch and position.
  void check_token_ids(const std::vector<MicroBatchData>& microbatches) const;
  // Whether some target of `microbatches` is not the ignored one.
  static bool has_target(const std::vector<MicroBatchData>& microbatches);
  // Throws std::invalid_argument when every target of the step's batch is the ignored one.
  void check_some_target(const std::vector<MicroBatchData>& microbatches, int64_t step) const;
  // Throws std::invalid_argument: every target of `what` (the batches evaluated) is ignored;
  // `check` names what the user should look at.
  [[noreturn]] static void refuse_evaluation_without_target(const std::string& what,
                                                            const char* check);

  ModelDescription model_;
  TrainConfig config_;
  Device device_;
  std::shared_ptr<TokenSource> source_;
  std::optional<AcceptedIds> token_ids_, target_ids_;  // unchecked when empty
  std::vector<StageRange> ranges_;
  std::vector<Device> devices_;
  std::unique_ptr<PipelineExecutor> executor_;
  std::atomic<int64_t> steps_done_{0};
  std::function<void()> save_handler_;
  std::function<void()> destroy_handler_;
  std::atomic<bool> busy_{false};  // a step() or evaluate() is running
  // What failed in a step or an evaluation, which leaves the executor with micro-batches in
  // flight and its transports aborted; empty while the trainer is usable.
  std::string failure_;
  // The step that diverged and how, until a resume_at(): step() refuses to run it again.
  std::string diverged_;
};

}  // namespace conveyor
