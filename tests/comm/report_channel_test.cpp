// A transport whose tensors go over one transport and whose failure reports over another:
// the data calls reach the data transport alone, the reports the report transport alone, an
// abort both.
#include "comm/report_channel.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "comm/in_process.h"
#include "engine/core/device_context.h"
#include "support/tensor_values.h"
#include "support/test_util.h"

namespace conveyor::comm {
namespace {

using namespace std::chrono_literals;

// A report transport that answers with canned reports and records what it was asked; its
// data calls must never be made.
class RecordingReports : public Transport {
 public:
  struct Log {
    int collected = 0;
    std::vector<std::byte> report;
    int collector = -1;
    std::chrono::milliseconds grace{0};
    std::vector<std::string> aborts;
    std::string peer_abort;                // another rank's abort notice, once heard
    std::atomic<bool> heard_abort{false};  // set after peer_abort, from any thread
    std::atomic<int> polls{0};
  };
  RecordingReports(int rank, int size, std::shared_ptr<Log> log)
      : rank_(rank), size_(size), log_(std::move(log)) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void send(const Tensor&, int, const Stream&) override { ADD_FAILURE() << "send on reports"; }
  void recv(const Tensor&, int, const Stream&) override { ADD_FAILURE() << "recv on reports"; }
  bool try_recv(const Tensor&, int, const Stream&) override {
    ADD_FAILURE() << "try_recv on reports";
    return false;
  }
  void all_reduce_sum(std::vector<double>&) override { ADD_FAILURE() << "all-reduce on reports"; }
  void abort(const std::string& reason) override { log_->aborts.push_back(reason); }
  void poll_abort() override {
    ++log_->polls;
    if (log_->heard_abort.load()) throw TransportAborted(rank_, log_->peer_abort);
  }
  std::map<int, std::vector<std::byte>> collect_failure_reports(
      const std::vector<std::byte>& report, int collector,
      std::chrono::milliseconds grace) override {
    ++log_->collected;
    log_->report = report, log_->collector = collector, log_->grace = grace;
    return {{1, {std::byte{7}, std::byte{8}}}};
  }

 private:
  int rank_, size_;
  std::shared_ptr<Log> log_;
};

using testing::filled;

TEST(ReportChannel, TensorsAndSumsGoOverTheDataTransport) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto log = std::make_shared<RecordingReports::Log>();
  auto a = with_reports_over(hub->endpoint(0), std::make_unique<RecordingReports>(0, 2, log));
  auto b = with_reports_over(hub->endpoint(1), std::make_unique<RecordingReports>(1, 2, log));
  EXPECT_EQ(a->rank(), 0);
  EXPECT_EQ(b->rank(), 1);
  EXPECT_EQ(a->size(), 2);
  DeviceContext ctx(Device::cpu());
  Stream& s = ctx.compute_stream();
  const auto values = testing::random_floats(5, 3);
  a->send(filled(ctx, values), 1, s);
  a->send(filled(ctx, values), 1, s);
  Tensor got = ctx.empty({5});
  b->recv(got, 0, s);
  EXPECT_EQ(to_vector_f32(got), values);
  ASSERT_TRUE(b->try_recv(got, 0, s));
  EXPECT_EQ(to_vector_f32(got), values);
  b->synchronize(s);

  std::vector<double> sum_a{1.5, 2.0}, sum_b{0.25, -2.0};
  std::thread other([&] { b->all_reduce_sum(sum_b); });
  a->all_reduce_sum(sum_a);
  other.join();
  EXPECT_EQ(sum_a, (std::vector<double>{1.75, 0.0}));
  EXPECT_EQ(sum_b, sum_a);

