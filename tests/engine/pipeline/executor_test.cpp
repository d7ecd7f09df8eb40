// The executor on the CPU backend: every generated schedule gives bitwise the losses,
// gradients and weights of the one-stage run; activation memory follows the IR's
// in-flight prediction; broken schedules and failing ranks end in errors, never hangs.
#include "engine/pipeline/executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "comm/in_process.h"
#include "engine/schedule/generators.h"
#include "engine/schedule/validator.h"
#include "support/executor_fixture.h"

namespace conveyor {
namespace {

using schedule::ScheduleKind;
using namespace conveyor::testing;

TEST(Executor, EveryScheduleMatchesTheOneStageRunBitwise) {
  std::vector<RunRecord> reference(9);
  for (int m = 1; m <= 8; ++m) {
    auto one = make_executor(schedule::generate(ScheduleKind::k1F1B, 1, m));
    reference[m] = run_two_steps(*one, m);
  }
  int configurations = 0;
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::k1F1B, ScheduleKind::kZBH1,
                            ScheduleKind::kInterleaved, ScheduleKind::kZBV})
    for (int p = 1; p <= 4; ++p)
      for (int m = 1; m <= 8; ++m) {
        const int v = kind == ScheduleKind::kInterleaved || kind == ScheduleKind::kZBV ? 2 : 1;
        schedule::Schedule sched;
        try {
          sched = schedule::generate(kind, p, m, v);
        } catch (const schedule::ScheduleError&) {
          continue;  // not defined for these values (interleaved needs m % p == 0)
        }
        SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " p=" + std::to_string(p) +
                     " m=" + std::to_string(m));
        auto ex = make_executor(std::move(sched));
        const RunRecord got = run_two_steps(*ex, m);
        const RunRecord& want = reference[m];
        EXPECT_EQ(got.losses, want.losses);
        EXPECT_EQ(got.norms, want.norms);
        ASSERT_EQ(got.grads.size(), want.grads.size());
        for (size_t i = 0; i < got.grads.size(); ++i) {
          EXPECT_EQ(got.grads[i], want.grads[i]) << "gradient of parameter " << i;
          EXPECT_EQ(got.values[i], want.values[i]) << "value of parameter " << i;
        }
        ++configurations;
      }
  EXPECT_GE(configurations, 100);
}

// A stop request that one rank alone sees reaches the step's result through the all-reduce,
// and carrying it changes no bit of the step.
TEST(Executor, AStopRequestOfOneRankIsTheStepsAndLeavesItsBits) {
  constexpr int kRanks = 3, kMicrobatches = 4;
  auto plain = make_executor(schedule::generate(ScheduleKind::k1F1B, kRanks, kMicrobatches));
  auto asked = make_executor(schedule::generate(ScheduleKind::k1F1B, kRanks, kMicrobatches));
  std::atomic<int> calls{0}, pending{15};
  asked->set_stop_request([&] {
    ++calls;
    return pending.exchange(0);  // the first rank to ask takes it
  });
  for (int step = 1; step <= 2; ++step) {
    const auto mbs = make_microbatches(kMicrobatches, 5, step);
    const auto want = plain->run_step(mbs, 0.05f, step, 1e-2);
    const auto got = asked->run_step(mbs, 0.05f, step, 1e-2);
    EXPECT_EQ(want.stop_signal, 0);
    EXPECT_EQ(got.stop_signal, step == 1 ? 15 : 0) << "step " << step;
    EXPECT_EQ(got.loss_sum, want.loss_sum);
    EXPECT_EQ(got.grad_norm, want.grad_norm);
    EXPECT_EQ(calls.load(), kRanks * step);  // every rank asks once per step
  }
  const auto a = plain->parameters(), b = asked->parameters();
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(to_vector_f32(a[i]->value), to_vector_f32(b[i]->value)) << a[i]->name;
}

