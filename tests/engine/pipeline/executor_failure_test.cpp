// Which failure a failed step reports: the one that started it, told from the ranks it
// stopped by the transport's typed abort error, never by the text of a message.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include "comm/in_process.h"
#include "engine/pipeline/executor.h"
#include "engine/pipeline/rank_threads.h"
#include "engine/schedule/generators.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"
#include "support/executor_fixture.h"
#include "support/throwing_layer.h"

namespace conveyor {
namespace {

using namespace conveyor::testing;

// An in-process endpoint that throws `message` on its n-th send or on its all-reduce; an
// empty `message` throws std::bad_alloc there, as a failed host allocation does.
class FaultyTransport : public comm::Transport {
 public:
  FaultyTransport(std::unique_ptr<comm::Transport> inner, int fail_at_send, bool fail_reduce,
                  std::string message)
      : inner_(std::move(inner)),
        fail_at_send_(fail_at_send),
        fail_reduce_(fail_reduce),
        message_(std::move(message)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void send(const Tensor& t, int peer, const Stream& s) override {
    if (++sends_ == fail_at_send_) {
      if (message_.empty()) throw std::bad_alloc();
      throw std::runtime_error(message_);
    }
    inner_->send(t, peer, s);
  }
  void recv(const Tensor& t, int peer, const Stream& s) override { inner_->recv(t, peer, s); }
  bool try_recv(const Tensor& t, int peer, const Stream& s) override {
    return inner_->try_recv(t, peer, s);
  }
  void all_reduce_sum(std::vector<double>& v) override {
    if (fail_reduce_) throw std::runtime_error(message_);
    inner_->all_reduce_sum(v);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<comm::Transport> inner_;
  int fail_at_send_;
  bool fail_reduce_;
  std::string message_;
  int sends_ = 0;
};

// Runs one step of 1F1B over 3 ranks where rank `faulty` fails as told; returns the error.
std::string failed_step(int faulty, int fail_at_send, bool fail_reduce,
                        const std::string& message) {
  auto ex = make_executor(schedule::generate(schedule::ScheduleKind::k1F1B, 3, 4));
  auto hub = comm::InProcessHub::create(3, std::chrono::milliseconds(60000));
  std::vector<std::unique_ptr<comm::Transport>> transports;
  for (int r = 0; r < 3; ++r) {
    auto endpoint = hub->endpoint(r);
    if (r == faulty)
      endpoint = std::make_unique<FaultyTransport>(std::move(endpoint), fail_at_send, fail_reduce,
                                                   message);
    transports.push_back(std::move(endpoint));
  }
  ex->set_transports(std::move(transports));
  try {
    ex->run_step(make_microbatches(4, 5, 1), 0.05f, 1, 1e-2);
  } catch (const PipelineError& e) {
    return e.what();
  }
  ADD_FAILURE() << "the step succeeded despite the failing rank";
  return "";
}

TEST(ExecutorFailure, TheRootFailureIsReportedEvenWhenItsTextMentionsAnAbort) {
  // The last rank fails on its first gradient send; ranks 0 and 1, stopped by the abort,
  // come first in rank order but are not what started it.
  const std::string what = failed_step(2, 1, false, "link lost: pipeline aborted by the peer");
  EXPECT_EQ(what.rfind("rank 2, action ", 0), 0u) << what;
  EXPECT_NE(what.find("(SG2."), std::string::npos) << what;
  EXPECT_NE(what.find("link lost: pipeline aborted by the peer"), std::string::npos) << what;
}

TEST(ExecutorFailure, AFailureOutsideAnyActionIsTheRootToo) {
  // Rank 1 fails in the end-of-step all-reduce; the others, waiting in it, are aborted.
  const std::string what = failed_step(1, 0, true, "injected all-reduce failure");
  EXPECT_EQ(what, "injected all-reduce failure");
}

TEST(ExecutorFailure, AFailedHostAllocationIsSaidAsOne) {
  // std::bad_alloc's own text is "std::bad_alloc", which the error printed as it was.
  const std::string what = failed_step(2, 1, false, "");
  EXPECT_EQ(what.rfind("rank 2, action ", 0), 0u) << what;
  EXPECT_NE(what.find("out of memory on the host"), std::string::npos) << what;
  EXPECT_EQ(what.find("std::bad_alloc"), std::string::npos) << what;
}

// An in-process endpoint whose n-th send stalls for `stall` before it goes out, as on a
// rank stopped by SIGSTOP: its peers' waits pass their deadline meanwhile.
class StallingTransport : public comm::Transport {
 public:
  StallingTransport(std::unique_ptr<comm::Transport> inner, int stall_at_send,
                    std::chrono::milliseconds stall)
      : inner_(std::move(inner)), stall_at_send_(stall_at_send), stall_(stall) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void send(const Tensor& t, int peer, const Stream& s) override {
    if (++sends_ == stall_at_send_) std::this_thread::sleep_for(stall_);
    inner_->send(t, peer, s);
  }
  void recv(const Tensor& t, int peer, const Stream& s) override { inner_->recv(t, peer, s); }
  bool try_recv(const Tensor& t, int peer, const Stream& s) override {
    return inner_->try_recv(t, peer, s);
  }
  void all_reduce_sum(std::vector<double>& v) override { inner_->all_reduce_sum(v); }
  std::unique_ptr<comm::PendingGroupCall> start_group_sum(std::vector<float>& values,
                                                          const std::vector<int>& group) override {
    return inner_->start_group_sum(values, group);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }

 private:
  std::unique_ptr<comm::Transport> inner_;
  int stall_at_send_;
  std::chrono::milliseconds stall_;
  int sends_ = 0;
};

// The line of `text` that starts with `prefix`, or "" when none does.
std::string line_starting(const std::string& text, const std::string& prefix) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind(prefix, 0) == 0) return line;
  return "";
}

// Runs one step of `sched` over in-process transports with a 1 s deadline, `stalled` rank
// sleeping 2.5 s in its first send, and returns the error the step fails with.
std::string error_of_a_stalled_step(const schedule::Schedule& sched, int world, int stalled) {
  auto ex = make_executor(sched);
  auto hub = comm::InProcessHub::create(world, std::chrono::milliseconds(1000));
  std::vector<std::unique_ptr<comm::Transport>> transports;
  for (int r = 0; r < world; ++r) {
    auto endpoint = hub->endpoint(r);
    if (r == stalled)
      endpoint = std::make_unique<StallingTransport>(std::move(endpoint), 1,
                                                     std::chrono::milliseconds(2500));
    transports.push_back(std::move(endpoint));
  }
  ex->set_transports(std::move(transports));
  try {
    ex->run_step(make_microbatches(4, 5, 1), 0.05f, 1, 1e-2);
    ADD_FAILURE() << "the step succeeded despite the stalled rank";
  } catch (const PipelineError& e) {
    return e.what();
  }
  return "";
}

// Position of the action written `token` in row `row` of `sched`, as text.
std::string position_of(const schedule::Schedule& sched, int row, const std::string& token) {
  const auto& list = sched.ranks[row];
  for (size_t i = 0; i < list.size(); ++i)
    if (schedule::to_string(list[i]) == token) return std::to_string(i);
  ADD_FAILURE() << token << " is not in row " << row;
  return "";
}

TEST(ExecutorFailure, AStalledRunShowsEveryRanksPositionAndWhatItWaitsOn) {
  // 1F1B over 3 ranks; rank 2 stalls in its first send (SG2.0>1) for longer than the 1 s
  // deadline. Rank 1 waits for that gradient in RG1.0<2, rank 0 for rank 1's first gradient
  // in RG0.0<1; whichever deadline passes first fails the step.
  const auto sched = schedule::generate(schedule::ScheduleKind::k1F1B, 3, 4);
  const std::string what = error_of_a_stalled_step(sched, 3, 2);
  // The one-line error comes first, as without the grid.
  const std::string first_line = what.substr(0, what.find('\n'));
  EXPECT_EQ(first_line.rfind("rank ", 0), 0u) << what;
  EXPECT_NE(first_line.find("nothing arrived from rank "), std::string::npos) << what;
  // Where each rank stood, marked in the grid and named on its own line.
  const auto position = [&](int rank, const std::string& token) {
    return position_of(sched, rank, token);
  };
  const struct {
    int rank;
    std::string token, doing;
  } expected[] = {
      {0, "RG0.0<1",
       "at action " + position(0, "RG0.0<1") + " (RG0.0<1), waiting for a message from rank 1"},
      {1, "RG1.0<2",
       "at action " + position(1, "RG1.0<2") + " (RG1.0<2), waiting for a message from rank 2"},
      {2, "SG2.0>1", "running action " + position(2, "SG2.0>1") + " (SG2.0>1)"},
  };
  for (const auto& e : expected) {
    EXPECT_NE(what.find(">>" + e.token + "<<"), std::string::npos) << e.token << "\n" << what;
    const std::string line = line_starting(what, "rank " + std::to_string(e.rank) + ": ");
    EXPECT_EQ(line.rfind("rank " + std::to_string(e.rank) + ": " + e.doing + "; heads: ", 0), 0u)
        << what;
  }
  EXPECT_EQ(line_starting(what, "rank(s) "), "") << "every rank is known in one process";
}

TEST(ExecutorFailure, AStalledReplicaLeavesTheOtherWaitingInItsGradientSums) {
  // (P, D) = (2, 2), 1F1B: rank 3 (pipeline rank 1 of replica 1) stalls in its first send
  // (SG1.0>0), so rank 2 waits for that gradient, and replica 0, done with its pipeline,
  // waits in each stage's sum for its partner in replica 1.
  const auto sched = schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2, 1, 2);
  const std::string what = error_of_a_stalled_step(sched, 4, 3);
  const auto at = [&](int row, const std::string& token) { return position_of(sched, row, token); };
  const std::pair<int, std::string> expected[] = {
      {0, "(row r0, replica 0): at action " + at(0, "AR0") +
              " (AR0), waiting for the gradient sum with rank(s) 2"},
      {1, "(row r1, replica 0): at action " + at(1, "AR1") +
              " (AR1), waiting for the gradient sum with rank(s) 3"},
      {2, "(row r0, replica 1): at action " + at(0, "RG0.0<1") +
              " (RG0.0<1), waiting for a message from rank 3"},
      {3, "(row r1, replica 1): running action " + at(1, "SG1.0>0") + " (SG1.0>0)"},
  };
  for (const auto& [rank, doing] : expected) {
    const std::string line = line_starting(what, "rank " + std::to_string(rank) + " ");
    EXPECT_EQ(line.rfind("rank " + std::to_string(rank) + " " + doing + "; heads: ", 0), 0u)
        << what;
  }
  EXPECT_NE(what.find(">>"), std::string::npos) << what;
}

using testing::ThrowsAnInt;

// embed -> pass -> pass -> head over two stages of two units; unit `thrower` throws an int in
// its backward. Returns the PipelineError's text ("" and a failure when none came).
std::string error_of_a_foreign_throw(int64_t thrower) {
  ModelDescription model;
  model.name = "throws an int";
  model.num_units = 4;
  model.vocab = 19;
  model.activation = activation_rows(8);
  model.make_unit = [thrower](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 0) return std::make_unique<Embedding>("embed", 19, 8);
    if (index == 3) return std::make_unique<LossHead>("head", 8, 19);
    if (index == thrower) return std::make_unique<ThrowsAnInt>();
    return std::make_unique<Linear>("linear." + std::to_string(index), 8, 8);
  };
  ExecutorOptions options;
  options.transport_timeout = std::chrono::milliseconds(60000);
  PipelineExecutor ex(model, schedule::generate(schedule::ScheduleKind::k1F1B, 2, 2),
                      {{0, 2}, {2, 4}}, {Device::cpu(), Device::cpu()}, test_optimizer(), 3,
                      options);
  try {
    ex.run_step(make_microbatches(2, 5, 1), 0.1f, 1, 1e-2);
  } catch (const PipelineError& e) {
    return e.what();
  }
  ADD_FAILURE() << "the step succeeded despite the throwing unit";
  return "";
}

