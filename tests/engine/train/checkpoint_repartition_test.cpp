// Re-partitioning: a checkpoint of one stage layout loads into another (any stage count,
// AdamW or SGD state under its own names) and training goes on bitwise; the model's
// fingerprint tells models apart.
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

#include "engine/schedule/generators.h"
#include "engine/train/checkpoint_model.h"
#include "support/executor_fixture.h"
#include "tests/engine/train/checkpoint_fixture.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

// Training state of a whole pipeline, saved from one stage layout and loaded into others.
class CheckpointRepartition : public ::testing::Test {
 protected:
  static constexpr int kMicrobatches = 4;
  static constexpr int kTokens = 5;

  static void train_step(PipelineExecutor& ex, int step) {
    ex.run_step(make_microbatches(kMicrobatches, kTokens, step), 1.0f / (kMicrobatches * kTokens),
                step, 1e-2);
  }
  static fs::path save(PipelineExecutor& ex, const fs::path& dir, int64_t step,
                       const std::vector<StageRange>& ranges) {
    CheckpointWriter writer(dir, step, ex.num_ranks());
    std::vector<std::thread> threads;
    for (int r = 0; r < ex.num_ranks(); ++r)
      threads.emplace_back([&, r] { writer.write_shard(r, rank_checkpoint_tensors(ex, r)); });
    for (auto& t : threads) t.join();
    TrainingState state;
    state.step = step;
    state.model = describe_model(test_model());
    state.model_fingerprint = model_fingerprint(state.model);
    state.stages = stage_placements(ex.schedule(), ranges);
    state.schedule = ex.schedule().name;
    state.microbatches = kMicrobatches;
    state.optimizer = ex.optimizer(0).config();
    state.optimizer_steps = ex.optimizer(0).steps_taken();
    return writer.commit(state).directory;
  }
  static std::vector<StageRange> ranges_of(int stages) {
    const ModelDescription model = reference_model(test_model());
    return stage_ranges(model, partition_blocks(model, stages, PartitionSpec::uniform()));
  }
  static std::vector<std::vector<unsigned char>> all_state(PipelineExecutor& ex) {
    std::vector<std::pair<std::string, std::vector<unsigned char>>> named;
    for (int r = 0; r < ex.num_ranks(); ++r)
      for (const NamedTensor& t : rank_checkpoint_tensors(ex, r))
        named.emplace_back(t.name, tensor_bytes(t.tensor));
    std::sort(named.begin(), named.end());
    std::vector<std::vector<unsigned char>> out;
    for (auto& [_, bytes] : named) out.push_back(std::move(bytes));
    return out;
  }
  TempDir dir_;
};

TEST_F(CheckpointRepartition, TwoStagesResumeAsOneAndAsThreeBitwise) {
  auto two = make_executor(schedule::generate_1f1b(2, kMicrobatches));
  train_step(*two, 1);
  train_step(*two, 2);
  const fs::path folder = save(*two, dir_.path(), 2, ranges_of(2));

  const Checkpoint ckpt = open_checkpoint(dir_.path());
  EXPECT_EQ(ckpt.state().stages.size(), 2u);
  for (int stages : {1, 3}) {
    SCOPED_TRACE(std::to_string(stages) + " stages");
    auto other = make_executor(schedule::generate_1f1b(stages, kMicrobatches));
    ckpt.check_model(model_fingerprint(describe_model(test_model())));
    ckpt.check_tensors(checkpoint_tensor_specs(*other));
    for (int r = 0; r < other->num_ranks(); ++r) load_rank_checkpoint(ckpt, *other, r);
    EXPECT_EQ(all_state(*other), all_state(*two));
    EXPECT_EQ(other->optimizer(0).steps_taken(), 2);
  }
  // Training goes on from the checkpoint exactly as without it.
  auto resumed = make_executor(schedule::generate_1f1b(3, kMicrobatches));
  for (int r = 0; r < resumed->num_ranks(); ++r) load_rank_checkpoint(ckpt, *resumed, r);
  train_step(*two, 3);
  train_step(*resumed, 3);
  EXPECT_EQ(all_state(*resumed), all_state(*two));
}

TEST_F(CheckpointRepartition, SgdStateHasItsOwnNames) {
  OptimizerConfig sgd = test_optimizer();
  sgd.kind = "sgd";
  auto ex = make_executor(schedule::generate_1f1b(1, kMicrobatches), {Device::cpu()},
                          PartitionSpec::uniform(), sgd);
  const auto tensors = rank_checkpoint_tensors(*ex, 0);
  const auto params = ex->rank_parameters(0);
  ASSERT_EQ(tensors.size(), 2 * params.size());
  EXPECT_EQ(tensors[0].name, params[0]->name);
  EXPECT_EQ(tensors[params.size()].name, "optimizer.momentum." + params[0]->name);
  auto adamw = make_executor(schedule::generate_1f1b(1, kMicrobatches));
  EXPECT_EQ(rank_checkpoint_tensors(*adamw, 0).size(), 3 * params.size());
  EXPECT_EQ(rank_checkpoint_tensors(*adamw, 0)[params.size() + 1].name,
            "optimizer.v." + params[0]->name);
}

TEST(CheckpointModel, FingerprintsTellModelsApart) {
  const ModelConfig a = test_model();
  ModelConfig b = a;
  b.hidden += 1;
  EXPECT_EQ(model_fingerprint(describe_model(a)), model_fingerprint(describe_model(test_model())));
  EXPECT_NE(model_fingerprint(describe_model(a)), model_fingerprint(describe_model(b)));
  EXPECT_EQ(model_fingerprint(describe_model(a)).rfind("xxh3_64:", 0), 0u);
}

}  // namespace
}  // namespace conveyor
