#pragma once
// A stage: a contiguous range of model units [begin, end) placed on one device, with the
// activations it keeps per in-flight micro-batch. The executor drives it action by action
// (F, B, or I then W); the single-device trainer is the one-stage case. Evaluation runs
// forward_only, which keeps nothing. Units marked for recomputation (recompute.h) keep only
// the input of their run between forward and backward; the backward rebuilds the rest.
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/pipeline/recompute.h"
#include "layers/layer.h"
#include "layers/model.h"

namespace conveyor {

class Stage {
 public:
  // Builds units [begin, end) of `model` on `ctx` and initialises their parameters from
  // (seed, global name), so any cut of the model gives the same weights. The units `recompute`
  // marks (global indices, checked against the model) rebuild their saved tensors in the
  // backward.
  Stage(const ModelDescription& model, int64_t begin, int64_t end, DeviceContext& ctx,
        uint64_t seed, const RecomputeSpec& recompute = {});

  bool is_first() const { return begin_ == 0; }
  bool is_last() const { return end_ == num_units_; }
  int64_t unit_begin() const { return begin_; }
  int64_t unit_end() const { return end_; }

  // Input: i32 tokens on the first stage, activations otherwise. Output: activations, or
  // per-token losses [n] on the last stage. `in.tokens` must be the micro-batch's n: the
  // input, the output of every unit and, in the backward, every gradient are checked against
  // the model's description for it (ModelDescription::check_boundary), so a unit returning
  // another shape is named when it does, in a std::invalid_argument. A forward that throws
  // holds nothing of the micro-batch.
  Tensor forward(int64_t microbatch, const Tensor& input, const MicroBatchInputs& in);
  // Gradient w.r.t. the stage input (undefined on the first stage); `dy` is ignored on the
  // last stage. Re-runs the forward of recomputed runs first; keeps what backward_weight
  // needs (the rebuilt tensors too, so a split W reuses them).
  Tensor backward_input(int64_t microbatch, const Tensor& dy);
  // Accumulates parameter gradients of `microbatch` and releases its activations.
  void backward_weight(int64_t microbatch);
  Tensor backward(int64_t microbatch, const Tensor& dy);
  // The same output as forward, with nothing saved for a backward: parameters, gradients
  // and the micro-batches in flight are left as they are.
  Tensor forward_only(const Tensor& input, const MicroBatchInputs& in);

  std::vector<Parameter*> parameters();
  DeviceContext& context() { return ctx_; }
  // Micro-batches whose activations are held (forward done, weight half not yet).
  size_t in_flight() const { return held_.size(); }
  // Whether any unit of the stage recomputes its forward in the backward.
  bool recomputes() const;

 private:
  // A maximal contiguous run of units, [begin, end) in local indices, all recomputed or none.
  struct Run {
    size_t begin = 0, end = 0;
    bool recompute = false;
  };
  // What one micro-batch keeps from its forward until its weight gradient.
  struct Held {
    std::vector<SavedTensors> saved;  // per unit; empty for recomputed units until rebuilt
    std::vector<Tensor> run_inputs;   // per run: its input, kept for recomputed runs only
    MicroBatchInputs inputs;          // kept when a run is recomputed (views, no new bytes)
    int64_t tokens = 0;
    bool input_grad_done = false;
  };

  Held& held_for(int64_t microbatch, const char* action);
  // in.tokens, checked to be at least 1.
  int64_t tokens_of(const MicroBatchInputs& in) const;
  // Unit u (local index) on x, with the boundary after it checked.
  Tensor run_unit(size_t u, const Tensor& x, const MicroBatchInputs& in, SavedTensors& saved);
  // The input gradient of unit u (local index), with the boundary before it checked.
  Tensor unit_input_grad(size_t u, const Tensor& dy, int64_t tokens, SavedTensors& saved);
  // Throws std::logic_error when unit u replaced a parameter's gradient tensor instead of
  // accumulating into it: the optimizer and the gradient sums read the tensor materialised.
  void check_gradients_kept(size_t u) const;

  ModelDescription model_;  // a copy: the boundary checks outlive the caller's
  DeviceContext& ctx_;
  int64_t begin_, end_, num_units_;
  std::vector<std::unique_ptr<Layer>> units_;
  // Per unit, its parameters with the gradient tensor each was given: a copy, so that a
  // replaced one cannot be freed and handed out again at the same address.
  std::vector<std::vector<std::pair<Parameter*, Tensor>>> grads_;
  std::vector<Run> runs_;
  std::map<int64_t, Held> held_;  // by micro-batch
};

}  // namespace conveyor
