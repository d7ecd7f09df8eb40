#pragma once
// A layer of a user's that throws what is not a std::exception: it passes its input through,
// and its input gradient throws an int.
#include <string>
#include <vector>

#include "layers/layer.h"

namespace conveyor::testing {

class ThrowsAnInt : public Layer {
 public:
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override { return {}; }
  Tensor forward(DeviceContext&, const Tensor& x, const MicroBatchInputs&, SavedTensors&) override {
    return x;
  }
  Tensor backward_input(DeviceContext&, const Tensor&, SavedTensors&) override { throw 1; }
  void backward_weight(DeviceContext&, SavedTensors&) override {}

 private:
  std::string name_ = "thrower";
};

}  // namespace conveyor::testing
