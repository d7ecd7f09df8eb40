// Pipeline x data parallelism on the CPU executor: D replicas of a P-rank pipeline (rank r is
// pipeline rank r mod P of replica r div P), each on its own slice of the step's micro-batches,
// the gradients of each stage summed over the replicas by the schedule's ALLREDUCE_GRAD. The
// replicas must end with bitwise the same weights, and agree with the single pipeline on the
// same global micro-batches up to the order of the gradient sum. With the optimizer state
// sharded over the replicas (ZeRO-1), the weights stay bitwise those of the unsharded run,
// the gradients going through a reduce-scatter instead of the full sum.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "comm/in_process.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/rank_step.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/measured_timing.h"
#include "support/executor_fixture.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;
using namespace conveyor::testing;

constexpr int kTokens = 5;

// Every parameter value of world rank r, in its order.
std::vector<std::vector<float>> rank_values(PipelineExecutor& ex, int r) {
  std::vector<std::vector<float>> out;
  for (Parameter* p : ex.rank_parameters(r)) out.push_back(to_vector_f32(p->value));
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double scale = 0, diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

struct DpRun {
  std::vector<double> losses, norms;
  std::unique_ptr<PipelineExecutor> ex;
};

// Three steps over `total` global micro-batches per step.
DpRun run(schedule::Schedule sched, int total) {
  DpRun out;
  out.ex = make_executor(std::move(sched));
  for (int step = 1; step <= 3; ++step) {
    const auto r = out.ex->run_step(make_microbatches(total, kTokens, step),
                                    1.0f / (total * kTokens), step, 1e-2);
    out.losses.push_back(r.loss_sum);
    out.norms.push_back(r.grad_norm);
  }
  return out;
}

TEST(DataParallel, ReplicasEndWithBitwiseIdenticalWeights) {
  for (auto [p, d] : {std::pair{2, 2}, std::pair{1, 2}, std::pair{2, 3}}) {
    SCOPED_TRACE("P=" + std::to_string(p) + " D=" + std::to_string(d));
    const int m = 2;
    DpRun got = run(schedule::generate(ScheduleKind::k1F1B, p, m, 1, d), m * d);
    ASSERT_EQ(got.ex->num_world_ranks(), p * d);
    for (int r = 0; r < p; ++r) {
      const auto first = rank_values(*got.ex, r);
      for (int rep = 1; rep < d; ++rep) {
        const auto other = rank_values(*got.ex, rep * p + r);
        ASSERT_EQ(first.size(), other.size());
        for (size_t i = 0; i < first.size(); ++i)
          EXPECT_TRUE(same_bits(first[i], other[i]))
              << "parameter " << i << " of pipeline rank " << r << ", replica " << rep;
      }
    }
    for (double l : got.losses) EXPECT_TRUE(std::isfinite(l));
  }
}

TEST(DataParallel, AgreesWithOnePipelineOnTheSameGlobalMicroBatches) {
  const int total = 4;
  const DpRun one = run(schedule::generate(ScheduleKind::k1F1B, 2, total), total);
  for (auto [p, d, kind] :
       {std::tuple{2, 2, ScheduleKind::k1F1B}, std::tuple{1, 2, ScheduleKind::k1F1B},
        std::tuple{2, 2, ScheduleKind::kZBH1}, std::tuple{2, 2, ScheduleKind::kInterleaved},
        std::tuple{2, 4, ScheduleKind::kGPipe}}) {
    SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " P=" + std::to_string(p) +
                 " D=" + std::to_string(d));
    const int v = kind == ScheduleKind::kInterleaved ? 2 : 1;
    DpRun dp = run(schedule::generate(kind, p, total / d, v, d), total);
    // The first step's loss comes from the same weights and the same per-micro-batch sums
    // in the same order: bitwise. After that the gradient sums differ in order only.
    EXPECT_EQ(dp.losses[0], one.losses[0]);
    for (size_t s = 0; s < one.losses.size(); ++s) {
      EXPECT_NEAR(dp.losses[s], one.losses[s], 1e-6 * std::abs(one.losses[s])) << "step " << s;
      EXPECT_NEAR(dp.norms[s], one.norms[s], 1e-6 * std::abs(one.norms[s])) << "step " << s;
    }
    // The last step's gradients differ by the rounding of another sum order and by what the
    // weights already differ after the earlier steps (a few float ulps); the weights,
    // after three AdamW steps whose update divides by the gradient's own scale, by a few more.
    const auto want = one.ex->parameters();
    const auto got = dp.ex->parameters();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(max_relative_difference(to_vector_f32(got[i]->grad), to_vector_f32(want[i]->grad)),
                4e-6)
          << want[i]->name;
      EXPECT_LE(
          max_relative_difference(to_vector_f32(got[i]->value), to_vector_f32(want[i]->value)),
          1e-5)
          << want[i]->name;
    }
  }
}

