#include "engine/pipeline/stage.h"

#include <stdexcept>
#include <string>

namespace conveyor {

Stage::Stage(const ModelDescription& model, int64_t begin, int64_t end, DeviceContext& ctx,
             uint64_t seed)
    : ctx_(ctx), begin_(begin), end_(end), num_units_(model.num_units) {
  model.validate();
  if (begin < 0 || end > num_units_ || begin >= end)
    throw std::invalid_argument("stage units [" + std::to_string(begin) + ", " +
                                std::to_string(end) + ") are not a non-empty range of the " +
                                std::to_string(num_units_) + " model units");
  units_ = model.units(begin, end);
  for (Parameter* p : parameters()) p->materialize(ctx_, seed);
}

std::vector<Parameter*> Stage::parameters() {
  std::vector<Parameter*> out;
  for (auto& unit : units_)
    for (Parameter* p : unit->parameters()) out.push_back(p);
  return out;
}

std::vector<SavedTensors>& Stage::saved_for(int64_t microbatch, const char* action) {
  auto it = saved_.find(microbatch);
  if (it == saved_.end())
    throw std::logic_error(std::string(action) + " of micro-batch " + std::to_string(microbatch) +
                           " on units [" + std::to_string(begin_) + ", " + std::to_string(end_) +
                           ") before its forward");
  return it->second;
}

Tensor Stage::forward(int64_t microbatch, const Tensor& input, const MicroBatchInputs& in) {
  if (saved_.count(microbatch))
    throw std::logic_error("forward of micro-batch " + std::to_string(microbatch) +
                           " run twice before its backward");
  auto& saved = saved_[microbatch];
  saved.resize(units_.size());
  Tensor x = input;
  for (size_t u = 0; u < units_.size(); ++u) x = units_[u]->forward(ctx_, x, in, saved[u]);
  return x;
}

Tensor Stage::forward_only(const Tensor& input, const MicroBatchInputs& in) {
  SavedTensors discarded;
  Tensor x = input;
  for (auto& unit : units_) {
    x = unit->forward(ctx_, x, in, discarded);
    discarded.clear();
  }
  return x;
}

Tensor Stage::backward_input(int64_t microbatch, const Tensor& dy) {
  auto& saved = saved_for(microbatch, "backward");
  if (input_grad_done_[microbatch])
    throw std::logic_error("input gradient of micro-batch " + std::to_string(microbatch) +
                           " computed twice");
  Tensor g = dy;
  for (size_t u = units_.size(); u-- > 0;) g = units_[u]->backward_input(ctx_, g, saved[u]);
  input_grad_done_[microbatch] = true;
  return g;
}

void Stage::backward_weight(int64_t microbatch) {
  auto& saved = saved_for(microbatch, "weight gradient");
  if (!input_grad_done_[microbatch])
    throw std::logic_error("weight gradient of micro-batch " + std::to_string(microbatch) +
                           " before its input gradient");
  for (size_t u = units_.size(); u-- > 0;) units_[u]->backward_weight(ctx_, saved[u]);
  saved_.erase(microbatch);
  input_grad_done_.erase(microbatch);
}

Tensor Stage::backward(int64_t microbatch, const Tensor& dy) {
  Tensor dx = backward_input(microbatch, dy);
  backward_weight(microbatch);
  return dx;
}

}  // namespace conveyor
