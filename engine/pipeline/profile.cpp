#include "engine/pipeline/profile.h"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <exception>
#include <latch>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "comm/in_process.h"
#include "engine/pipeline/profile_samples.h"
#include "engine/pipeline/unit_bench.h"

namespace conveyor {
namespace {

using profiling::UnitBench;
using profiling::UnitGroups;
using Clock = std::chrono::steady_clock;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// One boundary activation from rank 0 to rank 1 of an in-process hub, both on `ctx`'s device.
double transfer_seconds(const ModelDescription& model, DeviceContext& ctx,
                        const ProfileOptions& options, int64_t tokens) {
  if (model.num_units < 2) return 0.0;
  const ActivationSpec spec = model.activation_at(1, tokens);
  auto hub = comm::InProcessHub::create(2, std::chrono::milliseconds(10000));
  auto sender = hub->endpoint(0), receiver = hub->endpoint(1);
  Stream send_stream(ctx.device()), recv_stream(ctx.device());
  const Tensor source = profiling::random_tensor(ctx, spec, options.seed + 99);
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

// Each group's timed runs at each of `sizes` sizes: entry g * sizes + s.
std::vector<int> every_size(const std::vector<int>& timed_runs, size_t sizes) {
  std::vector<int> out;
  for (const int runs : timed_runs) out.insert(out.end(), sizes, runs);
  return out;
}

// The neighbours of ProfileOptions: each runs the profile's units in its order over and over
// on its own context until stopped. Their first failure is kept for the caller.
class Neighbours {
 public:
  // Returns once every neighbour has built its units and starts on its first run.
  Neighbours(const ModelDescription& model, Device device, const ProfileOptions& options,
             const std::vector<int64_t>& sizes)
      : errors_(static_cast<size_t>(options.neighbours)), started_(options.neighbours) {
    for (int k = 0; k < options.neighbours; ++k)
      threads_.emplace_back([this, &model, device, options, sizes, k] {
        bool counted = false;
        try {
          DeviceContext ctx(device, options.neighbour_context);
          ProfileOptions own = options;
          own.seed = options.seed + 1000003 * static_cast<uint64_t>(k + 1);
          const UnitGroups groups(model, own, sizes);
          // Built before the measured copy starts, so a neighbour that cannot run fails
          // every time, and its first runs are timed alongside it.
          const auto benches = build_benches(model, groups, ctx, own, sizes);
          const auto order = interleaved_runs(every_size(groups.timed_runs, sizes.size()), 0);
          started_.count_down();
          counted = true;
          for (int64_t run = 0; !stop_.load(); ++run) {
            const size_t at = order[run % order.size()].group;
            (void)benches[at / sizes.size()]->run(at % sizes.size(), run);
          }
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
  return profile_units(model, ctx, {options.microbatch_tokens}, options).front();
}

std::vector<UnitCosts> profile_units(const ModelDescription& model, DeviceContext& ctx,
                                     const std::vector<int64_t>& sizes,
                                     const ProfileOptions& options) {
  model.validate();
  if (sizes.empty())
    throw std::invalid_argument("profiling at no micro-batch size; expected at least one");
  for (const int64_t tokens : sizes)
    if (tokens < 1)
      throw std::invalid_argument("profiling at " + std::to_string(tokens) +
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
  const UnitGroups groups(model, options, sizes);
  Neighbours neighbours(model, ctx.device(), options, sizes);
  const auto benches = build_benches(model, groups, ctx, options, sizes);
  // Group g at size s is entry g * sizes + s of the order, and of the samples.
  const size_t count = groups.leaders.size() * sizes.size();
  std::vector<std::vector<double>> forward(count), input_grad(count), weight_grad(count),
      compute(count);
  const auto order = interleaved_runs(every_size(groups.timed_runs, sizes.size()), options.warmup);
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t at = order[k].group;
    const UnitBench::Times t =
        benches[at / sizes.size()]->run(at % sizes.size(), static_cast<int64_t>(k));
    if (!order[k].timed) continue;
    forward[at].push_back(t.forward);
    input_grad[at].push_back(t.input_grad);
    weight_grad[at].push_back(t.weight_grad);
    compute[at].push_back(t.forward + t.input_grad + t.weight_grad);
  }
  neighbours.finish();
  std::vector<UnitCosts> tables;
  for (size_t s = 0; s < sizes.size(); ++s) {
    UnitCosts& table = tables.emplace_back();
    table.microbatch_tokens = sizes[s];
    for (int64_t u = 0; u < model.num_units; ++u) {
      const size_t g = groups.group_of(u), at = g * sizes.size() + s;
      UnitCost c = benches[g]->cost(s);
      c.forward = summarize_samples(forward[at]).quartile;
      c.backward_input = summarize_samples(input_grad[at]).quartile;
      c.backward_weight = summarize_samples(weight_grad[at]).quartile;
      c.time_error = summarize_samples(compute[at]).relative_error;
      c.group = groups.leaders[g];
      table.units.push_back(c);
    }
    table.transfer_seconds = transfer_seconds(model, ctx, options, sizes[s]);
  }
  return tables;
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

}  // namespace conveyor
