// What a program that links the trainer may get wrong, and the one clear error it gets for
// each: a step past the run, a batch with nothing to learn from or that the source failed to
// give whole, two calls at once, a trainer destroyed under its checkpointer, a device or
// thread count that cannot be, a data source that cannot go back to a checkpoint's position.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint_fixture.h"
#include "engine/train/trainer.h"
#include "engine/train/trainer_checkpoint.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"

namespace conveyor {
namespace {

using testing::TempDir;

// Token t+1 = (token t + 1) mod vocab; `target` overrides every target when set, and
// `on_next` runs before each draw (what a misbehaving program does there).
class CountingSource : public TokenSource {
 public:
  int64_t vocab() const override { return 16; }
  void next(int32_t* inputs, int32_t* targets, int64_t n) override {
    if (on_next) on_next();
    if (writes) n = std::min(n, *writes);
    for (int64_t i = 0; i < n; ++i, ++position_) {
      inputs[i] = static_cast<int32_t>(position_ % 16);
      targets[i] = target.value_or(static_cast<int32_t>((position_ + 1) % 16));
    }
  }
  uint64_t position() const override { return position_; }
  void seek(uint64_t position) override {
    if (refuse_seek) throw std::runtime_error("this source cannot seek");
    position_ = position;
  }
  std::string describe() const override { return "counting"; }

  std::optional<int32_t> target;
  std::function<void()> on_next;
  std::optional<int64_t> writes;  // writes at most this many pairs of a draw (it ran out)
  bool refuse_seek = false;

