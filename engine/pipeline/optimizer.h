#pragma once
// The optimizer of one rank: AdamW (or SGD with momentum) over that rank's parameters, with
// the learning-rate schedule (linear warm-up, then cosine decay to min_lr) and gradient
// clipping by a global norm that the caller computes across ranks (the executor does, in
// the one-stage order).
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/device_context.h"
#include "layers/parameter.h"

namespace conveyor {

struct OptimizerConfig {
  std::string kind = "adamw";  // adamw | sgd
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 20;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.9;   // sgd
  double clip_norm = 1.0;  // 0 disables clipping

  // Throws std::invalid_argument naming the bad field as `prefix` and its name ("lr"), with
  // the value given and what is expected. Each float setting must also hold as the float the
  // kernels read: a beta that rounds to 1 or an eps that rounds to 0 would give NaN weights.
  void validate(std::string_view prefix = "OptimizerConfig::") const;
};

// Learning rate at 1-based `step` of `total_steps` (0: before the first step). Throws
// std::invalid_argument for a negative step or total.
double learning_rate(const OptimizerConfig& config, int64_t step, int64_t total_steps);

// Clipping factor for a gradient of global norm `norm`: min(1, clip / norm).
float clip_scale(const OptimizerConfig& config, double norm);

// The elements [offset, offset + count) of a parameter that one optimizer updates: its
// shard of the state when the optimizer state is sharded over data-parallel replicas.
struct ParameterShard {
  int64_t offset = 0;
  int64_t count = 0;
};

// ZeRO-1: replica d of D (`replica` of `replicas`) owns the elements [n*d/D, n*(d+1)/D) of every
// parameter of n elements (maybe none). Cut per parameter, not over a stage's flattened
// parameters, so the pieces do not depend on how the model is cut into stages: the global
// gradient norm is summed from the pieces' squares in (parameter, replica) order, the same
// number whatever the stage count, sharded or not.
ParameterShard replica_piece(int64_t numel, int replica, int replicas);

class Optimizer {
 public:
  // `shards` empty: every element of every parameter, with state of the parameters' shapes.
  // Otherwise one shard per parameter: the state holds `count` elements of each, and step()
  // updates only those elements of the value (the others are another replica's to update).
  Optimizer(DeviceContext& ctx, std::vector<Parameter*> params, OptimizerConfig config,
            std::vector<ParameterShard> shards = {});

  // One update at 1-based `step` with learning rate `lr`, gradients scaled by `grad_scale`.
  void step(int64_t step, double lr, float grad_scale);

  const std::vector<Parameter*>& parameters() const { return params_; }
  const OptimizerConfig& config() const { return config_; }
  // Optimizer state in parameter order: AdamW (m, v) per parameter, SGD (momentum); of the
  // shards' sizes when sharded.
  std::vector<Tensor>& state() { return state_; }
  bool sharded() const { return !shards_.empty(); }
  const std::vector<ParameterShard>& shards() const { return shards_; }
  int64_t steps_taken() const { return steps_taken_; }
  void set_steps_taken(int64_t steps) { steps_taken_ = steps; }

 private:
  DeviceContext& ctx_;
  std::vector<Parameter*> params_;
  OptimizerConfig config_;
  std::vector<Tensor> state_;
  std::vector<ParameterShard> shards_;
  int64_t steps_taken_ = 0;
};

}  // namespace conveyor
