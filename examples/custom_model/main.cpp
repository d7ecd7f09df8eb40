// A model of one's own, trained through a pipeline: a residual block written here (its
// forward and backward by hand, through Conveyor's tensor ops, and what it keeps for the
// backward), a model description built from it, a data source of one's own, a plan for two
// pipeline ranks on the CPU from the units' measured costs (schedule, micro-batch count and
// partition), training under it, and an evaluation at the end. Exits with status 1
// when the block's declared memory differs from what the allocator measures, or unless the
// loss fell clearly.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "conveyor/engine/conveyor.h"

namespace {

using namespace conveyor;

// y = x + W_down·gelu(W_up·ln(x) + b_up) + b_down + W_skip·ln(x)
// A pre-norm MLP of inner width `inner` with a linear shortcut beside it. Activations are
// written (`=`), parameter gradients accumulate (`+=`) over the micro-batches of a step.
class ShortcutBlock : public Layer {
 public:
  ShortcutBlock(std::string name, int64_t width, int64_t inner)
      : name_(std::move(name)), width_(width), inner_(inner) {
    const float up_bound = 1.0f / std::sqrt(static_cast<float>(width));
    const float down_bound = 1.0f / std::sqrt(static_cast<float>(inner));
    gamma_ = parameter("ln.weight", {width}, InitSpec::constant(1.0f), false);
    beta_ = parameter("ln.bias", {width}, InitSpec::constant(0.0f), false);
    up_ = parameter("up.weight", {inner, width}, InitSpec::uniform(up_bound), true);
    up_bias_ = parameter("up.bias", {inner}, InitSpec::uniform(up_bound), false);
    down_ = parameter("down.weight", {width, inner}, InitSpec::uniform(down_bound), true);
    down_bias_ = parameter("down.bias", {width}, InitSpec::uniform(down_bound), false);
    skip_ = parameter("skip.weight", {width, width}, InitSpec::uniform(0.1f * up_bound), true);
  }

  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override {
    return {&gamma_, &beta_, &up_, &up_bias_, &down_, &down_bias_, &skip_};
  }

  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs&,
                 SavedTensors& saved) override {
    const int64_t n = x.dim(0), width = x.dim(1), inner = up_.shape[0];
    Tensor h = ctx.empty({n, width}), mean = ctx.empty({n}), rstd = ctx.empty({n});
    ops::layernorm_forward(ctx, h, mean, rstd, x, gamma_.value, beta_.value, 1e-5f);
    Tensor u = ctx.empty({n, inner}), a = ctx.empty({n, inner});
    ops::linear_forward(ctx, u, h, up_.value, up_bias_.value);
    ops::activation_forward(ctx, ops::ActivationKind::kGelu, a, u);
    Tensor y = ctx.empty({n, width}), shortcut = ctx.empty({n, width});
    ops::linear_forward(ctx, y, a, down_.value, down_bias_.value);
    ops::linear_forward(ctx, shortcut, h, skip_.value, Tensor());
    ops::add_(ctx, y, shortcut);
    ops::add_(ctx, y, x);  // residual
    saved[kX] = x;
    saved[kMean] = mean;
    saved[kRstd] = rstd;
    saved[kH] = h;
    saved[kU] = u;
    saved[kA] = a;
    return y;
  }

  // dx only; what the weight gradients need stays in `saved` for backward_weight.
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override {
    Tensor da = ctx.empty(saved[kA].shape()), du = ctx.empty(saved[kU].shape());
    ops::linear_backward_input(ctx, da, dy, down_.value);
    ops::activation_backward(ctx, ops::ActivationKind::kGelu, du, da, saved[kU]);
    Tensor dh = ctx.empty(dy.shape()), dh_shortcut = ctx.empty(dy.shape());
    ops::linear_backward_input(ctx, dh, du, up_.value);
    ops::linear_backward_input(ctx, dh_shortcut, dy, skip_.value);
    ops::add_(ctx, dh, dh_shortcut);
    Tensor dx = ctx.empty(dy.shape());
    ops::layernorm_backward_input(ctx, dx, dh, saved[kX], saved[kMean], saved[kRstd], gamma_.value);
    ops::add_(ctx, dx, dy);  // residual
    saved[kDy] = dy;
    saved[kDu] = du;
    saved[kDh] = dh;
    saved[kU] = Tensor();  // the weight half does not need the pre-activation
    return dx;
  }