 private:
  uint64_t position_ = 0;
};

TrainConfig small_run(int64_t steps = 4) {
  TrainConfig c;
  c.model = model_preset("tiny");
  c.model.d_model = 16;
  c.model.hidden = 32;
  c.model.vocab = 16;
  c.steps = steps;
  c.batch_tokens = 64;
  c.microbatches = 2;
  c.device = Device::cpu();
  return c;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(nothing thrown)";
}

#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

TEST(TrainerMisuse, AStepPastTheRunIsRefused) {
  Trainer trainer(small_run(2), std::make_shared<CountingSource>());
  trainer.step();
  trainer.step();
  EXPECT_THROW(trainer.step(), std::logic_error);
  EXPECT_CONTAINS(message_of([&] { trainer.step(); }), "has run all 2 steps of its run");
  EXPECT_EQ(trainer.steps_done(), 2);
}

TEST(TrainerMisuse, MarkedUnusableWithoutAReasonIsUnusableStill) {
  Trainer trainer(small_run(), std::make_shared<CountingSource>());
  trainer.mark_unusable("");
  EXPECT_EQ(trainer.failure(), "marked unusable");
  EXPECT_THROW(trainer.step(), std::logic_error);
  EXPECT_CONTAINS(message_of([&] { trainer.step(); }), "cannot run a step: marked unusable");
  EXPECT_EQ(trainer.steps_done(), 0);
}

TEST(TrainerMisuse, ABatchWhoseEveryTargetIsIgnoredIsRefusedAndChangesNothing) {
  auto source = std::make_shared<CountingSource>();
  source->target = MicroBatchInputs().ignore_index;
  Trainer trainer(small_run(), source);
  EXPECT_CONTAINS(message_of([&] { trainer.step(); }),
                  "every target of step 1's batch is the ignored target -1");
  EXPECT_EQ(trainer.steps_done(), 0);
  EXPECT_TRUE(trainer.failure().empty());
  EXPECT_EQ(source->position(), 0u);  // the refused batch was put back
  // Usable still: a batch with targets trains.
  source->target.reset();
  EXPECT_NO_THROW(trainer.step());
}

TEST(TrainerMisuse, AnEvaluationWhoseEveryTargetIsIgnoredIsRefusedAsAStepIs) {
  Trainer trainer(small_run(), std::make_shared<CountingSource>());
  CountingSource held_out;
  held_out.target = MicroBatchInputs().ignore_index;
  EXPECT_EQ(message_of([&] { trainer.evaluate(held_out, 3); }),
            "every target of the evaluation's 3 batches is the ignored target -1: an evaluation "
            "has nothing to measure (its loss would read 0); check the evaluation source");
  // Drawn a group at a time, the last group is refused too when no group had a target.
  EXPECT_CONTAINS(message_of([&] { trainer.evaluate(held_out, 2, 1); }),
                  "every target of the evaluation's 2 batches is the ignored target -1");
  std::vector<MicroBatchData> batch(2);
  batch[0].tokens = {1, 2};
  batch[0].targets = {-1, -1};
  batch[1].tokens = {3};
  batch[1].targets = {-1};
  EXPECT_EQ(message_of([&] { trainer.evaluate(batch); }),
            "every target of the 2 micro-batches evaluated is the ignored target -1: an "
            "evaluation has nothing to measure (its loss would read 0); check the batches");
  EXPECT_TRUE(trainer.failure().empty());
  // One target is enough, and the trainer is usable still.
  batch[1].targets = {4};
  EXPECT_TRUE(std::isfinite(trainer.evaluate(batch)));
  EXPECT_NO_THROW(trainer.step());
}

TEST(TrainerMisuse, ASourceThatFailsPartWayThroughABatchIsPutBackWhereTheStepBegan) {
  auto source = std::make_shared<CountingSource>();
  int draws = 0;
  // The first micro-batch is given, the second fails (a file that could not be read, say).
  source->on_next = [&] {
    if (++draws == 2) throw std::runtime_error("the data could not be read");
  };
  Trainer trainer(small_run(), source);
  EXPECT_EQ(message_of([&] { trainer.step(); }), "the data could not be read");
  EXPECT_EQ(trainer.steps_done(), 0);
  EXPECT_TRUE(trainer.failure().empty());
  EXPECT_EQ(source->position(), 0u);
  // Tried again, the step trains on the batch an untroubled run's first step has.
  source->on_next = nullptr;
  Trainer untroubled(small_run(), std::make_shared<CountingSource>());
  EXPECT_EQ(trainer.step().loss, untroubled.step().loss);
}

TEST(TrainerMisuse, IdsTheSourceLeftUnwrittenAreRefusedNotTrainedOn) {
  auto source = std::make_shared<CountingSource>();
  source->writes = 20;  // of the 32 pairs of each micro-batch
  Trainer trainer(small_run(), source);
  EXPECT_EQ(message_of([&] { trainer.step(); }),
            "the token id at position 20 of micro-batch 0 was not written by the data source; "
            "TokenSource::next must write all the pairs it is asked for (one that has run out "
            "throws)");
  EXPECT_EQ(trainer.steps_done(), 0);
  EXPECT_TRUE(trainer.failure().empty());
  EXPECT_EQ(source->position(), 0u);
}

TEST(TrainerMisuse, AStepCalledWhileAnEvaluationRunsIsRefused) {
  Trainer trainer(small_run(), std::make_shared<CountingSource>());
  CountingSource held_out;
  std::string inner;
  // The evaluation draws its batch inside evaluate(), where this source calls step(): the
  // same as a step on another thread during the evaluation, but always at this point.
  held_out.on_next = [&] { inner = message_of([&] { trainer.step(); }); };
  EXPECT_NO_THROW(trainer.evaluate(held_out, 1));
  EXPECT_CONTAINS(inner, "another step() or evaluate() of it is running");
  EXPECT_EQ(trainer.steps_done(), 0);
  // Once the evaluation is over, steps run.
  held_out.on_next = nullptr;
  EXPECT_NO_THROW(trainer.step());
}

// The stop request's collective is one more exchange: asked while a step runs, it would meet
// the step's own on the transport.
TEST(TrainerMisuse, TheAgreedStopRequestIsRefusedWhileAStepRunsAndAnsweredBetween) {
  auto source = std::make_shared<CountingSource>();
  Trainer trainer(small_run(), source);
  std::string inner;
  source->on_next = [&] {
    if (inner.empty()) inner = message_of([&] { trainer.agreed_stop_request(); });
  };
  EXPECT_NO_THROW(trainer.step());
  EXPECT_CONTAINS(inner,
                  "the trainer cannot ask for the agreed stop request: another step() or "
                  "evaluate() of it is running");
  source->on_next = nullptr;
  EXPECT_EQ(trainer.agreed_stop_request(), 0);
  trainer.executor().set_stop_request([] { return 15; });
  EXPECT_EQ(trainer.agreed_stop_request(), 15);
  trainer.mark_unusable("gone");
  EXPECT_CONTAINS(message_of([&] { trainer.agreed_stop_request(); }),
                  "cannot ask for the agreed stop request: gone");
}

TEST(TrainerMisuse, WhatAStepChangesIsRefusedWhileItRuns) {
  auto source = std::make_shared<CountingSource>();
  Trainer trainer(small_run(), source);
  bool saved = false;
  trainer.set_save_handler([&] { saved = true; });
  std::vector<std::string> during;
  // The step draws its batch inside step(), where this source calls the trainer: the same as
  // a call from another thread during the step, but always at this point.
  source->on_next = [&] {
    if (!during.empty()) return;  // once, at the first micro-batch's draw
    const Trainer& seen = trainer;
    for (const auto& call : std::vector<std::function<void()>>{
             [&] { trainer.executor(); }, [&] { trainer.source(); }, [&] { seen.source(); },
             [&] { seen.failure(); }, [&] { trainer.resume_at(0); },
             [&] { trainer.mark_unusable("no"); }, [&] { trainer.save_now(); }})
      during.push_back(message_of(call));
    // What a step never changes stays readable.
    EXPECT_EQ(seen.config().steps, 4);
    EXPECT_EQ(seen.steps_done(), 0);
    EXPECT_EQ(seen.stage_ranges().size(), 1u);
  };
  EXPECT_NO_THROW(trainer.step());
  const char* members[] = {"executor()",  "source()",        "source()",  "failure()",
                           "resume_at()", "mark_unusable()", "save_now()"};
  ASSERT_EQ(during.size(), std::size(members));
  for (size_t i = 0; i < during.size(); ++i)
    EXPECT_CONTAINS(during[i], std::string("Trainer::") + members[i] +
                                   " cannot be called while a step() or evaluate() of the "
                                   "trainer runs");
  // Nothing the refused calls asked for happened; between steps they all work.
  source->on_next = nullptr;
  EXPECT_FALSE(saved);
  EXPECT_EQ(trainer.steps_done(), 1);
  EXPECT_TRUE(trainer.failure().empty());
  EXPECT_NO_THROW(trainer.executor());
  trainer.save_now();
  EXPECT_TRUE(saved);
  EXPECT_NO_THROW(trainer.step());
}

TEST(TrainerMisuse, LibraryErrorsNameTheApisSettingsNotCommandLineFlags) {
  TrainConfig c = small_run();
  c.stages = 2;
  c.chunks = 2;
  c.schedule = schedule::ScheduleKind::kInterleaved;
  c.model.n_layers = 1;  // 3 units for 4 stages
  const std::string message = message_of([&] { Trainer t(c, std::make_shared<CountingSource>()); });
  EXPECT_CONTAINS(message, "use fewer ranks (TrainConfig::stages) or chunks (TrainConfig::chunks)");
  EXPECT_EQ(message.find("--"), std::string::npos) << message;
}

TEST(TrainerMisuse, ATrainerDestroyedBeforeItsCheckpointerWaitsForTheBackgroundWrite) {
  TempDir dir;
  auto trainer = std::make_unique<Trainer>(small_run(), std::make_shared<CountingSource>());
  TrainerCheckpointOptions options{dir.path()};
  options.async = true;
  TrainerCheckpointer checkpointer(*trainer, options);
  trainer->step();
  checkpointer.save();
  trainer.reset();  // the background write may still be going on
  EXPECT_CONTAINS(message_of([&] { checkpointer.finish(); }), "its trainer was destroyed");
  // The write it waited for was committed, and the checkpointer says so.
  EXPECT_EQ(open_checkpoint(dir.path()).step(), 1);
  EXPECT_EQ(checkpointer.last_saved_step(), 1);
}

// A second checkpointer replaced the first one's handlers: the trainer's end then reached
// the second (or, once it was gone, nobody), and the first read the freed trainer.
TEST(TrainerMisuse, ASecondCheckpointerOfOneTrainerIsRefused) {
  TempDir dir;
  auto trainer = std::make_unique<Trainer>(small_run(), std::make_shared<CountingSource>());
  TrainerCheckpointer first(*trainer, {dir.path() / "first"});
  EXPECT_EQ(message_of([&] { TrainerCheckpointer second(*trainer, {dir.path() / "second"}); }),
            "the trainer already has a TrainerCheckpointer (or a handler of its own, "
            "Trainer::set_destroy_handler); a trainer saves through one checkpointer at a time: "
            "destroy the other one first");
  trainer->step();
  trainer.reset();  // the first checkpointer still hears of it
  EXPECT_CONTAINS(message_of([&] { first.save(); }), "its trainer was destroyed");
  // One after the other, as a program that saves into two folders in turn does.
  Trainer next(small_run(), std::make_shared<CountingSource>());
  next.step();
  {
    TrainerCheckpointer a(next, {dir.path() / "a"});
    a.finish();
  }
  TrainerCheckpointer b(next, {dir.path() / "b"});
  b.finish();
  EXPECT_EQ(open_checkpoint(dir.path() / "b").step(), 1);
}

// Non-finite values on the first step come before any update: the model's doing, which the
// learning rate or clipping cannot change.
TEST(TrainerMisuse, AFirstStepThatIsNotFiniteBlamesTheModelNotTheLearningRate) {
  class NanGradient : public Layer {
   public:
    const std::string& name() const override { return name_; }
    std::vector<Parameter*> parameters() override { return {}; }
    Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs&,
                   SavedTensors&) override {
      Tensor y = ctx.zeros(x.shape());
      ops::add_(ctx, y, x);
      return y;
    }
    Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors&) override {
      Tensor dx = ctx.empty(dy.shape());
      ops::fill(ctx, dx, std::nanf(""));
      return dx;
    }
    void backward_weight(DeviceContext&, SavedTensors&) override {}

