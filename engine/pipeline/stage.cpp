#include "engine/pipeline/stage.h"

#include <exception>
#include <stdexcept>
#include <string>

namespace conveyor {
namespace {

// Runs a unit's forward or backward, naming the unit in a usage error it throws (its kind
// kept, the error nested): a layer's own check ("linear weight: expected shape [8, 8], got
// [8, 16]") does not say which unit of the model it is. Other failures (memory, a device)
// pass as they are. Anything else a layer throws (`throw 1;`) becomes a std::runtime_error:
// the rank threads and the trainer report std::exception, and a foreign exception leaving
// a rank thread would end the process.
template <class F>
auto in_unit(int64_t index, const Layer& unit, F&& run) -> decltype(run()) {
  const auto prefix = [&] { return "unit " + std::to_string(index) + " ('" + unit.name() + "')"; };
  try {
    return run();
  } catch (const std::invalid_argument& e) {
    std::throw_with_nested(std::invalid_argument(prefix() + ": " + e.what()));
  } catch (const std::logic_error& e) {
    std::throw_with_nested(std::logic_error(prefix() + ": " + e.what()));
  } catch (const std::exception&) {
    throw;
  } catch (...) {
    throw std::runtime_error(prefix() +
                             " threw an exception not derived from std::exception; a layer "
                             "reports a failure with one (std::runtime_error, ...)");
  }
}

}  // namespace

Stage::Stage(const ModelDescription& model, int64_t begin, int64_t end, DeviceContext& ctx,
             uint64_t seed, const RecomputeSpec& recompute)
    : model_(model), ctx_(ctx), begin_(begin), end_(end), num_units_(model.num_units) {
  model.validate();
  if (begin < 0 || end > num_units_ || begin >= end)
    throw std::invalid_argument("stage units [" + std::to_string(begin) + ", " +
                                std::to_string(end) + ") are not a non-empty range of the " +
                                std::to_string(num_units_) + " model units");
  const std::vector<bool> marked = recompute.per_unit(num_units_);
  for (int64_t u = begin; u < end; ++u) {
    const auto local = static_cast<size_t>(u - begin);
    const bool r = marked[static_cast<size_t>(u)];
    if (runs_.empty() || runs_.back().recompute != r)
      runs_.push_back({local, local + 1, r});
    else
      runs_.back().end = local + 1;
  }
  units_ = model.units(begin, end);
  for (auto& unit : units_) {
    auto& kept = grads_.emplace_back();
    for (Parameter* p : unit->parameters()) {
      p->materialize(ctx_, seed);
      kept.emplace_back(p, p->grad);
    }
  }
}

void Stage::check_gradients_kept(size_t u) const {
  for (const auto& [p, grad] : grads_[u]) {
    const Tensor& now = p->grad;
    if (now.storage() == grad.storage() && now.offset() == grad.offset() &&
        now.dtype() == grad.dtype() && now.shape() == grad.shape())
      continue;
    throw std::logic_error("unit " + std::to_string(begin_ + static_cast<int64_t>(u)) + " ('" +
                           units_[u]->name() + "') replaced the gradient of '" + p->name +
                           "'; accumulate into Parameter::grad (+=)");
  }
}

bool Stage::recomputes() const {
  for (const Run& run : runs_)
    if (run.recompute) return true;
  return false;
}

std::vector<Parameter*> Stage::parameters() {
  std::vector<Parameter*> out;
  for (auto& unit : units_)
    for (Parameter* p : unit->parameters()) out.push_back(p);
  return out;
}

Stage::Held& Stage::held_for(int64_t microbatch, const char* action) {
  auto it = held_.find(microbatch);
  if (it == held_.end())
    throw std::logic_error(std::string(action) + " of micro-batch " + std::to_string(microbatch) +
                           " on units [" + std::to_string(begin_) + ", " + std::to_string(end_) +
                           ") before its forward");
  return it->second;
}

int64_t Stage::tokens_of(const MicroBatchInputs& in) const {
  if (in.tokens < 1)
    throw std::invalid_argument(
        "a stage's forward needs the micro-batch's token count "
        "(MicroBatchInputs::tokens), got " +
        std::to_string(in.tokens));
  return in.tokens;
}

Tensor Stage::run_unit(size_t u, const Tensor& x, const MicroBatchInputs& in, SavedTensors& saved) {
  const int64_t global = begin_ + static_cast<int64_t>(u);
  Tensor y = in_unit(global, *units_[u], [&] { return units_[u]->forward(ctx_, x, in, saved); });
  model_.check_boundary(global + 1, in.tokens, y, "the output of", global);
  return y;
}

Tensor Stage::unit_input_grad(size_t u, const Tensor& dy, int64_t tokens, SavedTensors& saved) {
  const int64_t global = begin_ + static_cast<int64_t>(u);
  Tensor dx =
      in_unit(global, *units_[u], [&] { return units_[u]->backward_input(ctx_, dy, saved); });
  if (global > 0)  // the first unit takes token ids: no gradient
    model_.check_boundary(global, tokens, dx, "the input gradient of", global);
  return dx;
}

Tensor Stage::forward(int64_t microbatch, const Tensor& input, const MicroBatchInputs& in) {
  if (held_.count(microbatch))
    throw std::logic_error("forward of micro-batch " + std::to_string(microbatch) +
                           " run twice before its backward");
  model_.check_boundary(begin_, tokens_of(in), input, "the input of", begin_);
  Held& held = held_[microbatch];
  held.tokens = in.tokens;
  held.saved.resize(units_.size());
  held.run_inputs.resize(runs_.size());
  Tensor x = input;
  try {
    for (size_t r = 0; r < runs_.size(); ++r) {
      const Run& run = runs_[r];
      if (!run.recompute) {
        for (size_t u = run.begin; u < run.end; ++u) x = run_unit(u, x, in, held.saved[u]);
        continue;
      }
      // Only the run's input stays; each unit's saved tensors go as soon as the next has run.
      held.run_inputs[r] = x;
      for (size_t u = run.begin; u < run.end; ++u) {
        SavedTensors discarded;
        x = run_unit(u, x, in, discarded);
      }
    }
  } catch (...) {
    held_.erase(microbatch);  // a failed forward holds nothing for a backward
    throw;
  }
  if (recomputes()) held.inputs = in;
  return x;
}

Tensor Stage::forward_only(const Tensor& input, const MicroBatchInputs& in) {
  model_.check_boundary(begin_, tokens_of(in), input, "the input of", begin_);
  SavedTensors discarded;
  Tensor x = input;
  for (size_t u = 0; u < units_.size(); ++u) {
    x = run_unit(u, x, in, discarded);
    discarded.clear();
  }
  return x;
}

Tensor Stage::backward_input(int64_t microbatch, const Tensor& dy) {
  Held& held = held_for(microbatch, "backward");
  if (held.input_grad_done)
    throw std::logic_error("input gradient of micro-batch " + std::to_string(microbatch) +
                           " computed twice");
  if (!is_last())  // the loss head makes its own gradient
    model_.check_boundary(end_, held.tokens, dy, "the output gradient given to", end_ - 1);
  Tensor g = dy;
  for (size_t r = runs_.size(); r-- > 0;) {
    const Run& run = runs_[r];
    if (run.recompute) {
      // The same forward on the same input: the saved tensors are bitwise the ones dropped.
      Tensor x = held.run_inputs[r];
      for (size_t u = run.begin; u < run.end; ++u)
        x = in_unit(begin_ + static_cast<int64_t>(u), *units_[u],
                    [&] { return units_[u]->forward(ctx_, x, held.inputs, held.saved[u]); });
      held.run_inputs[r] = Tensor();  // the first unit keeps it when its backward needs it
    }
    for (size_t u = run.end; u-- > run.begin;)
      g = unit_input_grad(u, g, held.tokens, held.saved[u]);
  }
  held.input_grad_done = true;
  return g;
}

void Stage::backward_weight(int64_t microbatch) {
  Held& held = held_for(microbatch, "weight gradient");
  if (!held.input_grad_done)
    throw std::logic_error("weight gradient of micro-batch " + std::to_string(microbatch) +
                           " before its input gradient");
  for (size_t u = units_.size(); u-- > 0;) {
    in_unit(begin_ + static_cast<int64_t>(u), *units_[u],
            [&] { units_[u]->backward_weight(ctx_, held.saved[u]); });
    check_gradients_kept(u);
  }
  held_.erase(microbatch);
}

Tensor Stage::backward(int64_t microbatch, const Tensor& dy) {
  Tensor dx = backward_input(microbatch, dy);
  backward_weight(microbatch);
  return dx;
}

}  // namespace conveyor