  std::vector<float> group_a{1, 2, 3, 4}, group_b{10, 20, 30, 40};
  auto pa = a->start_group_sum(group_a, {0, 1});
  auto pb = b->start_group_sum(group_b, {0, 1});
  pa->wait();
  pb->wait();
  EXPECT_EQ(group_a, (std::vector<float>{11, 22, 33, 44}));
  EXPECT_EQ(group_b, group_a);
  EXPECT_EQ(log->collected, 0);
  EXPECT_TRUE(log->aborts.empty());
}

TEST(ReportChannel, ReportsGoOverTheReportTransportAndAnAbortOverBoth) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto log = std::make_shared<RecordingReports::Log>();
  auto a = with_reports_over(hub->endpoint(0), std::make_unique<RecordingReports>(0, 2, log));
  auto b = with_reports_over(hub->endpoint(1), std::make_unique<RecordingReports>(1, 2, log));
  const std::vector<std::byte> mine{std::byte{1}, std::byte{2}, std::byte{3}};
  const auto reports = a->collect_failure_reports(mine, 0, 250ms);
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports.at(1), (std::vector<std::byte>{std::byte{7}, std::byte{8}}));
  EXPECT_EQ(log->collected, 1);
  EXPECT_EQ(log->report, mine);
  EXPECT_EQ(log->collector, 0);
  EXPECT_EQ(log->grace, 250ms);

  a->abort("rank 0 gave up");
  EXPECT_EQ(log->aborts, (std::vector<std::string>{"rank 0 gave up"}));
  // The data transport is aborted for every rank: the other one's receive fails at once.
  DeviceContext ctx(Device::cpu());
  Tensor got = ctx.empty({1});
  try {
    b->recv(got, 0, ctx.compute_stream());
    ADD_FAILURE() << "a receive on an aborted transport returned";
  } catch (const TransportAborted& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 gave up"), std::string::npos) << e.what();
  }
}

// A data transport whose receive waits by polling, as NCCL's do: it asks the check it was
// given until its deadline.
class PollingData : public Transport {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void send(const Tensor&, int, const Stream&) override {}
  void recv(const Tensor&, int, const Stream&) override {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < deadline) {
      if (check_) check_();
      std::this_thread::sleep_for(1ms);
    }
    throw TransportError("rank 0: nothing arrived within 5000 ms");
  }
  bool try_recv(const Tensor&, int, const Stream&) override { return false; }
  void all_reduce_sum(std::vector<double>&) override {}
  void abort(const std::string&) override {}
  void check_while_waiting(std::function<void()> check) override { check_ = std::move(check); }

 private:
  std::function<void()> check_;
};

TEST(ReportChannel, AnAbortNoticeOverTheReportsEndsADataWait) {
  auto log = std::make_shared<RecordingReports::Log>();
  auto channel = with_reports_over(std::make_unique<PollingData>(),
                                   std::make_unique<RecordingReports>(0, 2, log));
  DeviceContext ctx(Device::cpu());
  Tensor got = ctx.empty({1});
  channel->poll_abort();  // nothing heard yet
  EXPECT_EQ(log->polls, 1);

  // The notice arrives while the data transport waits: the wait ends with it, long before
  // its own deadline.
  const auto start = std::chrono::steady_clock::now();
  log->peer_abort = "rank 1: CUDA error in F1.3";
  std::thread notice([&] {
    std::this_thread::sleep_for(20ms);
    log->heard_abort.store(true);
  });
  try {
    channel->recv(got, 1, ctx.compute_stream());
    ADD_FAILURE() << "the receive returned";
  } catch (const TransportAborted& e) {
    EXPECT_EQ(e.reason(), "rank 1: CUDA error in F1.3");
  }
  notice.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
  EXPECT_GT(log->polls, 1);
  EXPECT_THROW(channel->poll_abort(), TransportAborted);
}

TEST(ReportChannel, RefusesEndpointsOfDifferentRanks) {
  auto hub = InProcessHub::create(2, 5000ms);
  auto log = std::make_shared<RecordingReports::Log>();
  EXPECT_THROW(with_reports_over(hub->endpoint(0), std::make_unique<RecordingReports>(1, 2, log)),
               std::invalid_argument);
  EXPECT_THROW(with_reports_over(hub->endpoint(0), std::make_unique<RecordingReports>(0, 3, log)),
               std::invalid_argument);
  EXPECT_THROW(with_reports_over(hub->endpoint(0), nullptr), std::invalid_argument);
}

}  // namespace
}  // namespace conveyor::comm
