// The CPU kernels' thread pool, and the kernels that use it: every task runs once, failures
// reach the caller, and 1, 2 and 3 threads give the same bits (work is split by output
// ranges whose bounds depend on the shape only).
#include "kernels/thread_pool.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "kernels/activation.h"
#include "kernels/cross_entropy.h"
#include "kernels/layernorm.h"
#include "kernels/linear.h"
#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {
namespace {

namespace k = conveyor::kernels::cpu;

TEST(ThreadPool, RunsEveryTaskOnceAcrossManyJobs) {
  k::ThreadPool pool(3);
  EXPECT_EQ(pool.threads(), 3);
  for (int64_t tasks : {1, 2, 3, 7, 64, 1000}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(tasks));
    pool.parallel_for(tasks, [&](int64_t i) { hits[i].fetch_add(1); });
    for (int64_t i = 0; i < tasks; ++i) EXPECT_EQ(hits[i].load(), 1) << "task " << i;
  }
}

TEST(ThreadPool, RethrowsATaskFailureAndStaysUsable) {
  k::ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_for(8,
                                 [](int64_t i) {
                                   if (i == 5) throw std::runtime_error("task 5 failed");
                                 }),
               std::runtime_error);
  std::atomic<int64_t> sum{0};
  pool.parallel_for(10, [&](int64_t i) { sum += i; });
  EXPECT_EQ(sum.load(), 45);
}

