// Data parallelism in the trainer: a micro-batch count the replicas cannot share is refused;
// a data-parallel run stopped, saved and resumed continues bit for bit, on every replica, as
// the run straight through does; a sharded optimizer needs replicas (its checkpoints:
// checkpoint_sharded_test.cpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "checkpoint_fixture.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/text_format.h"
#include "engine/train/checkpoint.h"
#include "engine/train/trainer.h"
#include "engine/train/trainer_checkpoint.h"
#include "support/train_config.h"

namespace conveyor {
namespace {

using testing::TempDir;

TrainConfig dp_config() { return testing::small_train_config(2, 2); }

// The bytes of every parameter of every rank of every replica.
std::vector<std::vector<float>> all_weights(Trainer& trainer) {
  std::vector<std::vector<float>> out;
  PipelineExecutor& ex = trainer.executor();
  for (int r = 0; r < ex.num_world_ranks(); ++r)
    for (Parameter* p : ex.rank_parameters(r)) out.push_back(to_vector_f32(p->value));
  return out;
}

TEST(DataParallelTrainer, RefusesMicroBatchesTheReplicasCannotShare) {
  TrainConfig c = dp_config();
  c.data_parallel = 3;
  try {
    Trainer trainer(c);
    ADD_FAILURE() << "4 micro-batches ran on 3 replicas";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("4 micro-batches cannot be shared equally by 3"),
              std::string::npos)
        << e.what();
  }
}

// Each stage gets ceil(its gradient bytes / the bucket) buckets, so stages of other sizes get
// other counts; the weights are those of one bucket per stage, bit for bit.
TEST(DataParallelTrainer, BucketSizeSetsEachStagesBucketsAndLeavesTheBits) {
  TrainConfig c = dp_config();
  c.partition = PartitionSpec::by_parameters();
  c.gradient_bucket_mib = 0.0;
  Trainer whole(c);
  const schedule::Schedule& one = whole.executor().schedule();
  ASSERT_EQ(one.num_stages(), 2);
  const std::vector<int> counts =
      gradient_buckets_per_stage(whole.model(), whole.stage_ranges(), kMinGradientBucketMiB);
  for (int s = 0; s < 2; ++s) EXPECT_EQ(schedule::gradient_buckets(one, s), 1);
  c.gradient_bucket_mib = kMinGradientBucketMiB;
  Trainer bucketed(c);
  const schedule::Schedule& many = bucketed.executor().schedule();
  for (int s = 0; s < 2; ++s) {
    EXPECT_GT(counts[s], 1) << "stage " << s;
    EXPECT_EQ(schedule::gradient_buckets(many, s), counts[s]) << "stage " << s;
  }
  for (int s = 0; s < 3; ++s) {
    whole.step();
    bucketed.step();
  }
  const auto a = all_weights(whole), b = all_weights(bucketed);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)), 0)
        << "tensor " << i;
  // The default is PyTorch's 25 MiB, which holds each of these small stages whole.
  c.gradient_bucket_mib.reset();
  Trainer by_default(c);
  for (int s = 0; s < 2; ++s)
    EXPECT_EQ(schedule::gradient_buckets(by_default.executor().schedule(), s), 1);
}

TEST(DataParallelTrainer, RefusesABucketThatIsNotASize) {
  for (double mib : {-1.0, std::nan(""), 1e-4, 2e6}) {
    TrainConfig c = dp_config();
    c.gradient_bucket_mib = mib;
    EXPECT_THROW(c.validate(), std::invalid_argument) << mib;
  }
}

// A schedule file with more buckets for a stage than it has gradient elements is refused
// when the trainer is built, naming the file and the stage, not at the first all-reduce.
TEST(DataParallelTrainer, RefusesAScheduleFileWithMoreBucketsThanGradientElements) {
  TrainConfig c = dp_config();
  const int m = static_cast<int>(c.microbatches) / 2;
  int64_t stage0 = 0;
  {
    Trainer sized(c);
    const StageRange& r = sized.stage_ranges().at(0);
    const std::vector<int64_t> units = sized.model().unit_parameter_counts();
    for (int64_t u = r.begin; u < r.end; ++u) stage0 += units[static_cast<size_t>(u)];
  }
  ASSERT_GT(stage0, 1);
  TempDir dir;
  for (const int64_t buckets : {stage0, stage0 + 1}) {
    schedule::Schedule sched = schedule::generate(c.schedule, c.stages, m, c.chunks);
    schedule::add_gradient_all_reduces(&sched, 2, {static_cast<int>(buckets), 1});
    c.schedule_file = (dir.path() / ("buckets" + std::to_string(buckets) + ".txt")).string();
    schedule::save_schedule(c.schedule_file, sched);
    if (buckets == stage0) {
      // One element per bucket is the finest cut, and it runs.
      Trainer trainer(c);
      EXPECT_TRUE(std::isfinite(trainer.step().loss));
      continue;
    }
    try {
      Trainer trainer(c);
      ADD_FAILURE() << buckets << " buckets for " << stage0 << " elements were accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()),
                "schedule file '" + c.schedule_file + "' has " + std::to_string(buckets) +
                    " all-reduce buckets for stage 0, which has " + std::to_string(stage0) +
                    " gradient elements; a stage takes at most one bucket per gradient element");
    }
  }
}

TEST(DataParallelTrainer, ResumedRunContinuesBitwiseOnEveryReplica) {
  const TrainConfig c = dp_config();
  std::vector<double> straight_losses;
  std::vector<std::vector<float>> straight_weights;
  {
    Trainer trainer(c);
    for (int s = 0; s < 4; ++s) straight_losses.push_back(trainer.step().loss);
    straight_weights = all_weights(trainer);
  }
  TempDir dir;
  std::vector<double> losses;
  {
    Trainer trainer(c);
    TrainerCheckpointOptions options;
    options.directory = dir.path();
    options.every = 2;
    TrainerCheckpointer checkpointer(trainer, options);
    for (int s = 0; s < 2; ++s) {
      losses.push_back(trainer.step().loss);
      checkpointer.after_step();
    }
    checkpointer.finish();
  }
  Trainer trainer(c);
  resume_trainer(trainer, dir.path());
  for (int s = 2; s < 4; ++s) losses.push_back(trainer.step().loss);
  EXPECT_EQ(losses, straight_losses);
  const auto weights = all_weights(trainer);
  ASSERT_EQ(weights.size(), straight_weights.size());
  for (size_t i = 0; i < weights.size(); ++i)
    EXPECT_EQ(std::memcmp(weights[i].data(), straight_weights[i].data(),
                          weights[i].size() * sizeof(float)),
              0)
        << "tensor " << i << " of the ranks of every replica";
}

TEST(DataParallelTrainer, ShardedOptimizerNeedsReplicas) {
  TrainConfig c = dp_config();
  c.shard_optimizer = true;
  c.data_parallel = 1;
  EXPECT_THROW(Trainer{c}, std::invalid_argument);
}

}  // namespace
}  // namespace conveyor