TEST(DataParallel, StageCountDoesNotChangeTheBits) {
  // Within a replica the gradients accumulate in micro-batch order whatever the cut, and the
  // replicas are summed in replica order: D = 2 with one stage or two gives the same bits.
  const DpRun one = run(schedule::generate(ScheduleKind::k1F1B, 1, 2, 1, 2), 4);
  const DpRun two = run(schedule::generate(ScheduleKind::kZBH1, 2, 2, 1, 2), 4);
  EXPECT_EQ(one.losses, two.losses);
  EXPECT_EQ(one.norms, two.norms);
  const auto a = one.ex->parameters(), b = two.ex->parameters();
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_TRUE(same_bits(to_vector_f32(a[i]->value), to_vector_f32(b[i]->value))) << a[i]->name;
}

TEST(DataParallel, EveryReplicasRanksAreTimed) {
  // The trace draws every rank: each replica's timeline is measured, not only replica 0's.
  const int p = 2, d = 2, m = 2;
  auto sched = schedule::generate(ScheduleKind::k1F1B, p, m, 1, d);
  auto ex = make_executor(sched);
  const auto r = ex->run_step(make_microbatches(m * d, kTokens, 1), 0.1f, 1, 1e-2);
  ASSERT_EQ(r.timing.size(), static_cast<size_t>(p * d));
  for (int w = 0; w < p * d; ++w) {
    const auto& list = sched.ranks[w % p];
    ASSERT_EQ(r.timing[w].size(), list.size()) << "rank " << w;
    for (size_t i = 0; i < list.size(); ++i) {
      EXPECT_GT(r.timing[w][i].end, 0.0) << "rank " << w << " action " << i;
      EXPECT_LE(r.timing[w][i].start, r.timing[w][i].end) << "rank " << w << " action " << i;
    }
  }
  const auto replicas = schedule::summarize_replicas(sched, r.timing);
  ASSERT_EQ(replicas.size(), 2u);
  EXPECT_GT(replicas[1].ranks[1].busy, 0.0);
}

TEST(DataParallel, ReplicasThatWentApartAreNamed) {
  DpRun got = run(schedule::generate(ScheduleKind::k1F1B, 2, 2, 1, 2), 4);
  got.ex->check_replicas_agree();
  // One element of the last parameter of replica 1's last stage (rank 3), one ulp off.
  Tensor& value = got.ex->rank_parameters(3).back()->value;
  std::vector<float> v = to_vector_f32(value);
  v[0] = std::nextafter(v[0], 1e30f);
  copy_from_host(value, v.data(), v.size() * sizeof(float));
  try {
    got.ex->check_replicas_agree();
    ADD_FAILURE() << "replicas one ulp apart passed the check";
  } catch (const ReplicasDiffer& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "replica 1 (rank 3) ends with other weights of stage 1 than replica 0 (rank 1)"),
              std::string::npos)
        << e.what();
  }
}

TEST(DataParallel, RefusesAStepWithAnotherMicroBatchCount) {
  auto ex = make_executor(schedule::generate(ScheduleKind::k1F1B, 2, 2, 1, 2));
  try {
    ex->run_step(make_microbatches(2, kTokens, 1), 0.1f, 1, 1e-2);
    ADD_FAILURE() << "a step of 2 micro-batches ran on 2 replicas of 2";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("4 micro-batches (2 for each of 2 replicas)"),
              std::string::npos)
        << e.what();
  }
}

TEST(DataParallel, NeedsOneDevicePerRankOfEveryReplica) {
  const ModelDescription model = reference_model(test_model());
  auto sched = schedule::generate(ScheduleKind::k1F1B, 2, 2, 1, 2);
  auto ranges = stage_ranges(model, partition_blocks(model, 2, PartitionSpec::uniform()));
  try {
    PipelineExecutor ex(model, sched, ranges, {Device::cpu(), Device::cpu()}, test_optimizer(), 17);
    ADD_FAILURE() << "built 2 replicas on 2 devices";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("2 ranks x 2 replicas but 2 devices"), std::string::npos)
        << e.what();
  }
}

// Wide enough that halving the state is visible through the allocator's 512-byte rounding.
// `in_flight`: ExecutorOptions::bucket_bytes_in_flight.
std::unique_ptr<PipelineExecutor> make_wide_executor(
    schedule::Schedule sched, bool shard,
    size_t in_flight = ExecutorOptions::kDefaultBucketBytesInFlight) {
  ModelConfig c = test_model();
  c.d_model = 64;
  c.hidden = 256;
  c.n_layers = 3;
  const ModelDescription model = reference_model(c);
  auto ranges =
      stage_ranges(model, partition_blocks(model, sched.num_stages(), PartitionSpec::uniform()));
  ExecutorOptions options;
  options.shard_optimizer = shard;
  options.bucket_bytes_in_flight = in_flight;
  std::vector<Device> devices(static_cast<size_t>(sched.num_ranks()) * sched.replicas,
                              Device::cpu());
  return std::make_unique<PipelineExecutor>(model, std::move(sched), std::move(ranges),
                                            std::move(devices), test_optimizer(), 17, options);
}

