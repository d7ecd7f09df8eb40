#include "layers/blocks.h"

#include <algorithm>

namespace conveyor {
namespace {

std::vector<Parameter*> concat(std::initializer_list<std::vector<Parameter*>> lists) {
  std::vector<Parameter*> out;
  for (const auto& list : lists) out.insert(out.end(), list.begin(), list.end());
  return out;
}

// Children of SavedTensors, one per sub-layer.
enum MlpChild : size_t { kLn = 0, kFc1 = 1, kAct = 2, kFc2 = 3 };
enum HeadChild : size_t { kHeadLn = 0, kHeadProj = 1 };
enum HeadSlot : size_t { kLogitGrad = 0 };

}  // namespace

MlpBlock::MlpBlock(std::string name, int64_t width, int64_t hidden, ops::ActivationKind activation,
                   float eps)
    : name_(std::move(name)),
      width_(width),
      hidden_(hidden),
      ln_(name_ + ".ln", width, eps),
      fc1_(name_ + ".fc1", width, hidden),
      act_(name_ + ".act", activation),
      fc2_(name_ + ".fc2", hidden, width) {}

std::vector<Parameter*> MlpBlock::parameters() {
  return concat({ln_.parameters(), fc1_.parameters(), fc2_.parameters()});
}

Tensor MlpBlock::forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                         SavedTensors& saved) {
  Tensor h = ln_.forward(ctx, x, in, saved.child(kLn));
  h = fc1_.forward(ctx, h, in, saved.child(kFc1));
  h = act_.forward(ctx, h, in, saved.child(kAct));
  Tensor y = fc2_.forward(ctx, h, in, saved.child(kFc2));
  ops::add_(ctx, y, x);  // residual
  return y;
}

Tensor MlpBlock::backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) {
  Tensor g = fc2_.backward_input(ctx, dy, saved.child(kFc2));
  g = act_.backward_input(ctx, g, saved.child(kAct));
  g = fc1_.backward_input(ctx, g, saved.child(kFc1));
  Tensor dx = ln_.backward_input(ctx, g, saved.child(kLn));
  ops::add_(ctx, dx, dy);  // residual path
  return dx;
}

void MlpBlock::backward_weight(DeviceContext& ctx, SavedTensors& saved) {
  fc2_.backward_weight(ctx, saved.child(kFc2));
  fc1_.backward_weight(ctx, saved.child(kFc1));
  ln_.backward_weight(ctx, saved.child(kLn));
  saved.clear();
}

std::optional<ActivationMemory> MlpBlock::activation_memory(const Shape& input) const {
  const int64_t n = input.front();
  const double x = allocated_bytes({n, width_}), h = allocated_bytes({n, hidden_}),
               row_stat = allocated_bytes({n});
  ActivationMemory m;
  // Each sub-layer keeps its input: ln the block's (with mean and rstd), fc1 ln's output, act
  // fc1's, fc2 act's.
  m.saved = 2 * x + 2 * row_stat + 2 * h;
  // fc2 keeps dy, fc1 act's dx (h) and ln fc1's dx; act gave back its input (h).
  m.weight_pending = 2 * x;
  // Forward: the output. Input gradient: dy with fc2's and act's dx before act's input goes;
  // later dy with fc1's and ln's dx.
  m.workspace = std::max({x, x + 2 * h, 3 * x});
  return m;
}

LossHead::LossHead(std::string name, int64_t width, int64_t vocab, float eps)
    : name_(std::move(name)),
      width_(width),
      vocab_(vocab),
      ln_(name_ + ".ln", width, eps),
      proj_(name_ + ".proj", width, vocab) {}

std::vector<Parameter*> LossHead::parameters() {
  return concat({ln_.parameters(), proj_.parameters()});
}

Tensor LossHead::forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                         SavedTensors& saved) {
  Tensor h = ln_.forward(ctx, x, in, saved.child(kHeadLn));
  Tensor logits = proj_.forward(ctx, h, in, saved.child(kHeadProj));
  Tensor losses = ctx.empty({x.dim(0)});
  // dlogits overwrite the logits: the probabilities are never stored.
  ops::softmax_cross_entropy(ctx, losses, logits, logits, in.targets, in.ignore_index,
                             in.loss_scale);
  saved[kLogitGrad] = logits;
  return losses;
}

Tensor LossHead::backward_input(DeviceContext& ctx, const Tensor&, SavedTensors& saved) {
  Tensor g = proj_.backward_input(ctx, saved[kLogitGrad], saved.child(kHeadProj));
  saved[kLogitGrad] = Tensor();  // proj keeps its own reference for the weight half
  return ln_.backward_input(ctx, g, saved.child(kHeadLn));
}

void LossHead::backward_weight(DeviceContext& ctx, SavedTensors& saved) {
  proj_.backward_weight(ctx, saved.child(kHeadProj));
  ln_.backward_weight(ctx, saved.child(kHeadLn));
  saved.clear();
}

std::optional<ActivationMemory> LossHead::activation_memory(const Shape& input) const {
  const int64_t n = input.front();
  const double x = allocated_bytes({n, width_}), row_stat = allocated_bytes({n}),
               logits = allocated_bytes({n, vocab_});
  ActivationMemory m;
  // ln keeps the input with mean and rstd, proj ln's output; the logits' gradient stays.
  m.saved = 2 * x + 2 * row_stat + logits;
  m.weight_pending = x;  // ln keeps proj's dx (proj's dy is the logits' gradient, kept)
  // Forward: the losses. Input gradient: proj's dx and ln's dx.
  m.workspace = std::max(row_stat, 2 * x);
  return m;
}

}  // namespace conveyor
