#pragma once
// A trainable tensor with its global name (e.g. "blocks.3.fc1.weight"), its gradient and how
// it is initialised. Global names make a parameter the same object whichever stage holds it:
// initial values depend only on (seed, name), and checkpoints key tensors by name.
#include <memory>
#include <string>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/core/tensor.h"

namespace conveyor {

struct InitSpec {
  enum class Kind { kUniform, kConstant } kind = Kind::kConstant;
  float low = 0.0f;  // Uniform: [low, high); Constant: the value is `low`
  float high = 0.0f;

  static InitSpec uniform(float bound) { return {Kind::kUniform, -bound, bound}; }
  static InitSpec constant(float value) { return {Kind::kConstant, value, value}; }
};

// Whether `kind` is one of InitSpec::Kind's values (a cast can put any int there).
inline bool known_init_kind(InitSpec::Kind kind) {
  return kind == InitSpec::Kind::kUniform || kind == InitSpec::Kind::kConstant;
}

struct Parameter {
  std::string name;
  Shape shape;
  InitSpec init;
  bool weight_decay = true;  // matrices decay; biases and norm gains do not
  Tensor value;
  Tensor grad;  // accumulates (+=) over the micro-batches of a step

  // Allocates value and grad on `ctx`, initialises value from (seed, name) and zeroes grad.
  // Throws std::invalid_argument for an init.kind outside InitSpec::Kind.
  void materialize(DeviceContext& ctx, uint64_t seed);
};

// Zeroes every gradient (start of a step). Throws std::invalid_argument, zeroing none, when a
// pointer is null.
void zero_grads(DeviceContext& ctx, const std::vector<Parameter*>& params);

}  // namespace conveyor