// Three steps of both executors on the same `microbatches` micro-batches: every step's loss
// and gradient norm agree bit for bit.
void expect_same_steps(PipelineExecutor& plain, PipelineExecutor& sharded, int microbatches) {
  for (int step = 1; step <= 3; ++step) {
    const auto batch = make_microbatches(microbatches, kTokens, step);
    const float scale = 1.0f / static_cast<float>(microbatches * kTokens);
    const auto a = plain.run_step(batch, scale, step, 1e-2);
    const auto b = sharded.run_step(batch, scale, step, 1e-2);
    EXPECT_EQ(a.loss_sum, b.loss_sum) << "step " << step;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << "step " << step;
  }
}

TEST(ShardedOptimizer, WeightsAreBitwiseThoseOfTheUnshardedRunWithHalfTheState) {
  for (auto kind : {schedule::ScheduleKind::k1F1B, schedule::ScheduleKind::kInterleaved}) {
    SCOPED_TRACE(schedule::schedule_kind_name(kind));
    const int v = kind == schedule::ScheduleKind::kInterleaved ? 2 : 1;
    auto plain = make_wide_executor(schedule::generate(kind, 2, 2, v, 2), false);
    auto sharded = make_wide_executor(schedule::generate(kind, 2, 2, v, 2), true);
    expect_same_steps(*plain, *sharded, 4);
    for (int r = 0; r < plain->num_world_ranks(); ++r) {
      const auto want = rank_values(*plain, r), got = rank_values(*sharded, r);
      ASSERT_EQ(want.size(), got.size());
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_TRUE(same_bits(want[i], got[i])) << "rank " << r << " parameter " << i;
      // AdamW's two moments: half of them per replica, up to the allocator's rounding of
      // each state tensor to 512 bytes.
      const size_t full = plain->optimizer_state_bytes(r), half = sharded->optimizer_state_bytes(r);
      const size_t slack = 512 * sharded->optimizer(r).state().size();
      EXPECT_GT(full, 100000u);
      EXPECT_LE(half, full / 2 + slack) << "rank " << r;
      EXPECT_GE(half + slack, full / 2) << "rank " << r;
      EXPECT_LT(half, full * 6 / 10) << "rank " << r;
    }
  }
}

// `kind` at (2, D) with each stage's gradients all-reduced in `buckets` buckets.
schedule::Schedule bucketed(schedule::ScheduleKind kind, int buckets, int replicas = 2) {
  const int v = kind == schedule::ScheduleKind::kInterleaved ? 2 : 1;
  auto s = schedule::generate(kind, 2, 2, v, replicas);
  schedule::add_gradient_all_reduces(&s, replicas, {buckets});
  return s;
}

// ExecutorOptions::bucket_bytes_in_flight that lets only two buckets go at once.
constexpr size_t kTwoInFlight = 0;

TEST(GradientBuckets, BucketedAllReducesGiveTheBitsOfOneMessagePerStage) {
  // Every element is still summed over the replicas in replica order, whatever bucket it
  // goes in and however many buckets are in flight with it: losses, norms and weights are
  // bitwise those of the unbucketed run, sharded too. The default bound lets all seven
  // buckets of a stage (and, interleaved, the rank's other stage's) go at once.
  struct Case {
    schedule::ScheduleKind kind;
    int replicas;
  };
  for (const Case c :
       {Case{schedule::ScheduleKind::k1F1B, 2}, Case{schedule::ScheduleKind::kInterleaved, 2},
        Case{schedule::ScheduleKind::k1F1B, 3}})
    for (bool shard : {false, true})
      for (size_t in_flight : {ExecutorOptions::kDefaultBucketBytesInFlight, kTwoInFlight}) {
        SCOPED_TRACE(std::string(schedule::schedule_kind_name(c.kind)) +
                     " D=" + std::to_string(c.replicas) + (shard ? " sharded" : "") +
                     (in_flight == kTwoInFlight ? ", two in flight" : ", all in flight"));
        auto one = make_wide_executor(bucketed(c.kind, 1, c.replicas), shard);
        auto many = make_wide_executor(bucketed(c.kind, 7, c.replicas), shard, in_flight);
        ASSERT_EQ(schedule::gradient_buckets(many->schedule(), 1), 7);
        expect_same_steps(*one, *many, 2 * c.replicas);
        for (int r = 0; r < one->num_world_ranks(); ++r) {
          const auto want = rank_values(*one, r), got = rank_values(*many, r);
          ASSERT_EQ(want.size(), got.size());
          for (size_t i = 0; i < want.size(); ++i)
            EXPECT_TRUE(same_bits(want[i], got[i])) << "rank " << r << " parameter " << i;
        }
        many->check_replicas_agree();
      }
}

