#pragma once
// Which units of a model cost the same. The reference model's blocks run the same kernels on
// the same sizes, and differ in their names and initial values alone, which change no time.
// Timed apart, each carries its own noise, and the planner would cut between equal blocks by
// it; profile_units times such units as one and gives them one cost. A model says which of
// its units do the same work (ModelDescription::unit_kind): a layer's type and shapes alone
// cannot tell a GELU from a ReLU.
#include <cstdint>
#include <vector>

#include "layers/model.h"

namespace conveyor {

// For each unit of `model`, the first unit identical to it (itself when no unit before it
// is, and every unit when the model names no kinds), at micro-batches of `tokens` tokens.
// Identical: of the same unit_kind, and, so that a kind named wrongly is caught, the same
// layer type with the same parameter shapes in the same order, the same answers to
// activation_memory and accepted_ids, between boundaries of the same shapes and dtypes
// (model.boundary_spec) on both sides. Builds every unit once, without materialising its
// parameters.
std::vector<int64_t> identical_unit_leaders(const ModelDescription& model, int64_t tokens);

}  // namespace conveyor