  void backward_weight(DeviceContext& ctx, SavedTensors& saved) override {
    ops::linear_backward_weight(ctx, down_.grad, down_bias_.grad, saved[kDy], saved[kA]);
    ops::linear_backward_weight(ctx, skip_.grad, Tensor(), saved[kDy], saved[kH]);
    ops::linear_backward_weight(ctx, up_.grad, up_bias_.grad, saved[kDu], saved[kH]);
    ops::layernorm_backward_weight(ctx, gamma_.grad, beta_.grad, saved[kDh], saved[kX],
                                   saved[kMean], saved[kRstd]);
    saved.clear();
  }

  // What one micro-batch holds, in the allocator's rounded bytes (ActivationMemory,
  // layers/layer.h), read off the tensors above. The memory estimate that refuses a run too
  // large for its device, and the planner's memory cap, count on it; without it they would
  // count the block's input alone. main() checks it against what profile_units measures.
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override {
    const int64_t n = input.front();
    const double rows = allocated_bytes({n, width_}), inner_rows = allocated_bytes({n, inner_}),
                 row_stat = allocated_bytes({n});
    ActivationMemory m;
    // Forward keeps x, mean, rstd, h (rows), u and a.
    m.saved = 2 * rows + 2 * row_stat + 2 * inner_rows;
    // backward_input keeps dy, du and dh for the weight half and lets u go.
    m.weight_pending = 2 * rows;
    // Forward: y and the shortcut at once. Input gradient: dy, da, du, dh, dh_shortcut and dx.
    m.workspace = std::max(2 * rows, 4 * rows + 2 * inner_rows);
    return m;
  }

 private:
  enum Slot : size_t { kX, kMean, kRstd, kH, kU, kA, kDy, kDu, kDh };

  // Global names ("blocks.2.up.weight"): initial values depend only on (seed, name), so any
  // cut of the model into stages starts from the same weights.
  Parameter parameter(const std::string& local, Shape shape, InitSpec init, bool decay) {
    Parameter p;
    p.name = name_ + "." + local;
    p.shape = std::move(shape);
    p.init = init;
    p.weight_decay = decay;
    return p;
  }

  std::string name_;
  int64_t width_, inner_;
  Parameter gamma_, beta_, up_, up_bias_, down_, down_bias_, skip_;
};

// embed -> `blocks` x ShortcutBlock -> loss head, as units 0, 1..blocks, blocks+1.
ModelDescription shortcut_model(int64_t vocab, int64_t width, int64_t inner, int64_t blocks) {
  ModelDescription model;
  model.name = "shortcut MLP (d=" + std::to_string(width) + ", inner=" + std::to_string(inner) +
               ", L=" + std::to_string(blocks) + ", V=" + std::to_string(vocab) + ")";
  model.num_units = blocks + 2;
  model.vocab = vocab;
  model.make_unit = [=](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 0) return std::make_unique<Embedding>("embed", vocab, width);
    if (index == blocks + 1) return std::make_unique<LossHead>("head", width, vocab);
    return std::make_unique<ShortcutBlock>("blocks." + std::to_string(index - 1), width, inner);
  };
  model.activation = activation_rows(width);  // every unit passes [tokens, width] on
  return model;
}

// The characters of a text, in order, wrapping at the end: next-character prediction.
class TextSource : public TokenSource {
 public:
  TextSource(std::string text, uint64_t start) : text_(std::move(text)), position_(start) {}
  int64_t vocab() const override { return 128; }  // ASCII
  void next(int32_t* inputs, int32_t* targets, int64_t n) override {
    check_count(n);  // a negative n would wrap the unsigned position
    for (int64_t i = 0; i < n; ++i, ++position_) {
      inputs[i] = static_cast<unsigned char>(text_[position_ % text_.size()]);
      targets[i] = static_cast<unsigned char>(text_[(position_ + 1) % text_.size()]);
    }
  }
  uint64_t position() const override { return position_; }
  void seek(uint64_t position) override { position_ = position; }
  std::string describe() const override {
    return "characters of a " + std::to_string(text_.size()) + "-character text";
  }

 private:
  std::string text_;
  uint64_t position_;
};

const char* kText =
    "a pipeline cuts the model into stages; micro-batches flow forward through the stages "
    "and gradients flow back, and a schedule says which stage does what, when. ";

}  // namespace

