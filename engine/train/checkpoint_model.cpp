#include "engine/train/checkpoint_model.h"

#include <stdexcept>

#include "engine/schedule/input_file.h"
#include "engine/train/checkpoint_io.h"

namespace conveyor {

std::vector<std::string> optimizer_state_names(const std::string& kind,
                                               const std::string& parameter) {
  if (kind == "adamw") return {"optimizer.m." + parameter, "optimizer.v." + parameter};
  if (kind == "sgd") return {"optimizer.momentum." + parameter};
  throw std::invalid_argument("optimizer kind must be adamw or sgd, got '" + kind + "'");
}

namespace {

// Whether `text` can stand in a checkpoint's JSON (the manifest, a shard's header): UTF-8.
bool is_json_text(const std::string& text) {
  try {
    (void)nlohmann::json(text).dump();
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

}  // namespace

void check_checkpoint_names(const ModelDescription& model) {
  if (!is_json_text(model.name))
    throw std::invalid_argument("ModelDescription::name '" + escaped_for_message(model.name) +
                                "' is not valid UTF-8, which a checkpoint's manifest (JSON) "
                                "must hold; give the model a UTF-8 name");
  for (int64_t index = 0; index < model.num_units; ++index) {
    const std::unique_ptr<Layer> unit = model.unit(index);
    for (const Parameter* p : unit->parameters()) {
      if (p->name.rfind("optimizer.", 0) == 0 || p->name == "__metadata__")
        throw std::invalid_argument(
            "parameter '" + p->name + "' of unit " + std::to_string(index) +
            " cannot be checkpointed under its name: names beginning \"optimizer.\" hold "
            "optimizer state, and \"__metadata__\" is the safetensors header's; rename it");
      if (!is_json_text(p->name))
        throw std::invalid_argument("parameter '" + escaped_for_message(p->name) + "' of unit " +
                                    std::to_string(index) +
                                    " cannot be checkpointed under its name: it is not valid "
                                    "UTF-8, which a shard's header (JSON) must hold; rename it");
    }
  }
}

void check_checkpoint_source(const TokenSource& source) {
  const std::string described = source.describe();
  if (!is_json_text(described))
    throw std::invalid_argument("the data source's describe() '" + escaped_for_message(described) +
                                "' is not valid UTF-8, which a checkpoint's manifest (JSON) "
                                "must hold; describe the source in UTF-8");
}

std::vector<NamedTensor> checkpoint_tensors(Optimizer& optimizer, bool with_parameters) {
  std::vector<NamedTensor> out;
  const auto& params = optimizer.parameters();
  if (with_parameters)
    for (Parameter* p : params) out.push_back({p->name, p->value});
  const std::vector<Tensor>& state = optimizer.state();
  const size_t per_parameter = params.empty() ? 0 : state.size() / params.size();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto names = optimizer_state_names(optimizer.config().kind, params[i]->name);
    if (names.size() != per_parameter)
      throw std::logic_error("optimizer " + optimizer.config().kind + " holds " +
                             std::to_string(state.size()) + " state tensors for " +
                             std::to_string(params.size()) + " parameters");
    for (size_t k = 0; k < names.size(); ++k) {
      if (!optimizer.sharded()) {
        out.push_back({names[k], state[i * per_parameter + k]});
        continue;
      }
      const ParameterShard& shard = optimizer.shards()[i];
      if (shard.count == 0) continue;  // the other replicas hold all of it
      out.push_back(
          {names[k], state[i * per_parameter + k], TensorPiece{params[i]->shape, shard.offset}});
    }
  }
  return out;
}

int checkpoint_shard_count(PipelineExecutor& executor) {
  // Every rank's optimizer is sharded or none is; ask one this process holds.
  return executor.optimizer(executor.local_ranks().front()).sharded() ? executor.num_world_ranks()
                                                                      : executor.num_ranks();
}

std::vector<NamedTensor> rank_checkpoint_tensors(PipelineExecutor& executor, int rank) {
  const bool replica_zero = rank < executor.num_ranks();
  Optimizer& optimizer = executor.optimizer(rank);
  if (!replica_zero && !optimizer.sharded()) return {};
  return checkpoint_tensors(optimizer, /*with_parameters=*/replica_zero);
}

std::vector<TensorSpec> checkpoint_tensor_specs(PipelineExecutor& executor) {
  // Replica 0's ranks name every tensor; a piece stands for its whole tensor.
  std::vector<TensorSpec> out;
  for (int r : executor.local_ranks()) {
    if (r >= executor.num_ranks()) continue;
    Optimizer& optimizer = executor.optimizer(r);
    const std::vector<Tensor>& state = optimizer.state();
    const auto& params = optimizer.parameters();
    for (Parameter* p : params) out.push_back({p->name, p->value.dtype(), p->shape});
    const size_t per_parameter = params.empty() ? 0 : state.size() / params.size();
    for (size_t i = 0; i < params.size(); ++i) {
      const auto names = optimizer_state_names(optimizer.config().kind, params[i]->name);
      for (size_t k = 0; k < names.size() && k < per_parameter; ++k)
        out.push_back({names[k], state[i * per_parameter + k].dtype(), params[i]->shape});
    }
  }
  return out;
}

void load_rank_checkpoint(const Checkpoint& checkpoint, PipelineExecutor& executor, int rank) {
  // Every replica loads the weights; a sharded optimizer reads only its range of the state.
  Optimizer& optimizer = executor.optimizer(rank);
  checkpoint.read(checkpoint_tensors(optimizer));
  optimizer.set_steps_taken(checkpoint.state().optimizer_steps);
}

void verify_rank_checkpoint(const Checkpoint& checkpoint, PipelineExecutor& executor, int rank) {
  checkpoint.verify(checkpoint_tensors(executor.optimizer(rank)));
}

std::vector<StagePlacement> stage_placements(const schedule::Schedule& schedule,
                                             const std::vector<StageRange>& ranges) {
  if (static_cast<int>(ranges.size()) != schedule.num_stages())
    throw std::invalid_argument("stage_placements: " + std::to_string(ranges.size()) +
                                " unit ranges for a schedule of " +
                                std::to_string(schedule.num_stages()) + " stages");
  std::vector<StagePlacement> out;
  for (int s = 0; s < schedule.num_stages(); ++s)
    out.push_back({s, schedule.placement.rank_of(s), ranges[s].begin, ranges[s].end});
  return out;
}

nlohmann::json describe_model(const ModelConfig& model) {
  return {{"preset", model.preset},     {"d_model", model.d_model},
          {"n_layers", model.n_layers}, {"vocab", model.vocab},
          {"hidden", model.hidden},     {"activation", ops::activation_name(model.activation)},
          {"ln_eps", model.ln_eps}};
}

}  // namespace conveyor
