#include "engine/pipeline/memory_estimate.h"

#include <fstream>
#include <stdexcept>
#include <string>

#include "engine/core/tensor.h"

namespace conveyor {

std::vector<RankMemoryEstimate> estimate_rank_memory(const ModelDescription& model,
                                                     const std::vector<StageRange>& ranges,
                                                     const schedule::Schedule& schedule,
                                                     const std::string& optimizer_kind,
                                                     int64_t microbatch_tokens) {
  if (static_cast<int>(ranges.size()) != schedule.num_stages())
    throw std::invalid_argument("memory estimate: " + std::to_string(ranges.size()) +
                                " stage ranges for a schedule of " +
                                std::to_string(schedule.num_stages()) + " stages");
  const std::vector<int64_t> unit_params = model.unit_parameter_counts();
  const double states = optimizer_kind == "sgd" ? 1.0 : 2.0;
  std::vector<double> stage_activation_bytes(ranges.size(), 0.0);
  std::vector<double> stage_params(ranges.size(), 0.0);
  for (size_t s = 0; s < ranges.size(); ++s) {
    for (int64_t u = ranges[s].begin; u < ranges[s].end; ++u) {
      stage_params[s] += static_cast<double>(unit_params[static_cast<size_t>(u)]);
      // The first unit takes token ids; every other unit keeps the activation it receives.
      if (u == 0) {
        stage_activation_bytes[s] += static_cast<double>(microbatch_tokens) * 4.0;
      } else {
        const ActivationSpec spec = model.activation_at(u, microbatch_tokens);
        double elements = 1.0;
        for (const int64_t d : spec.shape) elements *= static_cast<double>(d);
        stage_activation_bytes[s] += elements * static_cast<double>(dtype_size(spec.dtype));
      }
    }
  }
  const std::vector<schedule::InFlight> in_flight =
      schedule::in_flight_per_rank(schedule, stage_activation_bytes);
  std::vector<RankMemoryEstimate> out(static_cast<size_t>(schedule.num_ranks()));
  for (size_t s = 0; s < ranges.size(); ++s) {
    RankMemoryEstimate& r =
        out[static_cast<size_t>(schedule.placement.rank_of(static_cast<int>(s)))];
    r.parameter_bytes += 4.0 * stage_params[s];
    r.gradient_bytes += 4.0 * stage_params[s];
    r.optimizer_bytes += 4.0 * states * stage_params[s];
  }
  for (size_t r = 0; r < out.size(); ++r)
    out[r].activation_bytes = in_flight[r].peak_in_flight_bytes;
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

}  // namespace conveyor
