#include "engine/pipeline/memory_estimate.h"

#include <algorithm>
#include <fstream>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <string>

#include "engine/core/allocator.h"
#include "engine/core/tensor.h"

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
      out[s].rebuilt += starts_run ? std::max(0.0, saved[i] - input[i]) : saved[i];
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
          held += b.kept;
          peak = std::max(peak, held);
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
  const auto units = static_cast<size_t>(model.num_units);
  if (!unit_saved_bytes.empty() && unit_saved_bytes.size() != units)
    throw std::invalid_argument("memory estimate: saved bytes of " +
                                std::to_string(unit_saved_bytes.size()) + " units for a model of " +
                                std::to_string(units) + " units");
  const std::vector<int64_t> unit_params = model.unit_parameter_counts();
  const double states = optimizer_kind == "sgd" ? 1.0 : 2.0;
  // The tensor entering each unit; the first unit's token ids are a view of the step's ids.
  std::vector<double> input(units, 0.0), boundary(units, 0.0);
  for (size_t u = 0; u < units; ++u) {
    if (u == 0) {
      boundary[u] = static_cast<double>(microbatch_tokens) * 4.0;
      continue;
    }
    const ActivationSpec spec = model.activation_at(static_cast<int64_t>(u), microbatch_tokens);
    double elements = 1.0;
    for (const int64_t d : spec.shape) elements *= static_cast<double>(d);
    boundary[u] = elements * static_cast<double>(dtype_size(spec.dtype));
    input[u] = static_cast<double>(CachingAllocator::round_size(static_cast<size_t>(boundary[u])));
  }
  const std::vector<double>& saved = unit_saved_bytes.empty() ? boundary : unit_saved_bytes;
  const std::vector<StageActivationBytes> stages = stage_activation_bytes(
      saved, input, ranges,
      recompute.any() ? recompute.per_unit(model.num_units) : std::vector<bool>{});
  const std::vector<double> activations = peak_activation_bytes(schedule, stages, false);
  std::vector<RankMemoryEstimate> out(static_cast<size_t>(schedule.num_ranks()));
  for (size_t s = 0; s < ranges.size(); ++s) {
    double params = 0.0;
    for (int64_t u = ranges[s].begin; u < ranges[s].end; ++u)
      params += static_cast<double>(unit_params[static_cast<size_t>(u)]);
    RankMemoryEstimate& r =
        out[static_cast<size_t>(schedule.placement.rank_of(static_cast<int>(s)))];
    r.parameter_bytes += 4.0 * params;
    r.gradient_bytes += 4.0 * params;
    r.optimizer_bytes += 4.0 * states * params;
  }
  for (size_t r = 0; r < out.size(); ++r) out[r].activation_bytes = activations[r];
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