   private:
    std::string name_ = "nan";
  };
  ModelDescription model;
  model.name = "nan gradient";
  model.num_units = 3;
  model.vocab = 16;
  model.make_unit = [](int64_t i) -> std::unique_ptr<Layer> {
    if (i == 0) return std::make_unique<Embedding>("embed", 16, 8);
    if (i == 1) return std::make_unique<NanGradient>();
    return std::make_unique<LossHead>("head", 8, 16);
  };
  model.activation = activation_rows(8);
  Trainer trainer(model, small_run(), std::make_shared<CountingSource>());
  const std::string message = message_of([&] { trainer.step(); });
  EXPECT_CONTAINS(message,
                  "at step 1, before any update, so not through the learning rate or clipping: a "
                  "unit's forward or backward gives non-finite values on the weights the run "
                  "starts from");
  EXPECT_EQ(message.find("lower the learning rate"), std::string::npos) << message;
}

// A source that fails part-way through a batch and cannot seek back stands past tokens the
// step never trained on: the seek's error came out alone, and the next step trained on from
// there.
TEST(TrainerMisuse, ASourceThatCannotBePutBackLeavesTheTrainerUnusable) {
  auto source = std::make_shared<CountingSource>();
  Trainer trainer(small_run(), source);
  trainer.step();
  int draws = 0;
  source->on_next = [&] {
    if (++draws == 2) throw std::runtime_error("the stream broke");
  };
  source->refuse_seek = true;
  EXPECT_EQ(message_of([&] { trainer.step(); }),
            "step 2 stopped (the stream broke) and its data source could not be put back where "
            "the step began (this source cannot seek): the steps after it would read other "
            "tokens than their own; build a new Trainer (from the last checkpoint to go on)");
  source->on_next = nullptr;
  source->refuse_seek = false;
  EXPECT_EQ(message_of([&] { trainer.step(); }),
            "the trainer cannot run a step: step 2's data source could not be put back where the "
            "step began (this source cannot seek); build a new Trainer (from the last "
            "checkpoint to go on)");
  EXPECT_EQ(trainer.steps_done(), 1);
}