TEST(Executor, ARateThatIsNaNInfiniteOrNegativeIsRefusedBeforeTheStep) {
  auto ex = make_executor(schedule::generate(ScheduleKind::k1F1B, 2, 2));
  const auto mbs = make_microbatches(2, 6, 1);
  for (const double lr : {std::nan(""), std::numeric_limits<double>::infinity(), -1e-3}) {
    SCOPED_TRACE(lr);
    try {
      ex->run_step(mbs, 1.0f / 12, 1, lr);
      ADD_FAILURE() << "rate " << lr << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("learning rate of step 1 must be a finite number >= 0"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(ex->run_step(mbs, std::nanf(""), 1, 1e-2), std::invalid_argument);
  // Nothing ran: the executor takes a step with a good rate, as a fresh one does.
  auto fresh = make_executor(schedule::generate(ScheduleKind::k1F1B, 2, 2));
  EXPECT_EQ(ex->run_step(mbs, 1.0f / 12, 1, 1e-2).loss_sum,
            fresh->run_step(mbs, 1.0f / 12, 1, 1e-2).loss_sum);
}

TEST(Executor, AStepBelowOneIsRefusedBeforeTheStep) {
  // AdamW's steps count from 1: step 0 would fail on every rank after its whole backward.
  OptimizerConfig adamw = test_optimizer();
  adamw.kind = "adamw";
  const auto sched = schedule::generate(ScheduleKind::k1F1B, 2, 2);
  auto ex = make_executor(sched, {Device::cpu(), Device::cpu()}, PartitionSpec::uniform(), adamw);
  const auto mbs = make_microbatches(2, 6, 1);
  for (const int64_t step : {int64_t{0}, int64_t{-3}}) {
    try {
      ex->run_step(mbs, 1.0f / 12, step, 1e-2);
      ADD_FAILURE() << "step " << step << " was taken";
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "run_step's step must be at least 1, got " +
                                           std::to_string(step) +
                                           ": the optimizer's steps count from 1");
    }
  }
  // Nothing ran: the executor takes step 1 as a fresh one does.
  auto fresh =
      make_executor(sched, {Device::cpu(), Device::cpu()}, PartitionSpec::uniform(), adamw);
  EXPECT_EQ(ex->run_step(mbs, 1.0f / 12, 1, 1e-2).loss_sum,
            fresh->run_step(mbs, 1.0f / 12, 1, 1e-2).loss_sum);
}

TEST(Executor, PeakActivationsFollowTheScheduleInFlightCount) {
  const int p = 4;
  // Bytes one micro-batch keeps on each rank: a run that only ever holds one.
  auto single = make_executor(schedule::generate(ScheduleKind::kGPipe, p, 1));
  const auto one = single->run_step(make_microbatches(1, 6, 1), 1.0f / 6, 1, 1e-2);
  for (int m : {1, 3, 8}) {
    for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kGPipe}) {
      SCOPED_TRACE(std::string(schedule::schedule_kind_name(kind)) + " m=" + std::to_string(m));
      auto ex = make_executor(schedule::generate(kind, p, m));
      const auto result = ex->run_step(make_microbatches(m, 6, 1), 1.0f / (6 * m), 1, 1e-2);
      const auto predicted = schedule::in_flight_per_rank(ex->schedule());
      for (int r = 0; r < p; ++r) {
        const int in_flight = kind == ScheduleKind::k1F1B ? std::min(p - r, m) : m;
        EXPECT_EQ(predicted[r].peak_in_flight, in_flight) << "rank " << r;
        EXPECT_GT(one.peak_activation_bytes[r], 0u);
        EXPECT_EQ(result.peak_activation_bytes[r],
                  static_cast<size_t>(in_flight) * one.peak_activation_bytes[r])
            << "rank " << r;
      }
    }
  }
}

TEST(Executor, SwappedSendsAreRejectedBeforeRunning) {
  schedule::Schedule sched = schedule::generate(ScheduleKind::k1F1B, 2, 2);
  // Swap the two activation sends of rank 0: rank 1 would receive micro-batch 1 first.
  auto& r0 = sched.ranks[0];
  std::vector<size_t> sends;
  for (size_t i = 0; i < r0.size(); ++i)
    if (r0[i].kind == schedule::ActionKind::kSendAct) sends.push_back(i);
  ASSERT_EQ(sends.size(), 2u);
  std::swap(r0[sends[0]].microbatch, r0[sends[1]].microbatch);
  EXPECT_THROW(make_executor(sched), schedule::ValidationError);
}

