#pragma once
// The layer interface. A layer is a pure function of its input and parameters whose forward
// saves, per micro-batch, what its backward needs. Backward comes in two halves so that a
// schedule can split it (zero-bubble I/W):
//   backward_input(dy)  -> dx, keeping what the weight gradient needs;
//   backward_weight()   -> parameter gradients += ..., then the saved state is released.
// backward() runs both. Outputs and input gradients are fresh tensors (`=`); parameter
// gradients accumulate (`+=`) across the micro-batches of a step.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/allocator.h"
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
  // The micro-batch's token count, the n of its ids [n]: a stage checks what crosses each of
  // its unit boundaries against the model's description for this many (Stage::forward).
  int64_t tokens = 0;
  Tensor targets;           // i32 [n]
  float loss_scale = 1.0f;  // d(step loss)/d(token loss): 1 / valid tokens of the step
  int32_t ignore_index = -1;
};

// What one micro-batch holds of a layer's memory, in bytes as the caching allocator counts
// them (each tensor rounded up by CachingAllocator::round_size), its input and its output
// gradient being fresh tensors that nothing else holds, as they are in a pipeline stage:
//   saved: left allocated by forward until the backward (the input included when kept);
//   weight_pending: left by backward_input on top of that for backward_weight (0 when it
//     releases at least as much as it keeps);
//   workspace: the most allocated at once on top of what forward leaves, during forward (its
//     output included) or backward_input (the output gradient and the input gradient
//     included), or on top of what backward_input leaves, during backward_weight.
// profile_units (engine/pipeline/profile.h) measures the same three on a device's allocator.
struct ActivationMemory {
  double saved = 0;
  double weight_pending = 0;
  double workspace = 0;
};

// The bytes the caching allocator gives a tensor of `shape`.
inline double allocated_bytes(const Shape& shape, DType dtype = DType::kF32) {
  return static_cast<double>(
      CachingAllocator::round_size(static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype)));
}

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
  // What one micro-batch whose input has shape `input` holds (see ActivationMemory), from the
  // shapes the forward and backward allocate; empty when the layer does not say, and a
  // memory estimate then counts its input alone, a lower bound.
  virtual std::optional<ActivationMemory> activation_memory(const Shape& input) const {
    (void)input;
    return std::nullopt;
  }

  // For a layer that reads ids (an embedding its inputs, a loss head its targets): it accepts
  // ids in [0, n) and returns n. ModelDescription::validate refuses a model whose vocab is
  // larger, since ids the data may hold would index past the layer's table; a CUDA kernel
  // could not report them. Empty when the layer reads no ids or does not say.
  virtual std::optional<int64_t> accepted_ids() const { return std::nullopt; }

  Tensor backward(DeviceContext& ctx, const Tensor& dy, SavedTensors& saved) {
    Tensor dx = backward_input(ctx, dy, saved);
    backward_weight(ctx, saved);
    return dx;
  }
};

}  // namespace conveyor
