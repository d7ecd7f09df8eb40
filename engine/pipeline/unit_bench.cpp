#include "engine/pipeline/unit_bench.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <stdexcept>
#include <string>

#include "engine/pipeline/identical_units.h"

namespace conveyor::profiling {
namespace {

using Clock = std::chrono::steady_clock;

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

}  // namespace

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

namespace {

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

}  // namespace

UnitGroups::UnitGroups(const ModelDescription& model, const ProfileOptions& options,
                       const std::vector<int64_t>& sizes) {
  // Units are one group when they are identical at every size: the first unit of the same
  // leaders at each.
  std::vector<std::vector<int64_t>> at_sizes(static_cast<size_t>(model.num_units));
  for (const int64_t tokens : sizes) {
    const std::vector<int64_t> leaders_here = options.pool_identical_units
                                                  ? identical_unit_leaders(model, tokens)
                                                  : std::vector<int64_t>();
    for (int64_t u = 0; u < model.num_units; ++u)
      at_sizes[u].push_back(leaders_here.empty() ? u : leaders_here[u]);
  }
  for (int64_t u = 0; u < model.num_units; ++u) {
    int64_t leader = u;
    for (const int64_t l : leaders)
      if (at_sizes[l] == at_sizes[u]) {
        leader = l;
        break;
      }
    leader_of.push_back(leader);
    if (leader == u) leaders.push_back(u), timed_runs.push_back(0);
    timed_runs[group_of(u)] += options.repetitions;
  }
  for (int& runs : timed_runs) runs = std::max(runs, kLeastRuns * options.repetitions);
}

size_t UnitGroups::group_of(int64_t u) const {
  return static_cast<size_t>(std::find(leaders.begin(), leaders.end(), leader_of[u]) -
                             leaders.begin());
}

UnitBench::UnitBench(const ModelDescription& model, int64_t u, DeviceContext& ctx,
                     const ProfileOptions& options, const std::vector<int64_t>& sizes)
    : ctx_(ctx),
      before_build_(ctx.allocator().stats().allocated_bytes),
      stage_(model, u, u + 1, ctx, options.seed),
      first_(u == 0),
      last_(u + 1 == model.num_units) {
  ctx.synchronize();
  UnitCost built;
  double allocated = 0;  // a tensor of each parameter's shape, as the allocator gives it
  for (Parameter* p : stage_.parameters()) {
    built.parameter_bytes += static_cast<double>(p->value.nbytes());
    built.parameter_elements.push_back(p->value.numel());
    allocated += static_cast<double>(CachingAllocator::round_size(p->value.nbytes()));
  }
  built.optimizer_bytes = options.optimizer_slots * allocated;
  built.state_bytes = static_cast<double>(ctx.allocator().stats().allocated_bytes - before_build_) +
                      built.optimizer_bytes;
  for (const int64_t n : sizes) {
    AtSize& at = at_.emplace_back();
    at.cost = built;
    at.in.tokens = n;
    at.in.targets = random_ids(ctx, n, model.vocab, options.seed + 17 * u + 1);
    at.in.loss_scale = 1.0f / static_cast<float>(n);
    at.input = first_ ? random_ids(ctx, n, model.vocab, options.seed + 17 * u + 2)
                      : random_tensor(ctx, model.activation_at(u, n), options.seed + 17 * u + 3);
    if (!last_)
      at.dy = random_tensor(ctx, model.activation_at(u + 1, n), options.seed + 17 * u + 4);
    if (!first_)
      at.cost.input_bytes = static_cast<double>(CachingAllocator::round_size(at.input.nbytes()));
  }
}

UnitBench::Times UnitBench::run(size_t size, int64_t microbatch) {
  AtSize& at = at_[size];
  const size_t before = ctx_.allocator().stats().allocated_bytes;
  // A fresh copy of the input, counted when the unit keeps it (as it does in a stage, where
  // nothing else holds it); the token ids of the first unit are a view of the step's ids.
  Tensor x = at.input;
  if (!first_) {
    x = ctx_.empty(at.input.shape(), at.input.dtype());
    copy_tensor(x, at.input, ctx_.compute_stream().native());
  }
  // Each half's peak above what was allocated when it started, or after it ended for the
  // forward (whose saved tensors stay): the unit's workspace.
  CachingAllocator& allocator = ctx_.allocator();
  auto peak_above = [&](size_t level) {
    return static_cast<double>(allocator.stats().peak_allocated_bytes) - static_cast<double>(level);
  };
  Times t;
  allocator.reset_peak();
  t.forward = timed(ctx_, [&] { stage_.forward(microbatch, x, at.in); });
  x = Tensor();
  // The output went to the next unit; what is still allocated is what the backward keeps.
  const size_t after_forward = allocator.stats().allocated_bytes;
  at.cost.activation_bytes = static_cast<double>(after_forward) - static_cast<double>(before);
  double workspace = peak_above(after_forward);
  // The output gradient too is a fresh copy, counted when the unit keeps it for W (in a
  // stage it is the next unit's input gradient, which nothing else holds).
  Tensor g = at.dy;
  if (!last_) {
    g = ctx_.empty(at.dy.shape(), at.dy.dtype());
    copy_tensor(g, at.dy, ctx_.compute_stream().native());
  }
  allocator.reset_peak();
  t.input_grad = timed(ctx_, [&] { stage_.backward_input(microbatch, g); });
  g = Tensor();
  workspace = std::max(workspace, peak_above(after_forward));
  const size_t after_input_grad = allocator.stats().allocated_bytes;
  at.cost.weight_pending_bytes =
      std::max(0.0, static_cast<double>(after_input_grad) - static_cast<double>(after_forward));
  allocator.reset_peak();
  t.weight_grad = timed(ctx_, [&] { stage_.backward_weight(microbatch); });
  at.cost.workspace_bytes = std::max(workspace, peak_above(after_input_grad));
  return t;
}

std::vector<std::unique_ptr<UnitBench>> build_benches(const ModelDescription& model,
                                                      const UnitGroups& groups, DeviceContext& ctx,
                                                      const ProfileOptions& options,
                                                      const std::vector<int64_t>& sizes) {
  std::vector<std::unique_ptr<UnitBench>> benches;
  for (const int64_t u : groups.leaders)
    benches.push_back(std::make_unique<UnitBench>(model, u, ctx, options, sizes));
  return benches;
}

}  // namespace conveyor::profiling