// A transport whose rank fails on its n-th send, like a peer thread that throws.
class FailingTransport : public comm::Transport {
 public:
  FailingTransport(std::unique_ptr<comm::Transport> inner, int fail_at)
      : inner_(std::move(inner)), fail_at_(fail_at) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void send(const Tensor& t, int peer, const Stream& s) override {
    if (++sends_ == fail_at_) throw std::runtime_error("injected link failure");
    inner_->send(t, peer, s);
  }
  void recv(const Tensor& t, int peer, const Stream& s) override { inner_->recv(t, peer, s); }
  bool try_recv(const Tensor& t, int peer, const Stream& s) override {
    return inner_->try_recv(t, peer, s);
  }
  void all_reduce_sum(std::vector<double>& v) override { inner_->all_reduce_sum(v); }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<comm::Transport> inner_;
  int fail_at_;
  int sends_ = 0;
};

TEST(Executor, AFailingRankEndsTheRunWithAnErrorNamingIt) {
  auto ex = make_executor(schedule::generate(ScheduleKind::k1F1B, 3, 4));
  auto hub = comm::InProcessHub::create(3, std::chrono::milliseconds(60000));
  std::vector<std::unique_ptr<comm::Transport>> transports;
  for (int r = 0; r < 3; ++r) {
    auto endpoint = hub->endpoint(r);
    transports.push_back(r == 1 ? std::make_unique<FailingTransport>(std::move(endpoint), 2)
                                : std::move(endpoint));
  }
  ex->set_transports(std::move(transports));
  const auto start = std::chrono::steady_clock::now();
  try {
    ex->run_step(make_microbatches(4, 5, 1), 0.05f, 1, 1e-2);
    FAIL() << "the run succeeded despite the failing rank";
  } catch (const PipelineError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1, action"), std::string::npos) << what;
    EXPECT_NE(what.find("injected link failure"), std::string::npos) << what;
    EXPECT_NE(what.find("SA1."), std::string::npos) << what;  // the action, by name
  }
  // The other ranks were woken by the abort, not by the 60 s timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// A transport that says its transfers are device kernels waiting on peers, as NCCL's are.
class PeerWaitingTransport : public FailingTransport {
 public:
  explicit PeerWaitingTransport(std::unique_ptr<comm::Transport> inner)
      : FailingTransport(std::move(inner), 0) {}
  bool queues_kernels_that_wait_on_peers() const override { return true; }
};

TEST(Executor, TransportsSetLaterTellTheAllocatorsWhetherKernelsWaitOnPeers) {
  auto ex = make_executor(schedule::generate(ScheduleKind::k1F1B, 2, 2));
  const auto set = [&](bool peer_waiting_rank_1) {
    auto hub = comm::InProcessHub::create(2, std::chrono::milliseconds(60000));
    std::vector<std::unique_ptr<comm::Transport>> transports;
    transports.push_back(hub->endpoint(0));
    transports.push_back(peer_waiting_rank_1
                             ? std::make_unique<PeerWaitingTransport>(hub->endpoint(1))
                             : hub->endpoint(1));
    ex->set_transports(std::move(transports));
  };
  for (int r = 0; r < 2; ++r)
    EXPECT_FALSE(ex->context(r).allocator().device_may_run_communication_kernels());
  // One rank's transport marks every rank's allocator: ranks may share a device.
  set(true);
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(ex->context(r).allocator().device_may_run_communication_kernels()) << r;
  set(false);
  for (int r = 0; r < 2; ++r)
    EXPECT_FALSE(ex->context(r).allocator().device_may_run_communication_kernels()) << r;
}

// The ranks on one device draw from one cap, the one the memory check adds their estimates up
// against; without a cap each allocator counts alone.
TEST(Executor, RanksOnOneDeviceShareItsMemoryCap) {
  const ModelDescription model = reference_model(test_model());
  const auto executor = [&](size_t limit) {
    ExecutorOptions options;
    options.transport_timeout = std::chrono::milliseconds(60000);
    options.device_options.memory_limit_bytes = limit;
    return std::make_unique<PipelineExecutor>(
        model, schedule::generate(ScheduleKind::k1F1B, 3, 3),
        stage_ranges(model, partition_blocks(model, 3, PartitionSpec::uniform())),
        std::vector<Device>(3, Device::cpu()), test_optimizer(), /*seed=*/17, options);
  };
  constexpr size_t kCap = size_t{64} << 20;
  auto capped = executor(kCap);
  const auto& budget = capped->context(0).allocator().budget();
  EXPECT_EQ(budget->limit_bytes(), kCap);
  EXPECT_EQ(budget->allocators(), 3);
  size_t reserved = 0;
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(capped->context(r).allocator().budget(), budget) << r;
    reserved += capped->context(r).allocator().stats().reserved_bytes;
  }
  EXPECT_EQ(budget->reserved_bytes(), reserved);
  EXPECT_GT(reserved, 0u);
  auto uncapped = executor(0);
  EXPECT_NE(uncapped->context(0).allocator().budget(), uncapped->context(1).allocator().budget());
  EXPECT_EQ(uncapped->context(0).allocator().stats().limit_shared_by, 1);
}

