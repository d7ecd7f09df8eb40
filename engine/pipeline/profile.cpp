#include "engine/pipeline/profile.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <exception>
#include <latch>
#include <random>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "comm/in_process.h"
#include "engine/pipeline/identical_units.h"
#include "engine/pipeline/profile_samples.h"
#include "engine/pipeline/stage.h"

namespace conveyor {
namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// Before each timed phase on the CPU: streams through 8 MiB (many times an L2, a quarter of
// the test machine's L3), so the unit does not find its own data left hot by its previous
// phase; in a run the other units' work comes between. Timed with their own data hot, the
// units of a two-rank run predicted 16-31 % less compute per rank than the run took; cooled,
// within 10 % (docs/PERF.md).
void cool_caches() {
  static thread_local std::vector<char> buffer(size_t{8} << 20, 1);
  volatile char sink = 0;
  for (size_t i = 0; i < buffer.size(); i += 64) {
    buffer[i] = static_cast<char>(buffer[i] + 1);
    sink = buffer[i];
  }
  (void)sink;
}

// Seconds `run` takes, including the work it queued on the compute stream.
template <class F>
double timed(DeviceContext& ctx, F&& run) {
  ctx.synchronize();
  if (!ctx.is_cuda()) cool_caches();
  const auto start = Clock::now();
  run();
  ctx.synchronize();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

Tensor random_tensor(DeviceContext& ctx, const ActivationSpec& spec, uint64_t seed) {
  if (spec.dtype != DType::kF32)
    throw std::invalid_argument(
        "profiling needs f32 activations between units; the model passes "
        "another dtype");
  Tensor t = ctx.empty(spec.shape, spec.dtype);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> host(static_cast<size_t>(t.numel()));
  for (auto& v : host) v = dist(rng);
  copy_from_host(t, host.data(), t.nbytes());
  return t;
}

Tensor random_ids(DeviceContext& ctx, int64_t n, int64_t vocab, uint64_t seed) {
  Tensor t = ctx.empty({n}, DType::kI32);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> dist(
      0, static_cast<int32_t>(std::max<int64_t>(vocab, 1) - 1));
  std::vector<int32_t> host(static_cast<size_t>(n));
  for (auto& v : host) v = dist(rng);
  copy_from_host(t, host.data(), t.nbytes());
  return t;
}

// One unit built on `ctx` with seeded inputs, run a forward, input gradient and weight
// gradient at a time; what it holds is counted into its cost at every run.
class UnitBench {
 public:
  UnitBench(const ModelDescription& model, int64_t u, DeviceContext& ctx,
            const ProfileOptions& options)
      : ctx_(ctx),
        before_build_(ctx.allocator().stats().allocated_bytes),
        stage_(model, u, u + 1, ctx, options.seed),
        first_(u == 0),
        last_(u + 1 == model.num_units) {
    const int64_t n = options.microbatch_tokens;
    ctx.synchronize();
    double allocated = 0;  // a tensor of each parameter's shape, as the allocator gives it
    for (Parameter* p : stage_.parameters()) {
      cost_.parameter_bytes += static_cast<double>(p->value.nbytes());
      allocated += static_cast<double>(CachingAllocator::round_size(p->value.nbytes()));
    }
    cost_.optimizer_bytes = options.optimizer_slots * allocated;
    cost_.state_bytes =
        static_cast<double>(ctx.allocator().stats().allocated_bytes - before_build_) +
        cost_.optimizer_bytes;
    in_.tokens = n;
    in_.targets = random_ids(ctx, n, model.vocab, options.seed + 17 * u + 1);
    in_.loss_scale = 1.0f / static_cast<float>(n);
    input_ = first_ ? random_ids(ctx, n, model.vocab, options.seed + 17 * u + 2)
                    : random_tensor(ctx, model.activation_at(u, n), options.seed + 17 * u + 3);
    if (!last_) dy_ = random_tensor(ctx, model.activation_at(u + 1, n), options.seed + 17 * u + 4);
    if (!first_)
      cost_.input_bytes = static_cast<double>(CachingAllocator::round_size(input_.nbytes()));
  }

  struct Times {
    double forward = 0, input_grad = 0, weight_grad = 0;
  };

  // One run as micro-batch `microbatch` on fresh copies of the inputs.
  Times run(int64_t microbatch) {
    const size_t before = ctx_.allocator().stats().allocated_bytes;
    // A fresh copy of the input, counted when the unit keeps it (as it does in a stage, where
    // nothing else holds it); the token ids of the first unit are a view of the step's ids.
    Tensor x = input_;
    if (!first_) {
      x = ctx_.empty(input_.shape(), input_.dtype());
      copy_tensor(x, input_, ctx_.compute_stream().native());
    }
    // Each half's peak above what was allocated when it started, or after it ended for the
    // forward (whose saved tensors stay): the unit's workspace.
    CachingAllocator& allocator = ctx_.allocator();
    auto peak_above = [&](size_t level) {
      return static_cast<double>(allocator.stats().peak_allocated_bytes) -
             static_cast<double>(level);
    };
    Times t;
    allocator.reset_peak();
    t.forward = timed(ctx_, [&] { stage_.forward(microbatch, x, in_); });
    x = Tensor();
    // The output went to the next unit; what is still allocated is what the backward keeps.
    const size_t after_forward = allocator.stats().allocated_bytes;
    cost_.activation_bytes = static_cast<double>(after_forward) - static_cast<double>(before);
    double workspace = peak_above(after_forward);
    // The output gradient too is a fresh copy, counted when the unit keeps it for W (in a
    // stage it is the next unit's input gradient, which nothing else holds).
    Tensor g = dy_;
    if (!last_) {
      g = ctx_.empty(dy_.shape(), dy_.dtype());
      copy_tensor(g, dy_, ctx_.compute_stream().native());
    }
    allocator.reset_peak();
    t.input_grad = timed(ctx_, [&] { stage_.backward_input(microbatch, g); });
    g = Tensor();
    workspace = std::max(workspace, peak_above(after_forward));
    const size_t after_input_grad = allocator.stats().allocated_bytes;
    cost_.weight_pending_bytes =
        std::max(0.0, static_cast<double>(after_input_grad) - static_cast<double>(after_forward));
    allocator.reset_peak();
    t.weight_grad = timed(ctx_, [&] { stage_.backward_weight(microbatch); });
    cost_.workspace_bytes = std::max(workspace, peak_above(after_input_grad));
    return t;
  }

  // The bytes counted so far, and no times.
  const UnitCost& cost() const { return cost_; }

 private:
  DeviceContext& ctx_;
  const size_t before_build_;
  Stage stage_;
  const bool first_, last_;
  UnitCost cost_;
  MicroBatchInputs in_;
  Tensor input_, dy_;
};

// The groups of identical units (identical_units.h): each group's first unit stands for it,
// and takes `repetitions` timed runs for each of its members, and for at least kLeastRuns
// members: a unit without a twin would have five runs by default, and the spread around
// their lower quartile (summarize_samples) then comes of two of them.
struct UnitGroups {
  static constexpr int kLeastRuns = 3;

  std::vector<int64_t> leader_of;  // per unit
  std::vector<int64_t> leaders;    // per group
  std::vector<int> timed_runs;     // per group

  UnitGroups(const ModelDescription& model, const ProfileOptions& options) {
    leader_of = options.pool_identical_units
                    ? identical_unit_leaders(model, options.microbatch_tokens)
                    : std::vector<int64_t>();
    if (leader_of.empty())
      for (int64_t u = 0; u < model.num_units; ++u) leader_of.push_back(u);
    for (int64_t u = 0; u < model.num_units; ++u) {
      if (leader_of[u] == u) leaders.push_back(u), timed_runs.push_back(0);
      timed_runs[group_of(u)] += options.repetitions;
    }
    for (int& runs : timed_runs) runs = std::max(runs, kLeastRuns * options.repetitions);
  }
  size_t group_of(int64_t u) const {
    return static_cast<size_t>(std::find(leaders.begin(), leaders.end(), leader_of[u]) -
                               leaders.begin());
  }
};

// Every group's leader built on `ctx` (together: the runs alternate between them), in
// `groups` order.
std::vector<std::unique_ptr<UnitBench>> build_benches(const ModelDescription& model,
                                                      const UnitGroups& groups, DeviceContext& ctx,
                                                      const ProfileOptions& options) {
  std::vector<std::unique_ptr<UnitBench>> benches;
  for (const int64_t u : groups.leaders)
    benches.push_back(std::make_unique<UnitBench>(model, u, ctx, options));
  return benches;
}

// One boundary activation from rank 0 to rank 1 of an in-process hub, both on `ctx`'s device.
double transfer_seconds(const ModelDescription& model, DeviceContext& ctx,
                        const ProfileOptions& options) {
  if (model.num_units < 2) return 0.0;
  const ActivationSpec spec = model.activation_at(1, options.microbatch_tokens);
  auto hub = comm::InProcessHub::create(2, std::chrono::milliseconds(10000));
  auto sender = hub->endpoint(0), receiver = hub->endpoint(1);
  Stream send_stream(ctx.device()), recv_stream(ctx.device());
  const Tensor source = random_tensor(ctx, spec, options.seed + 99);
  const Tensor target = ctx.empty(spec.shape, spec.dtype);
  ctx.synchronize();
  std::vector<double> times;
  for (int rep = 0; rep < options.warmup + options.repetitions; ++rep) {
    const auto start = Clock::now();
    sender->send(source, 1, send_stream);
    receiver->recv(target, 0, recv_stream);
    receiver->synchronize(recv_stream);
    sender->synchronize(send_stream);
    const double t = std::chrono::duration<double>(Clock::now() - start).count();
    if (rep >= options.warmup) times.push_back(t);
  }
  return median(times);
}

// The neighbours of ProfileOptions: each runs the profile's units in its order over and over
// on its own context until stopped. Their first failure is kept for the caller.
class Neighbours {
 public:
  // Returns once every neighbour has built its units and starts on its first run.
  Neighbours(const ModelDescription& model, Device device, const ProfileOptions& options)
      : errors_(static_cast<size_t>(options.neighbours)), started_(options.neighbours) {
    for (int k = 0; k < options.neighbours; ++k)
      threads_.emplace_back([this, &model, device, options, k] {
        bool counted = false;
        try {
          DeviceContext ctx(device, options.neighbour_context);
          ProfileOptions own = options;
          own.seed = options.seed + 1000003 * static_cast<uint64_t>(k + 1);
          const UnitGroups groups(model, own);
          // Built before the measured copy starts, so a neighbour that cannot run fails
          // every time, and its first runs are timed alongside it.
          const auto benches = build_benches(model, groups, ctx, own);
          const auto order = interleaved_runs(groups.timed_runs, 0);
          started_.count_down();
          counted = true;
          for (int64_t run = 0; !stop_.load(); ++run)
            (void)benches[order[run % order.size()].group]->run(run);
        } catch (...) {
          errors_[k] = std::current_exception();
          if (!counted) started_.count_down();
        }
      });
    started_.wait();
  }
  ~Neighbours() { join(); }

  // Stops and joins them; rethrows a neighbour's failure (out of memory, say).
  void finish() {
    join();
    for (auto& e : errors_)
      if (e) std::rethrow_exception(std::exchange(e, nullptr));
  }

 private:
  void join() noexcept {
    stop_.store(true);
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  std::atomic<bool> stop_{false};
  std::vector<std::exception_ptr> errors_;
  std::latch started_;
  std::vector<std::thread> threads_;
};

}  // namespace

UnitCosts profile_units(const ModelDescription& model, DeviceContext& ctx,
                        const ProfileOptions& options) {
  model.validate();
  if (options.microbatch_tokens < 1)
    throw std::invalid_argument("profiling at " + std::to_string(options.microbatch_tokens) +
                                " tokens per micro-batch; expected at least 1");
  if (options.repetitions < 1 || options.warmup < 0)
    throw std::invalid_argument(
        "profiling needs at least one timed repetition and no negative "
        "warm-up; got " +
        std::to_string(options.repetitions) + " and " + std::to_string(options.warmup));
  if (options.optimizer_slots < 0)
    throw std::invalid_argument("optimizer slots " + std::to_string(options.optimizer_slots) +
                                " is negative; expected 1 (SGD) or 2 (AdamW)");
  if (options.neighbours < 0)
    throw std::invalid_argument("profiling alongside " + std::to_string(options.neighbours) +
                                " neighbours; expected 0 or more");
  UnitCosts costs;
  costs.microbatch_tokens = options.microbatch_tokens;
  const UnitGroups groups(model, options);
  Neighbours neighbours(model, ctx.device(), options);
  const auto benches = build_benches(model, groups, ctx, options);
  const size_t count = groups.leaders.size();
  std::vector<std::vector<double>> forward(count), input_grad(count), weight_grad(count),
      compute(count);
  const auto order = interleaved_runs(groups.timed_runs, options.warmup);
  for (size_t k = 0; k < order.size(); ++k) {
    const ProfileRun& run = order[k];
    const UnitBench::Times t = benches[run.group]->run(static_cast<int64_t>(k));
    if (!run.timed) continue;
    forward[run.group].push_back(t.forward);
    input_grad[run.group].push_back(t.input_grad);
    weight_grad[run.group].push_back(t.weight_grad);
    compute[run.group].push_back(t.forward + t.input_grad + t.weight_grad);
  }
  neighbours.finish();
  std::vector<UnitCost> group_costs;
  for (size_t g = 0; g < count; ++g) {
    UnitCost c = benches[g]->cost();
    c.forward = summarize_samples(forward[g]).quartile;
    c.backward_input = summarize_samples(input_grad[g]).quartile;
    c.backward_weight = summarize_samples(weight_grad[g]).quartile;
    c.time_error = summarize_samples(compute[g]).relative_error;
    c.group = groups.leaders[g];
    group_costs.push_back(c);
  }
  for (int64_t u = 0; u < model.num_units; ++u)
    costs.units.push_back(group_costs[groups.group_of(u)]);
  costs.transfer_seconds = transfer_seconds(model, ctx, options);
  return costs;
}

namespace {

// Rank 0's seconds for one group sum of `floats` values per rank, median over the timed
// repetitions; every rank starts together, as the replicas of a step reach their sum.
double group_sum_seconds(std::vector<std::unique_ptr<comm::Transport>>& transports, size_t floats,
                         int warmup, int repetitions) {
  const int p = static_cast<int>(transports.size());
  std::vector<int> group(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) group[static_cast<size_t>(r)] = r;
  std::barrier together(p);
  std::vector<double> times;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(p));
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r)
    threads.emplace_back([&, r] {
      std::vector<float> values(floats, 1.0f + static_cast<float>(r));
      for (int rep = 0; rep < warmup + repetitions; ++rep) {
        together.arrive_and_wait();
        const auto start = Clock::now();
        try {
          if (!errors[static_cast<size_t>(r)])
            transports[static_cast<size_t>(r)]->start_group_sum(values, group)->wait();
        } catch (...) {
          // The others fail too (the transport's deadline); keep meeting at the barrier.
          errors[static_cast<size_t>(r)] = std::current_exception();
          transports[static_cast<size_t>(r)]->abort("the all-reduce measurement failed");
        }
        const double t = std::chrono::duration<double>(Clock::now() - start).count();
        if (r == 0 && rep >= warmup) times.push_back(t);
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return median(times);
}

}  // namespace

AllReduceCost measure_allreduce(std::vector<std::unique_ptr<comm::Transport>>& transports,
                                size_t bytes, int warmup, int repetitions) {
  const size_t p = transports.size();
  if (p < 2)
    throw std::invalid_argument("measuring an all-reduce needs at least two ranks, got " +
                                std::to_string(p));
  if (repetitions < 1 || warmup < 0)
    throw std::invalid_argument("measuring an all-reduce needs at least one repetition");
  AllReduceCost cost;
  cost.small_bytes = 4096;
  cost.large_bytes =
      std::max(bytes / sizeof(float), size_t{2} * cost.small_bytes / sizeof(float)) * sizeof(float);
  cost.small_seconds =
      group_sum_seconds(transports, cost.small_bytes / sizeof(float), warmup, repetitions);
  cost.large_seconds =
      group_sum_seconds(transports, cost.large_bytes / sizeof(float), warmup, repetitions);
  // t(b) = 2(p-1) latency + 2(p-1)/p b / bandwidth through both points; a noisy slope that is
  // not positive leaves the large size's whole time to the bandwidth.
  const double steps = 2.0 * static_cast<double>(p - 1);
  const double slope = (cost.large_seconds - cost.small_seconds) /
                       static_cast<double>(cost.large_bytes - cost.small_bytes);
  if (slope > 0) {
    cost.bandwidth = steps / static_cast<double>(p) / slope;
    cost.latency =
        std::max(0.0, cost.small_seconds - slope * static_cast<double>(cost.small_bytes)) / steps;
  } else {
    cost.bandwidth = steps / static_cast<double>(p) * static_cast<double>(cost.large_bytes) /
                     std::max(cost.large_seconds, 1e-9);
    cost.latency = 0;
  }
  return cost;
}

double device_memory_bytes(Device device, std::string* what) {
  if (device.is_cuda()) {
    const CudaMemoryInfo info = cuda_memory_info(device.index);
    if (info.total_bytes == 0) return 0.0;
    if (what) *what = "the memory of " + device.to_string();
    return static_cast<double>(info.total_bytes);
  }
  if (device.is_cpu()) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return 0.0;
    if (what) *what = "the machine's physical memory";
    return static_cast<double>(pages) * static_cast<double>(page);
  }
  return 0.0;
}

}  // namespace conveyor
