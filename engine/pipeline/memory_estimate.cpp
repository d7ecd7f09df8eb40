#include "engine/pipeline/memory_estimate.h"

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <string>

#include "engine/core/allocator.h"
#include "engine/core/tensor.h"
#include "engine/pipeline/optimizer.h"
#include "layers/layer.h"

namespace conveyor {

std::vector<StageActivationBytes> stage_activation_bytes(const std::vector<double>& saved,
                                                         const std::vector<double>& input,
                                                         const std::vector<StageRange>& ranges,
                                                         const std::vector<bool>& recomputed,
                                                         const std::vector<double>& pending) {
  std::vector<StageActivationBytes> out(ranges.size());
  for (size_t s = 0; s < ranges.size(); ++s) {
    for (int64_t u = ranges[s].begin; u < ranges[s].end; ++u) {
      const auto i = static_cast<size_t>(u);
      if (!pending.empty()) out[s].weight_pending += pending[i];
      const bool r = !recomputed.empty() && recomputed[i];
      if (!r) {
        out[s].kept += saved[i];
        continue;
      }
      // A run begins at the stage's first unit or after a unit that keeps its tensors. Its
      // first unit saves the kept input again on the rebuild, without a new allocation.
      const bool starts_run = u == ranges[s].begin || !recomputed[i - 1];
      if (starts_run) out[s].kept += input[i];
      const double saved_again = starts_run ? std::max(0.0, saved[i] - input[i]) : saved[i];
      out[s].rebuilt += saved_again;
      // The forward drops a unit's saved tensors once the next unit has run.
      out[s].forward_extra = std::max(out[s].forward_extra, saved_again);
    }
  }
  return out;
}

std::vector<double> peak_activation_bytes(const schedule::Schedule& schedule,
                                          const std::vector<StageActivationBytes>& stages,
                                          bool until_weight) {
  std::vector<double> out(schedule.ranks.size(), 0.0);
  for (size_t r = 0; r < schedule.ranks.size(); ++r) {
    double held = 0, peak = 0;
    for (const schedule::Action& a : schedule.ranks[r]) {
      if (a.stage < 0 || a.stage >= static_cast<int>(stages.size())) continue;
      const StageActivationBytes& b = stages[static_cast<size_t>(a.stage)];
      switch (a.kind) {
        case schedule::ActionKind::kForward:
          peak = std::max(peak, held + b.kept + b.forward_extra);
          held += b.kept;
          break;
        case schedule::ActionKind::kBackward:
          // A stage's backward runs every unit's input half before the weight halves.
          peak = std::max(peak, held + b.rebuilt + b.weight_pending);
          held -= b.kept;
          break;
        case schedule::ActionKind::kBackwardInput:
          if (until_weight) {
            held += b.rebuilt + b.weight_pending;
            peak = std::max(peak, held);
          } else {
            peak = std::max(peak, held + b.rebuilt + b.weight_pending);
            held -= b.kept;
          }
          break;
        case schedule::ActionKind::kBackwardWeight:
          if (until_weight) held -= b.kept + b.rebuilt + b.weight_pending;
          break;
        default:
          break;
      }
    }
    out[r] = peak;
  }
  return out;
}

std::vector<UnitCost> described_unit_costs(const ModelDescription& model, int64_t microbatch_tokens,
                                           const std::string& optimizer_kind, bool* complete) {
  const double slots = optimizer_kind == "sgd" ? 1.0 : 2.0;
  std::vector<UnitCost> units(static_cast<size_t>(model.num_units));
  for (int64_t u = 0; u < model.num_units; ++u) {
    UnitCost& cost = units[static_cast<size_t>(u)];
    const std::unique_ptr<Layer> layer = model.unit(u);  // outlives the pointers to its parameters
    double allocated = 0;  // one value or one gradient of each parameter
    for (Parameter* p : layer->parameters()) {
      cost.parameter_elements.push_back(shape_numel(p->shape));
      cost.parameter_bytes += 4.0 * static_cast<double>(shape_numel(p->shape));
      allocated += allocated_bytes(p->shape);
    }
    cost.optimizer_bytes = slots * allocated;
    cost.state_bytes = 2 * allocated + cost.optimizer_bytes;
    // The first unit's token ids are a view of the step's ids.
    if (u > 0) {
      const ActivationSpec spec = model.activation_at(u, microbatch_tokens);
      cost.input_bytes = allocated_bytes(spec.shape, spec.dtype);
    }
    const std::optional<ActivationMemory> memory = model.unit_memory(u, microbatch_tokens);
    if (!memory) {
      cost.activation_bytes = cost.input_bytes;
      if (complete != nullptr) *complete = false;
      continue;
    }
    cost.activation_bytes = memory->saved;
    cost.weight_pending_bytes = memory->weight_pending;
    cost.workspace_bytes = memory->workspace;
  }
  return units;
}

StepInputBytes step_input_bytes(int64_t microbatch_tokens, int microbatches) {
  const double ids = allocated_bytes({microbatches, microbatch_tokens}, DType::kI32);
  return {ids, ids + microbatches * allocated_bytes({microbatch_tokens})};
}

std::vector<RankMemoryEstimate> estimate_rank_memory(const ModelDescription& model,
                                                     const std::vector<StageRange>& ranges,
                                                     const schedule::Schedule& schedule,
                                                     const std::string& optimizer_kind,
                                                     int64_t microbatch_tokens,
                                                     const RecomputeSpec& recompute,
                                                     const std::vector<double>& unit_saved_bytes) {
  if (static_cast<int>(ranges.size()) != schedule.num_stages())
    throw std::invalid_argument("memory estimate: " + std::to_string(ranges.size()) +
                                " stage ranges for a schedule of " +
                                std::to_string(schedule.num_stages()) + " stages");
  const auto num_units = static_cast<size_t>(model.num_units);
  if (!unit_saved_bytes.empty() && unit_saved_bytes.size() != num_units)
    throw std::invalid_argument("memory estimate: saved bytes of " +
                                std::to_string(unit_saved_bytes.size()) + " units for a model of " +
                                std::to_string(num_units) + " units");
  bool complete = true;
  std::vector<UnitCost> units =
      described_unit_costs(model, microbatch_tokens, optimizer_kind, &complete);
  std::vector<double> saved, input, pending;
  for (size_t u = 0; u < num_units; ++u) {
    if (!unit_saved_bytes.empty()) units[u].activation_bytes = unit_saved_bytes[u];
    saved.push_back(units[u].activation_bytes);
    input.push_back(units[u].input_bytes);
    pending.push_back(units[u].weight_pending_bytes);
  }
  std::vector<RankMemoryEstimate> out(static_cast<size_t>(schedule.num_ranks()));
  for (size_t s = 0; s < ranges.size(); ++s) {
    RankMemoryEstimate& r =
        out[static_cast<size_t>(schedule.placement.rank_of(static_cast<int>(s)))];
    for (int64_t u = ranges[s].begin; u < ranges[s].end; ++u) {
      const UnitCost& unit = units[static_cast<size_t>(u)];
      const double value = (unit.state_bytes - unit.optimizer_bytes) / 2;
      r.parameter_bytes += value;
      r.gradient_bytes += value;
      r.optimizer_bytes += unit.optimizer_bytes;
    }
  }
  // The step's inputs count as state of the first and last units, as the planner counts them.
  const StepInputBytes step = step_input_bytes(microbatch_tokens, schedule.num_microbatches);
  units.front().state_bytes += step.first_unit;
  units.back().state_bytes += step.last_unit;
  out[static_cast<size_t>(schedule.placement.rank_of(0))].batch_bytes += step.first_unit;
  out[static_cast<size_t>(schedule.placement.rank_of(schedule.num_stages() - 1))].batch_bytes +=
      step.last_unit;

  const std::vector<bool> recomputed =
      recompute.any() ? recompute.per_unit(model.num_units) : std::vector<bool>{};
  const std::vector<double> held = peak_activation_bytes(
      schedule, stage_activation_bytes(saved, input, ranges, recomputed, pending), true);
  const std::vector<double> totals = rank_memory(units, ranges, schedule, recomputed);
  for (size_t r = 0; r < out.size(); ++r) {
    RankMemoryEstimate& e = out[r];
    e.activation_bytes = held[r];
    e.transient_bytes = totals[r] - (e.parameter_bytes + e.gradient_bytes + e.optimizer_bytes +
                                     e.activation_bytes + e.batch_bytes);
    e.complete = complete;
  }
  return out;
}

double sharded_optimizer_bytes(const UnitCost& unit, int replica, int replicas) {
  if (replicas < 1 || replica < 0 || replica >= replicas)
    throw std::invalid_argument("sharded optimizer state: replica " + std::to_string(replica) +
                                " is not one of " + std::to_string(replicas) +
                                " replicas; expected 0 to replicas - 1, with at least one");
  double whole = 0, piece = 0;
  for (const int64_t n : unit.parameter_elements) {
    whole += allocated_bytes({n});
    piece += allocated_bytes({replica_piece(n, replica, replicas).count});
  }
  if (whole == 0) return unit.optimizer_bytes / replicas;
  // optimizer_bytes is a whole number of tensors (slots) of each parameter's shape.
  return unit.optimizer_bytes / whole * piece;
}

std::vector<RankMemoryEstimate> estimate_replica_memory(
    const ModelDescription& model, const std::vector<StageRange>& ranges,
    const schedule::Schedule& schedule, const std::string& optimizer_kind,
    int64_t microbatch_tokens, int replicas, bool shard_optimizer, const RecomputeSpec& recompute) {
  if (replicas < 1)
    throw std::invalid_argument("memory estimate: " + std::to_string(replicas) +
                                " replicas; expected at least 1");
  const std::vector<RankMemoryEstimate> pipeline =
      estimate_rank_memory(model, ranges, schedule, optimizer_kind, microbatch_tokens, recompute);
  const size_t p = pipeline.size();
  std::vector<RankMemoryEstimate> out;
  for (int d = 0; d < replicas; ++d) out.insert(out.end(), pipeline.begin(), pipeline.end());
  if (!shard_optimizer || replicas == 1) return out;
  const std::vector<UnitCost> units =
      described_unit_costs(model, microbatch_tokens, optimizer_kind);
  for (int d = 0; d < replicas; ++d) {
    for (size_t r = 0; r < p; ++r) out[d * p + r].optimizer_bytes = 0;
    for (size_t s = 0; s < ranges.size(); ++s) {
      const auto r = static_cast<size_t>(schedule.placement.rank_of(static_cast<int>(s)));
      for (int64_t u = ranges[s].begin; u < ranges[s].end; ++u)
        out[d * p + r].optimizer_bytes +=
            sharded_optimizer_bytes(units[static_cast<size_t>(u)], d, replicas);
    }
  }
  return out;
}

double cpu_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024.0;
  return 0.0;
}

std::string bytes_text(double bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (bytes >= 1024.0 * 1024 * 1024)
    out << bytes / (1024.0 * 1024 * 1024) << " GiB";
  else if (bytes >= 1024.0 * 1024)
    out << bytes / (1024.0 * 1024) << " MiB";
  else if (bytes >= 1024.0)
    out << bytes / 1024.0 << " KiB";
  else
    out << std::setprecision(0) << bytes << " B";
  return out.str();
}

}  // namespace conveyor
