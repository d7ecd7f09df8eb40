// Forward-only evaluation: the loss a training step reports for a batch, bit for bit on the
// CPU, for one stage and for pipelines; and nothing of the training state moves.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "comm/transport.h"
#include "engine/train/trainer.h"

namespace conveyor {
namespace {

TrainConfig eval_run(int stages, schedule::ScheduleKind kind) {
  TrainConfig c;
  c.model = model_preset("tiny");
  c.model.d_model = 24;
  c.model.hidden = 40;
  c.model.vocab = 16;
  c.model.n_layers = 3;
  c.steps = 10;
  c.batch_tokens = 192;
  c.microbatches = 4;
  c.optimizer.lr = 1e-2;
  c.optimizer.warmup_steps = 0;
  c.stages = stages;
  c.schedule = kind;
  c.device = Device::cpu();
  return c;
}

// The trainer's own source, from the start: the batches its steps will draw.
MarkovSource same_source(const TrainConfig& c) { return MarkovSource(c.model.vocab, c.seed); }

TEST(Evaluate, GivesTheTrainingStepsLossBitwise) {
  for (const auto& [stages, kind] :
       {std::pair{1, schedule::ScheduleKind::k1F1B}, std::pair{2, schedule::ScheduleKind::k1F1B},
        std::pair{2, schedule::ScheduleKind::kZBH1}, std::pair{4, schedule::ScheduleKind::kGPipe},
        std::pair{2, schedule::ScheduleKind::kInterleaved}}) {
    SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) +
                 " stages=" + std::to_string(stages));
    TrainConfig c = eval_run(stages, kind);
    if (kind == schedule::ScheduleKind::kInterleaved) c.chunks = 2, c.model.n_layers = 4;
    Trainer trainer(c);
    MarkovSource ahead = same_source(c);
    for (int s = 0; s < 3; ++s) {
      const double evaluated = trainer.evaluate(ahead, 1);
      EXPECT_EQ(evaluated, trainer.step().loss) << "step " << s + 1;
    }
  }
}

// Held-out data after some training: every pipeline layout gives the one-stage value bit for
// bit, whatever its schedule. Data-parallel training sums the replicas' gradients in another
// order than one replica does, so a --dp 2 pipeline is held to the one-stage --dp 2 run.
TEST(Evaluate, EveryLayoutGivesTheOneStageValueBitwise) {
  struct Layout {
    int stages, chunks, dp;
    schedule::ScheduleKind kind;
  };
  auto run = [](const Layout& l) {
    TrainConfig c = eval_run(l.stages, l.kind);
    c.model.n_layers = 4;
    c.chunks = l.chunks;
    c.data_parallel = l.dp;
    Trainer trainer(c);
    for (int s = 0; s < 2; ++s) trainer.step();
    MarkovSource held_out(c.model.vocab, c.seed + 7);
    return trainer.evaluate(held_out, 2);
  };
  for (const int dp : {1, 2}) {
    const double one_stage = run({1, 1, dp, schedule::ScheduleKind::k1F1B});
    EXPECT_GT(one_stage, 0.0);
    for (const Layout& l : {Layout{2, 1, dp, schedule::ScheduleKind::k1F1B},
                            Layout{4, 1, dp, schedule::ScheduleKind::kGPipe},
                            Layout{2, 1, dp, schedule::ScheduleKind::kZBH1},
                            Layout{2, 2, dp, schedule::ScheduleKind::kInterleaved}}) {
      SCOPED_TRACE(std::string(schedule::schedule_kind_name(l.kind)) +
                   " stages=" + std::to_string(l.stages) + " chunks=" + std::to_string(l.chunks) +
                   " dp=" + std::to_string(l.dp));
      EXPECT_EQ(run(l), one_stage);
    }
  }
}

// Before any step every replica holds the same initial weights, so --dp changes nothing.
TEST(Evaluate, DataParallelReplicasGiveTheSingleReplicaValueBeforeTraining) {
  double values[2] = {0.0, 0.0};
  for (const int dp : {1, 2}) {
    TrainConfig c = eval_run(2, schedule::ScheduleKind::k1F1B);
    c.data_parallel = dp;
    Trainer trainer(c);
    MarkovSource held_out(c.model.vocab, c.seed + 7);
    values[dp - 1] = trainer.evaluate(held_out, 2);
  }
  EXPECT_GT(values[0], 0.0);
  EXPECT_EQ(values[1], values[0]);
}