TEST(ExecutorFailure, AUnitThrowingWhatIsNotAStdExceptionFailsTheStep) {
  // Unit 1 runs on rank 0, the calling thread; unit 2 on rank 1, a thread of its own, where
  // an exception let out would end the process.
  for (int64_t unit : {1, 2}) {
    const std::string what = error_of_a_foreign_throw(unit);
    EXPECT_EQ(what.rfind("rank " + std::to_string(unit - 1) + ", action ", 0), 0u) << what;
    EXPECT_NE(what.find("unit " + std::to_string(unit) +
                        " ('thrower') threw an exception not derived from std::exception"),
              std::string::npos)
        << what;
  }
}

TEST(RankThreads, AnExceptionAJobLetsOutIsRethrownAfterEveryRankFinished) {
  RankThreads threads(3);
  for (int thrower : {0, 2}) {
    std::atomic<int> finished{0};
    try {
      threads.run([&](int r) {
        if (r == thrower) throw r + 10;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        ++finished;
      });
      ADD_FAILURE() << "rank " << thrower << "'s exception was lost";
    } catch (int e) {
      EXPECT_EQ(e, thrower + 10);
    }
    EXPECT_EQ(finished.load(), 2) << "run returned before the other ranks finished";
  }
  // The threads still run jobs.
  std::atomic<int> ran{0};
  threads.run([&](int) { ++ran; });
  EXPECT_EQ(ran.load(), 3);
}

}  // namespace
}  // namespace conveyor
