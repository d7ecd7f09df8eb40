#include "layers/parameter.h"

#include <stdexcept>
#include <string>

#include "engine/core/enum_value.h"
#include "kernels/init.h"
#include "layers/ops.h"

namespace conveyor {

void Parameter::materialize(DeviceContext& ctx, uint64_t seed) {
  // Checked first: a kind outside the enum would otherwise fill the value with `low`.
  check_enum_value(init.kind, {InitSpec::Kind::kUniform, InitSpec::Kind::kConstant},
                   "InitSpec::kind of parameter '" + name + "'",
                   "InitSpec::Kind::kUniform or kConstant");
  value = ctx.empty(shape);
  grad = ctx.zeros(shape);
  if (init.kind == InitSpec::Kind::kUniform)
    ops::init_uniform(ctx, value, seed, kernels::parameter_key(name), init.low, init.high);
  else
    ops::fill(ctx, value, init.low);
}

void zero_grads(DeviceContext& ctx, const std::vector<Parameter*>& params) {
  // All checked before any is zeroed, so that a refused call leaves every gradient as it was.
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i] == nullptr)
      throw std::invalid_argument("zero_grads: parameter " + std::to_string(i) + " of the " +
                                  std::to_string(params.size()) +
                                  " given is null; expected pointers to parameters (as "
                                  "Layer::parameters() returns them)");
  for (Parameter* p : params) ctx.fill_zero(p->grad);
}

}  // namespace conveyor