// The bytes each unit's layer says it keeps (described_unit_costs) against what the
// allocator measured while profiling it; false, after saying where, when they differ.
bool memory_declared_as_measured(const ModelDescription& model, const UnitCosts& measured,
                                 const std::string& optimizer) {
  const std::vector<UnitCost> described =
      described_unit_costs(model, measured.microbatch_tokens, optimizer);
  bool same = true;
  for (size_t u = 0; u < described.size(); ++u) {
    const UnitCost &d = described[u], &m = measured.units[u];
    auto check = [&](const char* what, double declared, double allocated) {
      if (declared == allocated) return;
      std::printf(
          "unit %zu (%s) declares %.0f bytes %s at %lld tokens; the allocator measured %.0f\n", u,
          model.unit(static_cast<int64_t>(u))->name().c_str(), declared, what,
          static_cast<long long>(measured.microbatch_tokens), allocated);
      same = false;
    };
    check("kept for the backward", d.activation_bytes, m.activation_bytes);
    check("kept for the weight gradient", d.weight_pending_bytes, m.weight_pending_bytes);
    check("of workspace", d.workspace_bytes, m.workspace_bytes);
  }
  return same;
}

int main() {
  TrainConfig config;
  config.steps = 40;
  config.batch_tokens = 1024;
  config.device = Device::cpu();
  config.optimizer.lr = 1e-2;
  config.optimizer.warmup_steps = 5;
  const ModelDescription model = shortcut_model(128, 48, 96, 2);
  std::printf("conveyor %s | model %s, %lld parameters\n", version(), model.name.c_str(),
              static_cast<long long>(model.count_parameters()));

  // Plan for two ranks on this machine's cores: each unit timed at the micro-batch size of
  // each candidate count, with a copy of the profile running alongside as the other rank
  // would, then every schedule, count and exact partition simulated with those costs.
  const int ranks = 2;
  DeviceContextOptions share;
  share.cpu_threads = cpu_threads_per_rank(0, ranks);
  DeviceContext ctx(*config.device, share);
  PlanOptions options;
  options.num_ranks = ranks;
  options.batch_tokens = config.batch_tokens;
  options.microbatch_counts = {2, 4, 8};
  // Each rank's share of what the device can give now, less what its context takes (on CUDA, its
  // cuBLASLt workspace), as the trainer's check before the run counts it.
  options.memory_cap = rank_memory_share(device_memory_limit(*config.device, 0).bytes, ranks,
                                         *config.device, "the device")
                           .bytes;
  options.include_data_parallel = false;  // pricing replicas needs their all-reduce timed
  std::vector<UnitCosts> measured;
  for (const int m : options.microbatch_counts) {
    ProfileOptions profile;
    profile.microbatch_tokens = config.batch_tokens / m;
    profile.neighbours = ranks - 1;
    profile.neighbour_context = share;
    measured.push_back(profile_units(model, ctx, profile));
    if (!memory_declared_as_measured(model, measured.back(), config.optimizer.kind)) return 1;
  }
  std::printf(
      "memory each unit declares = what the allocator measured, at %lld, %lld and %lld "
      "tokens per micro-batch\n",
      static_cast<long long>(measured[0].microbatch_tokens),
      static_cast<long long>(measured[1].microbatch_tokens),
      static_cast<long long>(measured[2].microbatch_tokens));
  const Plan ranked = plan(measured, options);
  std::printf("%s", format_plan(ranked).c_str());
  const PlanCandidate* chosen = ranked.fastest_pipeline();
  if (chosen == nullptr) {
    std::printf("no pipeline of %d ranks fits\n", ranks);
    return 1;
  }
  apply_plan(*chosen, config);
  std::printf("plan   %s, %lld micro-batches, predicted step %.3f ms\n", chosen->layout.c_str(),
              static_cast<long long>(config.microbatches), chosen->step_seconds * 1e3);

  Trainer trainer(model, config, std::make_shared<TextSource>(kText, 0));
  std::printf("data   %s\n", trainer.source().describe().c_str());
  for (size_t s = 0; s < trainer.stage_ranges().size(); ++s)
    std::printf("stage %zu: units [%lld, %lld)\n", s,
                static_cast<long long>(trainer.stage_ranges()[s].begin),
                static_cast<long long>(trainer.stage_ranges()[s].end));

  double first = 0.0, last = 0.0;
  for (int64_t s = 1; s <= config.steps; ++s) {
    last = trainer.step().loss;
    if (s == 1) first = last;
    if (s == 1 || s % 10 == 0)
      std::printf("step %3lld | loss %.4f\n", static_cast<long long>(s), last);
  }
  // Forward only, on batches the training did not draw in this order: the text from
  // another offset. Not held out: the training went over every character of the short text
  // many times (a run of one's own holds data out, as --eval-batches does).
  TextSource shifted(kText, 57);
  const double evaluated = trainer.evaluate(shifted, 2);
  std::printf("loss   first %.4f, final %.4f, evaluated %.4f\n", first, last, evaluated);
  if (!(last < 0.8 * first)) {
    std::printf("the loss did not fall below 0.8 x the first step's\n");
    return 1;
  }
  return 0;
}
