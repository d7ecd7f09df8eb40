#include "layers/parameter.h"

#include "kernels/init.h"
#include "layers/ops.h"

namespace conveyor {

void Parameter::materialize(DeviceContext& ctx, uint64_t seed) {
  value = ctx.empty(shape);
  grad = ctx.zeros(shape);
  if (init.kind == InitSpec::Kind::kUniform)
    ops::init_uniform(ctx, value, seed, kernels::parameter_key(name), init.low, init.high);
  else
    ops::fill(ctx, value, init.low);
}

void zero_grads(DeviceContext& ctx, const std::vector<Parameter*>& params) {
  for (Parameter* p : params) ctx.fill_zero(p->grad);
}

}  // namespace conveyor
