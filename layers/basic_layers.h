#pragma once
// The elementary layers: Linear, Activation, LayerNorm, Embedding.
#include <string>
#include <vector>

#include "layers/layer.h"
#include "layers/ops.h"

namespace conveyor {

// y = x·Wᵀ + b; parameters "<name>.weight" [out, in] and "<name>.bias" [out], initialised
// U(-1/√in, 1/√in) as is customary.
class Linear : public Layer {
 public:
  Linear(std::string name, int64_t in, int64_t out, bool bias = true);
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override;
  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                 SavedTensors& saved) override;
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override;
  void backward_weight(DeviceContext& ctx, SavedTensors& saved) override;
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override;

  Parameter& weight() { return weight_; }

 private:
  std::string name_;
  int64_t in_, out_;
  bool has_bias_;
  Parameter weight_, bias_;
};

class Activation : public Layer {
 public:
  Activation(std::string name, ops::ActivationKind kind);
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override { return {}; }
  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                 SavedTensors& saved) override;
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override;
  void backward_weight(DeviceContext& /*ctx*/, SavedTensors& saved) override { saved.clear(); }
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override;

 private:
  std::string name_;
  ops::ActivationKind kind_;
};

// Normalises each row; parameters "<name>.weight" (γ, ones) and "<name>.bias" (β, zeros).
class LayerNorm : public Layer {
 public:
  LayerNorm(std::string name, int64_t width, float eps = 1e-5f);
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override { return {&gamma_, &beta_}; }
  Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                 SavedTensors& saved) override;
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override;
  void backward_weight(DeviceContext& ctx, SavedTensors& saved) override;
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override;

 private:
  std::string name_;
  int64_t width_;
  float eps_;
  Parameter gamma_, beta_;
};

// i32 tokens [n] -> rows of "<name>.weight" [vocab, width], initialised with std 0.02
// (uniform with the same variance). It is the first layer: no input gradient.
class Embedding : public Layer {
 public:
  Embedding(std::string name, int64_t vocab, int64_t width);
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override { return {&table_}; }
  Tensor forward(DeviceContext& ctx, const Tensor& tokens, const MicroBatchInputs& in,
                 SavedTensors& saved) override;
  Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) override;
  void backward_weight(DeviceContext& ctx, SavedTensors& saved) override;
  // Its token ids are a view of the step's, which hold them for the whole step: not counted.
  std::optional<ActivationMemory> activation_memory(const Shape& input) const override;
  std::optional<int64_t> accepted_ids() const override { return vocab_; }

 private:
  std::string name_;
  int64_t vocab_, width_;
  Parameter table_;
};

}  // namespace conveyor
