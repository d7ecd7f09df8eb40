// A model of the caller's through the pipeline: a description whose activation width
// changes between units runs under every stage count bitwise like its one-stage run, and a
// description that misstates a width ends in an error naming the sizes, not in a bad copy.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "engine/pipeline/executor.h"
#include "engine/schedule/generators.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"
#include "support/test_util.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;

constexpr int64_t kVocab = 13;

// embed (width 8) -> widen (8 -> 12) -> gelu -> head (width 12): 4 units, 3 boundaries, the
// first of width 8 and the others of width 12.
ModelDescription widening_model() {
  ModelDescription model;
  model.name = "widening";
  model.num_units = 4;
  model.vocab = kVocab;
  model.make_unit = [](int64_t index) -> std::unique_ptr<Layer> {
    switch (index) {
      case 0:
        return std::make_unique<Embedding>("embed", kVocab, 8);
      case 1:
        return std::make_unique<Linear>("widen", 8, 12);
      case 2:
        return std::make_unique<Activation>("act", ops::ActivationKind::kGelu);
      default:
        return std::make_unique<LossHead>("head", 12, kVocab);
    }
  };
  model.activation = [](int64_t boundary, int64_t tokens) {
    return ActivationSpec{{tokens, boundary == 1 ? 8 : 12}};
  };
  return model;
}

std::vector<MicroBatchData> microbatches(int m, int n, int step) {
  std::vector<MicroBatchData> out(m);
  for (int mb = 0; mb < m; ++mb) {
    out[mb].tokens = testing::random_ints(n, 300 * step + mb, 0, kVocab - 1);
    out[mb].targets = testing::random_ints(n, 700 * step + mb, 0, kVocab - 1);
  }
  return out;
}

std::unique_ptr<PipelineExecutor> executor_for(const ModelDescription& model,
                                               schedule::Schedule sched) {
  auto ranges = stage_ranges(
      model, partition_blocks(model, sched.num_stages(), PartitionSpec::by_parameters()));
  const std::vector<Device> devices(sched.num_ranks(), Device::cpu());
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  return std::make_unique<PipelineExecutor>(model, std::move(sched), std::move(ranges), devices,
                                            OptimizerConfig{}, /*seed=*/5, options);
}

struct Record {
  std::vector<double> losses;
  std::vector<std::vector<float>> values;
};

Record two_steps(PipelineExecutor& ex, int m) {
  constexpr int kTokens = 6;
  Record rec;
  for (int step = 1; step <= 2; ++step)
    rec.losses.push_back(
        ex.run_step(microbatches(m, kTokens, step), 1.0f / (m * kTokens), step, 1e-2).loss_sum);
  for (Parameter* p : ex.parameters()) rec.values.push_back(to_vector_f32(p->value));
  return rec;
}

TEST(ModelDescriptionPipeline, ChangingWidthsRunBitwiseLikeOneStage) {
  const ModelDescription model = widening_model();
  const int m = 4;
  auto one = executor_for(model, schedule::generate(ScheduleKind::k1F1B, 1, m));
  const Record want = two_steps(*one, m);
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZBH1, ScheduleKind::kGPipe})
    for (int p = 2; p <= 4; ++p) {
      SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p));
      auto ex = executor_for(model, schedule::generate(kind, p, m));
      const Record got = two_steps(*ex, m);
      EXPECT_EQ(got.losses, want.losses);
      EXPECT_EQ(got.values, want.values);
    }
}

TEST(ModelDescriptionPipeline, AMisstatedWidthIsAnErrorNamingTheSizes) {
  ModelDescription model = widening_model();
  model.activation = activation_rows(8);  // wrong after the widening unit
  const int m = 2;
  auto sched = schedule::generate(ScheduleKind::k1F1B, 2, m);
  auto ranges = stage_ranges(model, {1, 1});  // [embed, widen) | [act, head)
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  PipelineExecutor ex(model, std::move(sched), ranges, {Device::cpu(), Device::cpu()},
                      OptimizerConfig{}, 5, options);
  try {
    ex.run_step(microbatches(m, 6, 1), 1.0f / 12, 1, 1e-2);
    FAIL() << "a unit wider than the description went unnoticed";
  } catch (const PipelineError& e) {
    // Named by the unit that widens, on its rank, before any transfer of the wrong size.
    EXPECT_NE(std::string(e.what()).find("rank 0, action 0 (F0.0): model 'widening': the output "
                                         "of unit 1 is f32 [6, 12] for a micro-batch of 6 "
                                         "tokens; expected f32 [6, 8]"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace conveyor
