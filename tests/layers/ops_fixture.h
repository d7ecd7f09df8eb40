#pragma once
// The fixture of the tensor-level ops' tests (ops_checks_test.cpp, ops_test.cpp): random
// operands, operands on another device made without a GPU, and the check that an op refuses
// each bad operand naming it.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/core/allocator.h"
#include "engine/core/device_context.h"
#include "engine/core/tensor.h"
#include "kernels/activation.h"
#include "kernels/cross_entropy.h"
#include "kernels/elementwise.h"
#include "kernels/embedding.h"
#include "kernels/init.h"
#include "kernels/layernorm.h"
#include "kernels/linear.h"
#include "kernels/optimizer.h"
#include "kernels/reduce.h"
#include "layers/ops.h"
#include "support/kernel_test_util.h"
#include "support/test_util.h"

namespace conveyor::testing {

// Host memory that says it is on CUDA device 0: operands on the wrong device, made without a
// GPU. The ops must refuse them before any kernel could touch the memory.
class HostMemoryLabelledCuda final : public AllocatorBackend {
 public:
  Device device() const override { return Device::cuda(0); }
  void* system_allocate(size_t bytes) override { return std::aligned_alloc(64, bytes); }
  void system_free(void* ptr) override { std::free(ptr); }
  void* record_event(void*) override { return nullptr; }
  bool event_done(void*) override { return true; }
  void destroy_event(void*) override {}
};

// `call` must throw std::invalid_argument whose message starts with "<what>: " and holds
// every one of `says`.
inline ::testing::AssertionResult rejects(const std::function<void()>& call,
                                          const std::string& what,
                                          const std::vector<std::string>& says) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    if (message.rfind(what + ": ", 0) != 0)
      return ::testing::AssertionFailure()
             << "the message does not start with '" << what << ": ': " << message;
    for (const std::string& part : says)
      if (message.find(part) == std::string::npos)
        return ::testing::AssertionFailure() << "the message lacks '" << part << "': " << message;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure()
           << "threw another type than std::invalid_argument: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// A shape an op must refuse for one operand, and what its message says then.
struct WrongShape {
  Shape shape;
  std::string says;
};

// One tensor operand of an op: the name its messages use, a valid value, and its wrong shapes.
struct Operand {
  std::string what;
  Tensor valid;
  std::vector<WrongShape> wrong_shapes;
  bool optional = false;  // undefined means absent (a bias), which is valid
};

using OpCall = std::function<void(const std::vector<Tensor>&)>;

class OpsTest : public ::testing::Test {
 protected:
  // Seeded random values of `dtype`: floats in [-1, 1], or ints in [0, int_high].
  Tensor random(const Shape& shape, uint64_t seed, DType dtype = DType::kF32,
                int32_t int_high = 3) {
    Tensor t = ctx_.empty(shape, dtype);
    const auto n = static_cast<size_t>(t.numel());
    if (dtype == DType::kI32) {
      const auto v = random_ints(n, seed, 0, int_high);
      std::copy(v.begin(), v.end(), t.data<int32_t>());
    } else {
      const auto v = random_floats(n, seed);
      std::copy(v.begin(), v.end(), t.data<float>());
    }
    return t;
  }
  Tensor positive(const Shape& shape, uint64_t seed) {
    Tensor t = ctx_.empty(shape);
    const auto v = random_floats(static_cast<size_t>(t.numel()), seed, 0.5f, 2.0f);
    std::copy(v.begin(), v.end(), t.data<float>());
    return t;
  }
  Tensor on_other_device(const Shape& shape, DType dtype) {
    return Tensor::empty(shape, dtype, cuda_labelled_);
  }
  static const float* ptr(const Tensor& t) { return t.data<float>(); }
  static std::vector<float> values(const Tensor& t) { return to_vector_f32(t); }

  // Replaces each operand in turn by an undefined tensor, one of the other dtype, one on another
  // device and each of its wrong shapes: each time the op must refuse, naming that operand.
  void expect_operand_checks(const std::vector<Operand>& operands, const OpCall& call) {
    std::vector<Tensor> valid;
    for (const Operand& o : operands) valid.push_back(o.valid);
    ASSERT_NO_THROW(call(valid)) << "the valid operands must pass the checks";
    uint64_t seed = 900;
    for (size_t i = 0; i < operands.size(); ++i) {
      const Operand& o = operands[i];
      SCOPED_TRACE("operand '" + o.what + "'");
      const auto with = [&](const Tensor& t) -> std::function<void()> {
        std::vector<Tensor> args = valid;
        args[i] = t;
        return [call, args] { call(args); };
      };
      const DType dtype = o.valid.dtype();
      const DType other = dtype == DType::kF32 ? DType::kI32 : DType::kF32;
      if (!o.optional)
        EXPECT_TRUE(
            rejects(with(Tensor()), o.what, {"expected a defined tensor, got an undefined one"}));
      EXPECT_TRUE(rejects(
          with(random(o.valid.shape(), ++seed, other)), o.what,
          {std::string("expected dtype ") + dtype_name(dtype) + ", got " + dtype_name(other)}));
      EXPECT_TRUE(rejects(with(on_other_device(o.valid.shape(), dtype)), o.what,
                          {"expected a tensor on cpu, got one on cuda:0"}));
      for (const WrongShape& wrong : o.wrong_shapes)
        EXPECT_TRUE(rejects(with(random(wrong.shape, ++seed, dtype)), o.what, {wrong.says}))
            << "shape " << shape_to_string(wrong.shape);
    }
  }

  DeviceContext ctx_{Device::cpu()};
  std::shared_ptr<CachingAllocator> cuda_labelled_ =
      std::make_shared<CachingAllocator>(std::make_unique<HostMemoryLabelledCuda>());
};

}  // namespace conveyor::testing
