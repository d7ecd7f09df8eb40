#pragma once
// The layer interface. A layer is a pure function of its input and parameters whose forward
// saves, per micro-batch, what its backward needs. Backward comes in two halves so that a
// schedule can split it (zero-bubble I/W):
//   backward_input(dy)  -> dx, keeping what the weight gradient needs;
//   backward_weight()   -> parameter gradients += ..., then the saved state is released.
// backward() runs both. Outputs and input gradients are fresh tensors (`=`); parameter
// gradients accumulate (`+=`) across the micro-batches of a step.
#include <memory>
#include <string>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/core/tensor.h"
#include "layers/parameter.h"

namespace conveyor {

// What a layer keeps for one micro-batch between forward and backward.
// Composite layers keep one child per sub-layer.
struct SavedTensors {
  std::vector<Tensor> tensors;
  std::vector<SavedTensors> children;

  Tensor& operator[](size_t i) {
    if (tensors.size() <= i) tensors.resize(i + 1);
    return tensors[i];
  }
  SavedTensors& child(size_t i) {
    if (children.size() <= i) children.resize(i + 1);
    return children[i];
  }
  void clear() {
    tensors.clear();
    children.clear();
  }
};

// Per micro-batch inputs that only some layers read (the loss head reads the targets).
struct MicroBatchInputs {
  Tensor targets;           // i32 [n]
  float loss_scale = 1.0f;  // d(step loss)/d(token loss): 1 / valid tokens of the step
  int32_t ignore_index = -1;
};

class Layer {
 public:
  virtual ~Layer() = default;
  // Global name prefix of this layer ("blocks.3").
  virtual const std::string& name() const = 0;
  virtual std::vector<Parameter*> parameters() = 0;
  // x -> y. The embedding takes i32 tokens; the loss head returns per-token losses [n].
  virtual Tensor forward(DeviceContext& ctx, const Tensor& x, const MicroBatchInputs& in,
                         SavedTensors& saved) = 0;
  // dy -> dx (undefined for the first layer, which has no input gradient). The loss head
  // ignores dy: its gradient was fixed by the loss in forward.
  virtual Tensor backward_input(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) = 0;
  virtual void backward_weight(DeviceContext& ctx, SavedTensors& saved) = 0;

  Tensor backward(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) {
    Tensor dx = backward_input(ctx, dy, saved);
    backward_weight(ctx, saved);
    return dx;
  }
};

}  // namespace conveyor