TEST(Evaluate, SeveralBatchesAreTheMeanOfTheirLosses) {
  TrainConfig c = eval_run(2, schedule::ScheduleKind::k1F1B);
  Trainer trainer(c);
  MarkovSource all = same_source(c), each = same_source(c);
  const double mean = trainer.evaluate(all, 3);
  double sum = 0.0;
  for (int b = 0; b < 3; ++b) sum += trainer.evaluate(each, 1);
  EXPECT_NEAR(mean, sum / 3.0, 1e-12 * sum);
  EXPECT_EQ(all.position(), 3u * 192u);
}

// Held-out batches are drawn and run a few at a time, so that memory does not grow with
// their number; the value is bit for bit the one of all of them at once, in one process and
// in a pipeline, and the source ends at the same position.
TEST(Evaluate, BatchesRunAFewAtATimeGiveTheValueOfAllAtOnce) {
  for (const int stages : {1, 2}) {
    SCOPED_TRACE("stages=" + std::to_string(stages));
    TrainConfig c = eval_run(stages, schedule::ScheduleKind::k1F1B);
    Trainer trainer(c);
    trainer.step();
    MarkovSource whole(c.model.vocab, c.seed + 7), grouped(c.model.vocab, c.seed + 7);
    const double at_once = trainer.evaluate(whole, 7);
    // Two batches at a time (2 x 192 tokens), the last group one batch.
    const double two_by_two = trainer.evaluate(grouped, 7, 2 * 192 + 100);
    EXPECT_GT(at_once, 0.0);
    EXPECT_EQ(two_by_two, at_once);
    EXPECT_EQ(grouped.position(), whole.position());
    // Fewer tokens at once than one batch still runs one batch at a time.
    MarkovSource single(c.model.vocab, c.seed + 7);
    EXPECT_EQ(trainer.evaluate(single, 7, 1), at_once);
  }
}

// The executor's stop request, asked between groups of batches, ends an evaluation with its
// signal; asked for nothing, it changes nothing.
TEST(Evaluate, AStopRequestEndsItBetweenGroupsOfBatches) {
  TrainConfig c = eval_run(2, schedule::ScheduleKind::k1F1B);
  Trainer trainer(c);
  MarkovSource plain(c.model.vocab, c.seed + 7), asked(c.model.vocab, c.seed + 7),
      stopped(c.model.vocab, c.seed + 7);
  const double value = trainer.evaluate(plain, 6, 2 * 192);
  int asks = 0;
  trainer.executor().set_stop_request([&] { return ++asks, 0; });
  EXPECT_EQ(trainer.evaluate(asked, 6, 2 * 192), value);
  EXPECT_EQ(asks, 2);  // after the first and the second pair, not after the last
  trainer.executor().set_stop_request([] { return 15; });
  try {
    trainer.evaluate(stopped, 6, 2 * 192);
    ADD_FAILURE() << "the evaluation was not stopped";
  } catch (const EvaluationStopped& e) {
    EXPECT_EQ(e.signal(), 15);
  }
  EXPECT_EQ(stopped.position(), 2u * 192u);  // one pair of batches drawn, then stopped
}

// By default a stop request is asked after at most 2^16 tokens of batches: a signal during a
// long evaluation waits for a few steps' compute, not for 2^20 tokens (85 steps of 4096).
TEST(Evaluate, ADefaultEvaluationAsksForAStopAfterAtMost65536Tokens) {
  TrainConfig c = eval_run(1, schedule::ScheduleKind::k1F1B);
  Trainer trainer(c);
  trainer.executor().set_stop_request([] { return 2; });
  MarkovSource stopped(c.model.vocab, c.seed + 7);
  const int64_t batches = (int64_t{1} << 20) / c.batch_tokens;
  EXPECT_THROW(trainer.evaluate(stopped, batches), EvaluationStopped);
  EXPECT_LE(stopped.position(), uint64_t{1} << 16);
  EXPECT_GT(stopped.position(), (uint64_t{1} << 16) - c.batch_tokens);
}

