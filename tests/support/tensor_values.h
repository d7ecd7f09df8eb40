#pragma once
// A 1-D f32 tensor on `ctx`'s device holding `values`, for tests that move known values.
#include <vector>

#include "engine/core/device_context.h"

namespace conveyor::testing {

inline Tensor filled(DeviceContext& ctx, const std::vector<float>& values) {
  Tensor t = ctx.empty({static_cast<int64_t>(values.size())});
  copy_from_host(t, values.data(), values.size() * sizeof(float));
  return t;
}

}  // namespace conveyor::testing