// Ranges that skip a unit would train without it; ranges that overlap would build a unit on two
// stages: both are refused before a rank is built, as are ranges that miss either end.
TEST(Executor, StageRangesMustCutEveryUnitOnceInOrder) {
  const ModelDescription model = reference_model(test_model());  // 8 units
  const struct {
    std::vector<StageRange> ranges;
    std::string why;
  } cases[] = {
      {{{0, 2}, {3, 8}}, "stage 1 begins at unit 3, where stage 0 ended at 2"},
      {{{0, 3}, {2, 8}}, "stage 1 begins at unit 2, where stage 0 ended at 3"},
      {{{1, 2}, {2, 8}}, "stage 0 begins at unit 1, not at unit 0"},
      {{{0, 2}, {2, 7}}, "the last stage, 1, ends at unit 7"},
      {{{0, 0}, {0, 8}}, "stage 0 is [0, 0), which holds no unit"},
  };
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  for (const auto& c : cases) {
    try {
      PipelineExecutor ex(model, schedule::generate(ScheduleKind::k1F1B, 2, 2), c.ranges,
                          {Device::cpu(), Device::cpu()}, test_optimizer(), 17, options);
      ADD_FAILURE() << "ranges were taken: " << c.why;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "stage ranges must cover units [0, 8) in order; " + c.why);
    }
  }
}

// A deadline is now() + timeout: milliseconds::max() overflowed the clock's nanoseconds into a
// deadline already past, and 0 or less failed the first wait at once.
// What building a two-stage 1F1B executor of `model` with `options` is refused with, or
// "(accepted)".
std::string executor_refusal(const ModelDescription& model, const std::vector<StageRange>& ranges,
                             const ExecutorOptions& options) {
  try {
    PipelineExecutor ex(model, schedule::generate(ScheduleKind::k1F1B, 2, 2), ranges,
                        {Device::cpu(), Device::cpu()}, test_optimizer(), 17, options);
  } catch (const std::invalid_argument& e) {
    return std::string(e.what());
  }
  return std::string("(accepted)");
}

TEST(Executor, ATransportTimeoutOutsideOneMsToItsBoundIsRefused) {
  const ModelDescription model = reference_model(test_model());
  const auto ranges = stage_ranges(model, partition_blocks(model, 2, PartitionSpec::uniform()));
  auto refusal = [&](std::chrono::milliseconds timeout) {
    ExecutorOptions options;
    options.transport_timeout = timeout;
    return executor_refusal(model, ranges, options);
  };
  const std::string expected =
      "ExecutorOptions::transport_timeout must be from 1 ms to 1000000000 ms (10^6 s), got ";
  EXPECT_EQ(refusal(std::chrono::milliseconds(0)), expected + "0 ms");
  EXPECT_EQ(refusal(std::chrono::milliseconds(-5)), expected + "-5 ms");
  EXPECT_EQ(refusal(std::chrono::milliseconds::max()),
            expected + std::to_string(std::chrono::milliseconds::max().count()) + " ms");
  EXPECT_EQ(refusal(std::chrono::milliseconds(ExecutorOptions::kMaxTransportTimeoutMs + 1)),
            expected + "1000000001 ms");
  // The bound itself runs a step.
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(ExecutorOptions::kMaxTransportTimeoutMs);
  PipelineExecutor ex(model, schedule::generate(ScheduleKind::k1F1B, 2, 2), ranges,
                      {Device::cpu(), Device::cpu()}, test_optimizer(), 17, options);
  EXPECT_TRUE(std::isfinite(ex.run_step(make_microbatches(2, 5, 1), 0.1f, 1, 1e-2).loss_sum));
}

