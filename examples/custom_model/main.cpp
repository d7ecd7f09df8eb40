// A model of one's own, trained through a pipeline: a residual block written here (its
// forward and backward by hand, through Conveyor's tensor ops), a model description built
// from it, a data source of one's own, two pipeline stages under 1F1B on the CPU, and a
// held-out evaluation at the end. Exits with status 1 unless the loss fell clearly.
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "engine/conveyor.h"

namespace {

using namespace conveyor;

// y = x + W_down·gelu(W_up·ln(x) + b_up) + b_down + W_skip·ln(x)
// A pre-norm MLP of inner width `inner` with a linear shortcut beside it. Activations are
// written (`=`), parameter gradients accumulate (`+=`) over the micro-batches of a step.
class ShortcutBlock : public Layer {
 public:
  ShortcutBlock(std::string name, int64_t width, int64_t inner) : name_(std::move(name)) {
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

int main() {
  TrainConfig config;
  config.steps = 40;
  config.batch_tokens = 1024;
  config.microbatches = 4;
  config.stages = 2;
  config.schedule = schedule::ScheduleKind::k1F1B;
  config.partition = PartitionSpec::by_parameters();
  config.device = Device::cpu();
  config.optimizer.lr = 1e-2;
  config.optimizer.warmup_steps = 5;

  Trainer trainer(shortcut_model(128, 48, 96, 2), config, std::make_shared<TextSource>(kText, 0));
  std::printf("conveyor %s | model %s, %lld parameters\n", version(), trainer.model().name.c_str(),
              static_cast<long long>(trainer.model().count_parameters()));
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
  // another offset.
  TextSource shifted(kText, 57);
  const double evaluated = trainer.evaluate(shifted, 2);
  std::printf("loss   first %.4f, final %.4f, evaluated %.4f\n", first, last, evaluated);
  if (!(last < 0.8 * first)) {
    std::printf("the loss did not fall below 0.8 x the first step's\n");
    return 1;
  }
  return 0;
}