struct Snapshot {
  std::vector<std::vector<float>> values, grads, state;
  std::vector<int64_t> steps_taken;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(Trainer& trainer) {
  Snapshot s;
  for (Parameter* p : trainer.executor().parameters()) {
    s.values.push_back(to_vector_f32(p->value));
    s.grads.push_back(to_vector_f32(p->grad));
  }
  for (int r = 0; r < trainer.executor().num_ranks(); ++r) {
    Optimizer& opt = trainer.executor().optimizer(r);
    for (const Tensor& t : opt.state()) s.state.push_back(to_vector_f32(t));
    s.steps_taken.push_back(opt.steps_taken());
  }
  return s;
}

TEST(Evaluate, LeavesWeightsGradientsAndOptimizerStateAlone) {
  const TrainConfig c = eval_run(2, schedule::ScheduleKind::k1F1B);
  Trainer evaluated(c), plain(c);
  evaluated.step();
  plain.step();
  const Snapshot before = snapshot(evaluated);
  ASSERT_FALSE(before.state.empty());
  MarkovSource held_out(c.model.vocab, c.seed + 100);
  const double loss = evaluated.evaluate(held_out, 2);
  EXPECT_GT(loss, 0.0);
  EXPECT_TRUE(snapshot(evaluated) == before);
  EXPECT_EQ(evaluated.source().position(), plain.source().position());
  // Training goes on exactly as if no evaluation had happened.
  for (int s = 0; s < 2; ++s) EXPECT_EQ(evaluated.step().loss, plain.step().loss);
  EXPECT_TRUE(snapshot(evaluated) == snapshot(plain));
}

TEST(Evaluate, BadRequestsAreClearErrors) {
  Trainer trainer(eval_run(1, schedule::ScheduleKind::k1F1B));
  MarkovSource source(16, 1), wide(64, 1);
  EXPECT_THROW(trainer.evaluate(source, 0), std::invalid_argument);
  EXPECT_THROW(trainer.evaluate(wide, 1), std::invalid_argument);
  // The mean divides by batches x batch_tokens: 2^62 batches of 192 tokens wrapped it. Without
  // the bound they would run until the stop request ends them after the first group.
  trainer.executor().set_stop_request([] { return 15; });
  try {
    trainer.evaluate(source, int64_t{1} << 62);
    ADD_FAILURE() << "2^62 batches were taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "Trainer::evaluate's batches must be from 1 to 48038396025285290 (batches x "
              "TrainConfig::batch_tokens 192 must fit an int64_t), got 4611686018427387904");
  }
  EXPECT_EQ(source.position(), 0u);
  trainer.executor().set_stop_request(nullptr);
  // The training source itself: its next batches would be evaluated and then skipped.
  trainer.step();
  const uint64_t training_position = trainer.source().position();
  try {
    trainer.evaluate(trainer.source(), 1);
    ADD_FAILURE() << "the training source was evaluated";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "Trainer::evaluate was given the trainer's own training source "
              "(Trainer::source()), whose next batches the steps would then skip; give a source "
              "of held-out data (make_held_out_source for the built-in ones)");
  }
  EXPECT_EQ(trainer.source().position(), training_position);
  EXPECT_THROW(trainer.evaluate(std::vector<MicroBatchData>{}), std::invalid_argument);
  MicroBatchData uneven;
  uneven.tokens = {1, 2, 3};
  uneven.targets = {2, 3};
  EXPECT_THROW(trainer.evaluate({uneven}), std::invalid_argument);
}

// The ranks of one process evaluate on threads of their own: a failure on one (here a token
// id past the vocabulary, in the first stage's embedding) ends the others' waits, and the
// error that comes out is that failure, not the aborts it caused.
TEST(Evaluate, AFailingStageEndsTheOthersWithItsOwnError) {
  for (const int stages : {2, 4}) {
    SCOPED_TRACE("stages=" + std::to_string(stages));
    TrainConfig c = eval_run(stages, schedule::ScheduleKind::k1F1B);
    c.model.n_layers = 4;
    c.transport_timeout = std::chrono::milliseconds(20000);
    Trainer trainer(c);
    MicroBatchData good, bad;
    good.tokens = {1, 2, 3, 4};
    good.targets = {2, 3, 4, 5};
    bad.tokens = {1, 2, 99, 4};
    bad.targets = {2, 3, 4, 5};
    const auto start = std::chrono::steady_clock::now();
    try {
      trainer.evaluate({good, bad, good});
      ADD_FAILURE() << "an id past the vocabulary was evaluated";
    } catch (const comm::TransportAborted& e) {
      ADD_FAILURE() << "the abort came out, not its cause: " << e.what();
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find("99"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  }
}

}  // namespace
}  // namespace conveyor