TEST(TrainerMisuse, CheckpointOptionsThatCannotBeAreRefusedNamingTheField) {
  Trainer trainer(small_run(), std::make_shared<CountingSource>());
  TempDir dir;
  EXPECT_EQ(message_of([&] { TrainerCheckpointer c(trainer, {}); }),
            "TrainerCheckpointOptions::directory is empty; give the folder to save checkpoints "
            "into");
  EXPECT_CONTAINS(
      message_of([&] { TrainerCheckpointer c(trainer, {.directory = dir.path(), .every = -1}); }),
      "TrainerCheckpointOptions::every must be at least 0 (0: save on request and "
      "at the end), got -1");
  EXPECT_CONTAINS(message_of([&] {
                    TrainerCheckpointer c(trainer, {.directory = dir.path(), .keep_last = -2});
                  }),
                  "TrainerCheckpointOptions::keep_last must be at least 0 (0: keep every "
                  "checkpoint), got -2");
  // A policy cast from outside the enum went on past a failed save as kContinue does.
  EXPECT_EQ(message_of([&] {
              TrainerCheckpointer c(
                  trainer, {.directory = dir.path(), .on_error = static_cast<SaveErrorPolicy>(7)});
            }),
            "TrainerCheckpointOptions::on_error must be SaveErrorPolicy::kStop or kContinue, got "
            "the value 7");
}