// A lost wake-up hangs instead of failing: this ends the test binary, naming the test, when
// the scope it guards outlives `limit`.
class Watchdog {
 public:
  Watchdog(const char* what, std::chrono::seconds limit)
      : thread_([this, what, limit] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!done_cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "%s: still running after %lld s (a thread was never woken)\n",
                         what, static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_one();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;
};

// Between jobs the workers spin a while and then sleep; the caller, waiting for a worker,
// does the same. Every round below takes each path: jobs back to back (spinning workers),
// jobs after a pause longer than any spin (sleeping workers, woken), and a worker's task that
// outlasts the caller's spin (the caller asleep, woken by the last worker).
TEST(ThreadPool, WakesSpinningAndSleepingThreads) {
  using std::chrono::milliseconds;
  const Watchdog watchdog("WakesSpinningAndSleepingThreads", std::chrono::seconds(30));
  k::ThreadPool pool(3);
  for (int round = 0; round < 5; ++round) {
    for (int job = 0; job < 200; ++job) {
      std::vector<std::atomic<int>> hits(7);
      pool.parallel_for(7, [&](int64_t i) { hits[i].fetch_add(1); });
      for (auto& h : hits) ASSERT_EQ(h.load(), 1);
    }
    std::this_thread::sleep_for(milliseconds(5));
    std::atomic<int64_t> sum{0};
    pool.parallel_for(3, [&](int64_t i) {
      if (i > 0) std::this_thread::sleep_for(milliseconds(3));
      sum += i + 1;
    });
    EXPECT_EQ(sum.load(), 6);
    std::this_thread::sleep_for(milliseconds(5));
    EXPECT_THROW(pool.parallel_for(2,
                                   [](int64_t i) {
                                     std::this_thread::sleep_for(milliseconds(2));
                                     if (i == 1) throw std::runtime_error("slow task failed");
                                   }),
                 std::runtime_error);
  }
}

TEST(ThreadPool, StopsWhetherItsWorkersSpinOrSleep) {
  const Watchdog watchdog("StopsWhetherItsWorkersSpinOrSleep", std::chrono::seconds(30));
  { k::ThreadPool fresh(3); }  // workers still spinning for a first job
  {
    k::ThreadPool used(3);
    used.parallel_for(5, [](int64_t) {});
  }  // workers spinning after a job
  {
    k::ThreadPool idle(3);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }  // workers asleep
}

TEST(ThreadPool, RejectsZeroThreads) { EXPECT_THROW(k::ThreadPool(0), std::invalid_argument); }

struct Outputs {
  std::vector<float> y, dx, dw, db, ln_y, ln_mean, ln_rstd, ln_dx, ln_dg, ln_db, gelu, dgelu,
      ce_loss, ce_dlogits;
};

// Sizes large enough that every kernel splits into many tasks, with ragged last tiles.
Outputs run_kernels(k::ThreadPool* pool) {
  const int64_t n = 701, in = 129, out = 600;
  const auto x = random_floats(n * in, 91);
  const auto w = random_floats(out * in, 92);
  const auto b = random_floats(out, 93);
  const auto dy = random_floats(n * out, 94);
  Outputs o;
  o.y.assign(n * out, 7.0f);
  o.dx.assign(n * in, 7.0f);
  o.dw = random_floats(out * in, 95);
  o.db = random_floats(out, 96);
  k::linear_forward(o.y.data(), x.data(), w.data(), b.data(), n, in, out, pool);
  k::linear_backward_input(o.dx.data(), dy.data(), w.data(), n, in, out, pool);
  k::linear_backward_weight(o.dw.data(), o.db.data(), dy.data(), x.data(), n, in, out, pool);

  const auto gamma = random_floats(out, 97);
  const auto beta = random_floats(out, 98);
  o.ln_y.assign(n * out, 7.0f);
  o.ln_mean.assign(n, 7.0f);
  o.ln_rstd.assign(n, 7.0f);
  o.ln_dx.assign(n * out, 7.0f);
  o.ln_dg = random_floats(out, 99);
  o.ln_db = random_floats(out, 100);
  k::layernorm_forward(o.ln_y.data(), o.ln_mean.data(), o.ln_rstd.data(), o.y.data(), gamma.data(),
                       beta.data(), n, out, 1e-5f, pool);
  k::layernorm_backward_input(o.ln_dx.data(), dy.data(), o.y.data(), o.ln_mean.data(),
                              o.ln_rstd.data(), gamma.data(), n, out, pool);
  k::layernorm_backward_weight(o.ln_dg.data(), o.ln_db.data(), dy.data(), o.y.data(),
                               o.ln_mean.data(), o.ln_rstd.data(), n, out, pool);
  o.gelu.assign(n * out, 7.0f);
  o.dgelu.assign(n * out, 7.0f);
  k::gelu_forward(o.gelu.data(), o.y.data(), n * out, pool);
  k::gelu_backward(o.dgelu.data(), dy.data(), o.y.data(), n * out, pool);
  // Rows of o.y as logits over a vocabulary of `out`, so that the rows span several tasks.
  std::vector<int32_t> targets(n);
  for (int64_t i = 0; i < n; ++i) targets[i] = static_cast<int32_t>((i * 37) % out);
  targets[5] = -100;  // an ignored row
  o.ce_loss.assign(n, 7.0f);
  o.ce_dlogits.assign(n * out, 7.0f);
  k::softmax_cross_entropy(o.ce_loss.data(), o.ce_dlogits.data(), o.y.data(), targets.data(), n,
                           out, -100, 0.25f, pool);
  return o;
}

void expect_same(const Outputs& a, const Outputs& b) {
  EXPECT_TRUE(same_bits(a.y, b.y));
  EXPECT_TRUE(same_bits(a.dx, b.dx));
  EXPECT_TRUE(same_bits(a.dw, b.dw));
  EXPECT_TRUE(same_bits(a.db, b.db));
  EXPECT_TRUE(same_bits(a.ln_y, b.ln_y));
  EXPECT_TRUE(same_bits(a.ln_mean, b.ln_mean));
  EXPECT_TRUE(same_bits(a.ln_rstd, b.ln_rstd));
  EXPECT_TRUE(same_bits(a.ln_dx, b.ln_dx));
  EXPECT_TRUE(same_bits(a.ln_dg, b.ln_dg));
  EXPECT_TRUE(same_bits(a.ln_db, b.ln_db));
  EXPECT_TRUE(same_bits(a.gelu, b.gelu));
  EXPECT_TRUE(same_bits(a.dgelu, b.dgelu));
  EXPECT_TRUE(same_bits(a.ce_loss, b.ce_loss));
  EXPECT_TRUE(same_bits(a.ce_dlogits, b.ce_dlogits));
}

// In a child process: under an address-space limit a little above what the process maps,
// a pool of 64 threads runs out of room for their stacks part-way. Exits 0 when the pool
// refused with its sentence, the threads it started ended (a running std::thread destroyed
// unjoined would abort the process instead).
[[noreturn]] void start_threads_under_an_address_space_limit() {
  long pages = 0;
  if (std::FILE* statm = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
    std::fclose(statm);
  }
  const rlim_t mapped = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
  const rlimit limit{mapped + (24u << 20), mapped + (24u << 20)};
  if (pages == 0 || setrlimit(RLIMIT_AS, &limit) != 0) std::exit(2);
  try {
    k::ThreadPool pool(64);
  } catch (const std::runtime_error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    std::exit(0);
  }
  std::exit(1);  // all 64 started: the limit was too loose to test anything
}

TEST(ThreadPool, ARefusedThreadEndsTheOnesStartedAndSaysSo) {
  EXPECT_EXIT(start_threads_under_an_address_space_limit(), ::testing::ExitedWithCode(0),
              "cannot start CPU thread [0-9]+ of 64: .*; use fewer threads or raise the "
              "process's limits");
}

TEST(ThreadPoolKernels, OneTwoAndThreeThreadsGiveTheSameBits) {
  const Outputs inline_run = run_kernels(nullptr);
  k::ThreadPool one(1), two(2), three(3);
  expect_same(inline_run, run_kernels(&one));
  expect_same(inline_run, run_kernels(&two));
  expect_same(inline_run, run_kernels(&three));
}

}  // namespace
}  // namespace conveyor::testing