// The timing of rank 0's all-reduce buckets in one step, in list order.
std::vector<schedule::ActionTiming> bucket_timing(size_t in_flight) {
  auto ex = make_wide_executor(bucketed(schedule::ScheduleKind::k1F1B, 3), false, in_flight);
  const auto r = ex->run_step(make_microbatches(4, kTokens, 1), 0.05f, 1, 1e-2);
  const auto& list = ex->schedule().ranks[0];
  std::vector<schedule::ActionTiming> out;
  for (size_t i = 0; i < list.size(); ++i) {
    if (!schedule::is_reduce(list[i].kind)) continue;
    EXPECT_EQ(list[i].microbatch, static_cast<int>(out.size()));
    out.push_back(r.timing[0][i]);
  }
  EXPECT_EQ(out.size(), 3u);
  return out;
}

TEST(GradientBuckets, BucketsStartAsSoonAsTheirGradientsAreFinalAndEndInStartOrder) {
  // With 1F1B every bucket's gradients are final after the stage's last backward: all three
  // start together and are in flight at once.
  const auto all = bucket_timing(ExecutorOptions::kDefaultBucketBytesInFlight);
  ASSERT_EQ(all.size(), 3u);
  for (size_t b = 1; b < all.size(); ++b) {
    EXPECT_GE(all[b].start, all[b - 1].start) << "bucket " << b;
    EXPECT_GE(all[b].end, all[b - 1].end) << "bucket " << b;
    EXPECT_LT(all[b].start, all[0].end) << "bucket " << b << " waited for bucket 0";
  }
  // Bounded to two in flight: the third starts only once the first has ended.
  const auto two = bucket_timing(kTwoInFlight);
  ASSERT_EQ(two.size(), 3u);
  EXPECT_LT(two[1].start, two[0].end);
  EXPECT_GE(two[2].start, two[0].end);
  EXPECT_GE(two[2].end, two[1].end);
}

// Gives every rank of `ex` an endpoint of `hub`, whose byte counts then show its traffic.
void use_hub(PipelineExecutor& ex, comm::InProcessHub& hub) {
  std::vector<std::unique_ptr<comm::Transport>> transports;
  for (int r = 0; r < ex.num_world_ranks(); ++r) transports.push_back(hub.endpoint(r));
  ex.set_transports(std::move(transports));
}

TEST(ShardedOptimizer, ReduceScattersTheGradientsAtThreeReplicasWithTheSameBits) {
  // Three replicas: most parameters do not split evenly.
  constexpr int kReplicas = 3;
  auto plain =
      make_wide_executor(schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, 3), false);
  auto sharded = make_wide_executor(
      schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, kReplicas), true);
  const int world = plain->num_world_ranks();
  auto plain_hub = comm::InProcessHub::create(world, std::chrono::milliseconds(60000));
  auto sharded_hub = comm::InProcessHub::create(world, std::chrono::milliseconds(60000));
  use_hub(*plain, *plain_hub);
  use_hub(*sharded, *sharded_hub);
  expect_same_steps(*plain, *sharded, 6);
  for (int r = 0; r < world; ++r) {
    const auto want = rank_values(*plain, r), got = rank_values(*sharded, r);
    ASSERT_EQ(want.size(), got.size());
    for (size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(same_bits(want[i], got[i])) << "rank " << r << " parameter " << i;
    // Per step, the reduce-scatter sends each other replica its range, N - own, and the
    // gather the rank's own range to each other replica. The unsharded sum (one per stage
    // here) is a reduce-scatter and a gather too, over ranges N * d / D of the flat gradients
    // instead of each parameter's pieces: about the same bytes, 2 (D - 1) / D of N.
    size_t n = 0, own = 0;
    for (Parameter* p : sharded->rank_parameters(r)) {
      n += static_cast<size_t>(p->value.numel());
      own += static_cast<size_t>(replica_piece(p->value.numel(), r / 2, kReplicas).count);
    }
    EXPECT_GT(own, n / 4) << "rank " << r;
    const size_t replica = static_cast<size_t>(r / 2);
    const size_t sum_range = n * (replica + 1) / kReplicas - n * replica / kReplicas;
    EXPECT_EQ(plain_hub->group_bytes_sent(r),
              3 * ((n - sum_range) + (kReplicas - 1) * sum_range) * sizeof(float))
        << "rank " << r;
    EXPECT_EQ(sharded_hub->group_bytes_sent(r),
              3 * ((n - own) + (kReplicas - 1) * own) * sizeof(float))
        << "rank " << r;
  }
}

}  // namespace
}  // namespace conveyor