TEST(TrainerMisuse, ACpuDeviceOtherThanIndexZeroIsRefused) {
  TrainConfig c = small_run();
  c.device = Device{DeviceKind::kCpu, 7};
  EXPECT_CONTAINS(message_of([&] { Trainer t(c, std::make_shared<CountingSource>()); }),
                  "the CPU is device index 0, got index 7");
}

TEST(TrainerMisuse, ASourceOfNoVocabularyIsRefused) {
  class Silent : public CountingSource {
   public:
    int64_t vocab() const override { return 0; }
  };
  EXPECT_CONTAINS(message_of([&] { Trainer t(small_run(), std::make_shared<Silent>()); }),
                  "says its vocab() is 0");
}

TEST(TrainerMisuse, AnSgdMomentumOutsideZeroToOneIsRefused) {
  TrainConfig c = small_run();
  c.optimizer.kind = "sgd";
  c.optimizer.momentum = std::nan("");
  EXPECT_CONTAINS(message_of([&] { c.validate(); }), "momentum must be in [0, 1)");
  c.optimizer.momentum = 1.0;
  EXPECT_THROW(c.validate(), std::invalid_argument);
}

TEST(TrainerMisuse, AStageOrShardThatIsNotThereIsNamed) {
  TempDir dir;
  Trainer trainer(small_run(), std::make_shared<CountingSource>());
  EXPECT_CONTAINS(message_of([&] { trainer.executor().stage(9); }),
                  "stage 9 is not one of the pipeline's 1 stages");
  TrainerCheckpointer checkpointer(trainer, {dir.path()});
  trainer.step();
  checkpointer.save();
  EXPECT_CONTAINS(message_of([&] { open_checkpoint(dir.path()).shard(5); }),
                  "has 1 shard(s), none of rank 5");
}

TEST(TrainerMisuse, MoreCpuThreadsThanTheCapAreRefused) {
  TrainConfig c = small_run();
  c.cpu_threads = TrainConfig::kMaxCpuThreads + 1;
  EXPECT_THROW(c.validate(), std::invalid_argument);
  c.cpu_threads = TrainConfig::kMaxCpuThreads;
  EXPECT_NO_THROW(c.validate());
}

TEST(TrainerMisuse, ASourceThatCannotGoToTheCheckpointsPositionLeavesTheTrainerUntouched) {
  TempDir dir;
  {
    Trainer first(small_run(), std::make_shared<CountingSource>());
    TrainerCheckpointer checkpointer(first, {dir.path()});
    first.step();
    first.step();
    checkpointer.save();
  }
  auto source = std::make_shared<CountingSource>();
  source->refuse_seek = true;
  Trainer second(small_run(), source);
  const Parameter* first_parameter = second.executor().parameters().front();
  const std::vector<float> before = to_vector_f32(first_parameter->value);
  EXPECT_CONTAINS(message_of([&] { resume_trainer(second, dir.path()); }),
                  "this source cannot seek");
  EXPECT_EQ(second.steps_done(), 0);
  EXPECT_EQ(to_vector_f32(first_parameter->value), before);
  EXPECT_TRUE(second.failure().empty());
}

}  // namespace
}  // namespace conveyor
