#pragma once
// Composite layers of the reference model:
//   MlpBlock:  y = x + fc2(act(fc1(ln(x))))     (pre-norm residual MLP, hidden = 4·d)
//   LossHead:  losses = softmax-CE(proj(ln(x)), targets)
#include <string>
#include <vector>

#include "layers/basic_layers.h"

namespace conveyor {

class MlpBlock : public Layer {
 public:
  MlpBlock(std::string name, int64_t width, int64_t hidden, ops::ActivationKind activation,
           float eps = 1e-5f);
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override;
  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                 SavedTensors& saved) override;
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override;
  void backward_weight(DeviceContext& ctx, SavedTensors& saved) override;
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override;

 private:
  std::string name_;
  int64_t width_, hidden_;
  LayerNorm ln_;
  Linear fc1_;
  Activation act_;
  Linear fc2_;
};

// The last layer: returns per-token losses [n]. Its gradient is computed with the loss in
// forward (fused softmax-CE, written over the logits), so backward_input ignores its dy.
class LossHead : public Layer {
 public:
  LossHead(std::string name, int64_t width, int64_t vocab, float eps = 1e-5f);
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override;
  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                 SavedTensors& saved) override;
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override;
  void backward_weight(DeviceContext& ctx, SavedTensors& saved) override;
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override;
  std::optional<int64_t> accepted_ids() const override { return vocab_; }

 private:
  std::string name_;
  int64_t width_, vocab_;
  LayerNorm ln_;
  Linear proj_;
};

}  // namespace conveyor