// A program sets the options directly, so an enum value made by a cast is refused by name: a
// recompute kind outside the enum recomputed nothing without a word.
TEST(Executor, EnumOptionsOutsideTheirEnumsAreRefusedNamingTheField) {
  const ModelDescription model = reference_model(test_model());
  const auto ranges = stage_ranges(model, partition_blocks(model, 2, PartitionSpec::uniform()));
  auto refusal = [&](const ExecutorOptions& options) {
    return executor_refusal(model, ranges, options);
  };
  ExecutorOptions options;
  options.transport = static_cast<TransportKind>(9);
  EXPECT_EQ(refusal(options),
            "ExecutorOptions::transport must be TransportKind::kAuto, kInProcess, kNccl, kMpi or "
            "kNcclOverMpi, got the value 9");
  options = {};
  options.recompute.kind = static_cast<RecomputeSpec::Kind>(9);
  EXPECT_EQ(refusal(options),
            "ExecutorOptions::recompute.kind must be RecomputeSpec::Kind::kNone, kStage or kUnits, "
            "got the value 9");
}

// partition_blocks is called by programs too: a kind made by a cast said "partition  has 0
// stages", which names neither the field nor the value.
TEST(Partition, AKindOutsideTheEnumIsRefusedNamingTheField) {
  const ModelDescription model = reference_model(test_model());
  PartitionSpec spec;
  spec.kind = static_cast<PartitionSpec::Kind>(9);
  try {
    partition_blocks(model, 2, spec);
    ADD_FAILURE() << "partition kind 9 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "PartitionSpec::kind must be PartitionSpec::Kind::kUniform, kParameters or kBlocks, "
              "got the value 9");
  }
}

TEST(Executor, MismatchedInputsAreClearErrors) {
  auto ex = make_executor(schedule::generate(ScheduleKind::k1F1B, 2, 2));
  EXPECT_THROW(ex->run_step(make_microbatches(3, 5, 1), 0.1f, 1, 1e-2), std::invalid_argument);
  const ModelDescription model = reference_model(test_model());
  const auto blocks = [](std::vector<int64_t> counts) {
    return PartitionSpec::explicit_blocks(std::move(counts));
  };
  EXPECT_THROW(partition_blocks(model, 9, PartitionSpec::uniform()), std::invalid_argument);
  EXPECT_THROW(partition_blocks(model, 3, blocks({1, 2})), std::invalid_argument);
  EXPECT_THROW(partition_blocks(model, 3, blocks({2, 0, 4})),
               std::invalid_argument);  // empty middle
  EXPECT_THROW(partition_blocks(model, 3, blocks({-1, 4, 3})), std::invalid_argument);
  EXPECT_EQ(partition_blocks(model, 3, blocks({2, 3, 1})), (std::vector<int64_t>{2, 3, 1}));
}

TEST(Partition, UniformAndParameterBalanced) {
  ModelConfig config = test_model();
  const ModelDescription model = reference_model(config);
  const PartitionSpec uniform = PartitionSpec::uniform();
  EXPECT_EQ(partition_blocks(model, 1, uniform), (std::vector<int64_t>{6}));
  EXPECT_EQ(partition_blocks(model, 4, uniform), (std::vector<int64_t>{1, 2, 2, 1}));
  EXPECT_EQ(partition_blocks(model, 8, uniform), (std::vector<int64_t>{0, 1, 1, 1, 1, 1, 1, 0}));
  const auto ranges = stage_ranges(model, {1, 2, 2, 1});
  EXPECT_EQ(ranges.front(), (StageRange{0, 2}));
  EXPECT_EQ(ranges.back(), (StageRange{6, 8}));
  // With a huge vocabulary the head alone outweighs blocks: the balanced cut isolates it.
  config.vocab = 5000;
  const ModelDescription wide = reference_model(config);
  const auto balanced = partition_blocks(wide, 3, PartitionSpec::by_parameters());
  EXPECT_EQ(balanced.back(), 0);
  const auto w = wide.unit_parameter_counts();
  EXPECT_EQ(static_cast<int64_t>(w.size()), config.num_units());
}

}  // namespace
}  // namespace conveyor
