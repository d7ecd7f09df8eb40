// Model presets and their validation; model descriptions: the reference model as one, and
// the checks that catch an incomplete description before anything is built from it.
#include "layers/model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/device_context.h"
#include "engine/core/tensor.h"
#include "layers/basic_layers.h"
#include "layers/blocks.h"

namespace conveyor {
namespace {

TEST(ModelPresets, KnownAndUnknown) {
  EXPECT_EQ(model_preset("small").d_model, 1024);
  EXPECT_EQ(model_preset("medium").n_layers, 16);
  EXPECT_EQ(model_preset("medium").vocab, 32768);
  EXPECT_THROW(model_preset("huge"), std::invalid_argument);
  ModelConfig bad = model_preset("tiny");
  bad.d_model = 0;
  EXPECT_THROW(bad.validate(), std::invalid_argument);
}

// The tiny preset made smaller: d=12, hidden 20, 3 blocks (5 units).
ModelConfig small_tiny() {
  ModelConfig config = model_preset("tiny");
  config.d_model = 12;
  config.hidden = 20;
  config.n_layers = 3;
  return config;
}

TEST(ModelDescription, TheReferenceModelIsOne) {
  ModelConfig config = small_tiny();
  const ModelDescription model = reference_model(config);
  EXPECT_NO_THROW(model.validate());
  EXPECT_EQ(model.num_units, 5);
  EXPECT_EQ(model.vocab, config.vocab);
  EXPECT_EQ(model.unit(0)->name(), "embed");
  EXPECT_EQ(model.unit(2)->name(), "blocks.1");
  EXPECT_EQ(model.unit(4)->name(), "head");
  EXPECT_EQ(model.count_parameters(), count_parameters(config));
  const std::vector<int64_t> counts = model.unit_parameter_counts();
  ASSERT_EQ(counts.size(), 5u);
  EXPECT_EQ(counts[0], config.vocab * config.d_model);
  EXPECT_EQ(counts[1], counts[3]);  // identical blocks
  for (int64_t boundary = 1; boundary < model.num_units; ++boundary) {
    const ActivationSpec spec = model.activation_at(boundary, 7);
    EXPECT_EQ(spec.shape, (Shape{7, 12}));
    EXPECT_EQ(spec.dtype, DType::kF32);
  }
  EXPECT_THROW(model.unit(5), std::out_of_range);
  EXPECT_THROW(model.activation_at(0, 7), std::out_of_range);
  config.d_model = 0;
  EXPECT_THROW(reference_model(config), std::invalid_argument);
}

// An empty or reversed range is a slip of the caller's arithmetic: it used to come back as no
// units at all, where a range past either end was refused.
TEST(ModelDescription, AnEmptyOrReversedRangeOfUnitsIsRefused) {
  const ModelConfig config = small_tiny();
  const ModelDescription model = reference_model(config);
  EXPECT_EQ(model.units(0, 5).size(), 5u);
  EXPECT_EQ(make_model_units(config, 4, 5).size(), 1u);
  for (const auto& [begin, end] :
       std::vector<std::pair<int64_t, int64_t>>{{3, 1}, {2, 2}, {0, 0}, {-1, 2}, {4, 6}}) {
    const std::string range = "(begin " + std::to_string(begin) + ", end " + std::to_string(end) +
                              ") is not a non-empty range of the model's 5 units; expected 0 "
                              "<= begin < end <= 5";
    try {
      model.units(begin, end);
      ADD_FAILURE() << "units(" << begin << ", " << end << ") was not refused";
    } catch (const std::out_of_range& e) {
      EXPECT_EQ(e.what(), "ModelDescription::units" + range);
    }
    try {
      make_model_units(config, begin, end);
      ADD_FAILURE() << "make_model_units(" << begin << ", " << end << ") was not refused";
    } catch (const std::out_of_range& e) {
      EXPECT_EQ(e.what(), "make_model_units" + range);
    }
  }
}

ModelDescription two_linear_units() {
  ModelDescription model;
  model.name = "two linears";
  model.num_units = 2;
  model.make_unit = [](int64_t index) -> std::unique_ptr<Layer> {
    return std::make_unique<Linear>("unit." + std::to_string(index), 4, 4);
  };
  model.activation = activation_rows(4);
  return model;
}

// What each check says matters as much as that it throws: the user has to fix the field.
std::string error_of(const ModelDescription& model) {
  try {
    model.validate();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(ModelDescription, IncompleteDescriptionsAreRejectedByName) {
  EXPECT_EQ(error_of(two_linear_units()), "");
  ModelDescription model = two_linear_units();
  model.num_units = 1;
  EXPECT_EQ(error_of(model),
            "model 'two linears' has 1 unit; at least 2 are needed (the first takes token ids, "
            "the last returns the loss)");
  model.num_units = 0;
  EXPECT_EQ(error_of(model),
            "model 'two linears' has 0 units; at least 2 are needed (the first takes token ids, "
            "the last returns the loss)");
  // Refused before any unit or activation is asked for: walking 2^40 of them took days before
  // a word (a description that gives up past 2^20 makes the test fail at once, not hang).
  model.num_units = int64_t{1} << 40;
  model.make_unit = [](int64_t index) -> std::unique_ptr<Layer> {
    if (index >= int64_t{1} << 20) throw std::invalid_argument("units past 2^20 were built");
    return std::make_unique<Linear>("unit." + std::to_string(index), 4, 4);
  };
  model.activation = [](int64_t boundary, int64_t tokens) {
    if (boundary >= int64_t{1} << 20) throw std::invalid_argument("boundaries past 2^20 asked");
    return ActivationSpec{{tokens, 4}};
  };
  EXPECT_EQ(error_of(model),
            "model 'two linears' has 1099511627776 units; at most 1048576 are taken "
            "(ModelDescription::num_units)");
  model = two_linear_units();
  model.make_unit = nullptr;
  EXPECT_NE(error_of(model).find("make_unit"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.activation = nullptr;
  EXPECT_NE(error_of(model).find("activation_rows"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.activation = [](int64_t, int64_t tokens) { return ActivationSpec{{tokens, 0}}; };
  EXPECT_NE(error_of(model).find("positive dimensions"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.vocab = -3;
  EXPECT_NE(error_of(model).find("vocab -3"), std::string::npos) << error_of(model);
  model = two_linear_units();
  model.make_unit = [](int64_t) { return std::unique_ptr<Layer>(); };
  EXPECT_THROW(model.unit(0), std::invalid_argument);
  EXPECT_THROW(activation_rows(0), std::invalid_argument);
}

// A unit that only lists parameters: what validate() inspects without running anything.
class ListedParameters : public Layer {
 public:
  ListedParameters(std::vector<Parameter> params, bool with_null = false)
      : params_(std::move(params)), with_null_(with_null) {}
  const std::string& name() const override { return name_; }
  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    for (Parameter& p : params_) out.push_back(&p);
    if (with_null_) out.push_back(nullptr);
    return out;
  }
  Tensor forward(DeviceContext&, const Tensor& x, const MicroBatchInputs&, SavedTensors&) override {
    return x;
  }
  Tensor backward_input(DeviceContext&, const Tensor& dy, SavedTensors&) override { return dy; }
  void backward_weight(DeviceContext&, SavedTensors&) override {}

 private:
  std::string name_ = "listed";
  std::vector<Parameter> params_;
  bool with_null_;
};

Parameter named(std::string name, Shape shape) {
  Parameter p;
  p.name = std::move(name);
  p.shape = std::move(shape);
  return p;
}

// Two units whose parameters are `first` and `second`.
ModelDescription listing(std::vector<Parameter> first, std::vector<Parameter> second,
                         bool null_in_second = false) {
  ModelDescription model = two_linear_units();
  model.make_unit = [=](int64_t index) -> std::unique_ptr<Layer> {
    return std::make_unique<ListedParameters>(index == 0 ? first : second,
                                              index == 1 && null_in_second);
  };
  return model;
}

TEST(ModelDescription, ParametersThatCouldNotBeBuiltOrSavedAreRejected) {
  EXPECT_EQ(error_of(listing({named("a", {2, 3})}, {named("b", {3})})), "");
  // The same name in two units, or twice in one: initial values and checkpoints collide.
  std::string error = error_of(listing({named("w", {2})}, {named("w", {2})}));
  EXPECT_NE(error.find("unit 1 has a parameter named 'w', as unit 0 has"), std::string::npos)
      << error;
  error = error_of(listing({}, {named("w", {2}), named("w", {3})}));
  EXPECT_NE(error.find("as it already has"), std::string::npos) << error;
  error = error_of(listing({named("", {2})}, {}));
  EXPECT_NE(error.find("unit 0 has a parameter without a name"), std::string::npos) << error;
  error = error_of(listing({}, {named("b", {4, 0})}));
  EXPECT_NE(error.find("gives parameter 'b' the shape [4, 0]"), std::string::npos) << error;
  // 2^62 floats, whose 2^64 bytes a size_t counts as 0: an estimate of nothing, then a write
  // past a tensor with no storage.
  error = error_of(listing({}, {named("huge", {int64_t{1} << 31, int64_t{1} << 31})}));
  EXPECT_NE(error.find("gives parameter 'huge' the shape [2147483648, 2147483648], more "
                       "elements than a tensor can hold"),
            std::string::npos)
      << error;
  error = error_of(listing({}, {named("scalar", {})}));
  EXPECT_NE(error.find("parameter 'scalar'"), std::string::npos) << error;
  error = error_of(listing({}, {}, /*null_in_second=*/true));
  EXPECT_NE(error.find("unit 1 lists a null parameter"), std::string::npos) << error;
  // A factory that fails for one unit fails validation, not the stage that builds it.
  ModelDescription model = two_linear_units();
  model.make_unit = [](int64_t index) -> std::unique_ptr<Layer> {
    if (index == 1) return nullptr;
    return std::make_unique<Linear>("unit.0", 4, 4);
  };
  EXPECT_NE(error_of(model).find("returned no layer for unit 1"), std::string::npos)
      << error_of(model);
}

// Non-finite initial values give NaN weights without a word; an empty range (a bound
// computed in integers) failed only in the kernel, without the parameter's name.
TEST(ModelDescription, InitialValuesThatAreNotFiniteOrAnEmptyRangeAreRejected) {
  auto with_init = [](InitSpec init) {
    Parameter p = named("w", {2, 3});
    p.init = init;
    return listing({}, {p});
  };
  EXPECT_EQ(error_of(with_init(InitSpec::uniform(0.5f))), "");
  EXPECT_EQ(error_of(with_init(InitSpec::constant(-2.0f))), "");
  const float inf = std::numeric_limits<float>::infinity();
  for (const InitSpec init :
       {InitSpec::uniform(0.0f), InitSpec::uniform(-1.0f), InitSpec::uniform(inf),
        InitSpec::uniform(std::nanf("")), InitSpec::uniform(std::numeric_limits<float>::max())}) {
    const std::string error = error_of(with_init(init));
    EXPECT_NE(error.find("unit 1 gives parameter 'w' [2, 3] initialised uniform ["),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("; expected finite bounds low < high"), std::string::npos) << error;
  }
  for (const float value : {inf, -inf, std::nanf("")}) {
    const std::string error = error_of(with_init(InitSpec::constant(value)));
    EXPECT_NE(error.find("initialised constant ["), std::string::npos) << error;
    EXPECT_NE(error.find("; expected a finite value"), std::string::npos) << error;
  }
}

// A kind cast from outside the enum was filled with `low` by materialize, and refused by the
// model's check as if it were a uniform range.
TEST(ModelDescription, AnInitialisationKindOutsideTheEnumIsRefused) {
  Parameter p = named("w", {2, 3});
  p.init = {static_cast<InitSpec::Kind>(7), 0.0f, 0.0f};
  const std::string error = error_of(listing({}, {p}));
  EXPECT_NE(error.find("unit 1 gives parameter 'w' [2, 3] initialised by an unknown kind [0, 0)"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("; expected InitSpec::kind to be InitSpec::Kind::kUniform or kConstant, "
                       "got the value 7"),
            std::string::npos)
      << error;
  DeviceContext ctx(Device::cpu());
  try {
    p.materialize(ctx, 1);
    ADD_FAILURE() << "InitSpec::Kind 7 was materialised";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "InitSpec::kind of parameter 'w' must be InitSpec::Kind::kUniform or kConstant, "
              "got the value 7");
  }
  EXPECT_FALSE(p.value.defined());
  p.init = InitSpec::constant(-2.0f);
  p.materialize(ctx, 1);
  EXPECT_EQ(to_vector_f32(p.value), std::vector<float>(6, -2.0f));
}

// A null pointer among the parameters was dereferenced (a segfault); now none is zeroed.
TEST(Parameter, ZeroGradsRefusesANullParameterAndZeroesNone) {
  DeviceContext ctx(Device::cpu());
  Parameter p = named("w", {2, 3});
  p.init = InitSpec::uniform(1.0f);
  p.materialize(ctx, 1);
  ops::add_(ctx, p.grad, p.value);
  const std::vector<float> before = to_vector_f32(p.grad);
  ASSERT_NE(before, std::vector<float>(6, 0.0f));
  try {
    zero_grads(ctx, {&p, nullptr});
    ADD_FAILURE() << "a null parameter was zeroed";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "zero_grads: parameter 1 of the 2 given is null; expected pointers to parameters "
              "(as Layer::parameters() returns them)");
  }
  EXPECT_EQ(to_vector_f32(p.grad), before);
  zero_grads(ctx, {&p});
  EXPECT_EQ(to_vector_f32(p.grad), std::vector<float>(6, 0.0f));
}

TEST(ModelConfig, AnActivationOutsideTheEnumIsRefused) {
  ModelConfig config = small_tiny();
  config.activation = static_cast<ops::ActivationKind>(7);
  try {
    config.validate();
    ADD_FAILURE() << "activation 7 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "ModelConfig::activation must be ops::ActivationKind::kGelu or kRelu, got the "
              "value 7");
  }
  config.activation = ops::ActivationKind::kRelu;
  EXPECT_NO_THROW(config.validate());
}

TEST(ModelDescription, ALayerOfAnActivationOutsideTheEnumIsRefused) {
  // A model of one's own builds its layers itself, past ModelConfig::validate.
  const auto kind = static_cast<ops::ActivationKind>(7);
  try {
    Activation("blocks.0.act", kind);
    ADD_FAILURE() << "activation 7 was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "Activation 'blocks.0.act': kind must be ops::ActivationKind::kGelu or kRelu, got "
              "the value 7");
  }
  EXPECT_THROW(MlpBlock("blocks.0", 4, 8, kind, 1e-5f), std::invalid_argument);
  EXPECT_NO_THROW(Activation("act", ops::ActivationKind::kRelu));
}

TEST(ModelConfig, ALayerNormEpsilonMustBeFiniteAndAboveZero) {
  ModelConfig config = small_tiny();
  for (const float eps : {0.0f, -1e-5f, std::numeric_limits<float>::infinity(), std::nanf("")}) {
    config.ln_eps = eps;
    try {
      config.validate();
      ADD_FAILURE() << "ln_eps " << eps << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("ModelConfig::ln_eps must be a finite number above 0"),
                std::string::npos)
          << e.what();
    }
    // The layers themselves refuse it too, for models of one's own.
    EXPECT_THROW(LayerNorm("ln", 4, eps), std::invalid_argument);
    EXPECT_THROW(MlpBlock("block", 4, 8, ops::ActivationKind::kGelu, eps), std::invalid_argument);
  }
  config.ln_eps = 1e-6f;
  EXPECT_NO_THROW(config.validate());
  try {
    LayerNorm("blocks.2.ln", 4, -1.0f);
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "LayerNorm 'blocks.2.ln': eps must be a finite number above 0, got -1");
  }
}

TEST(ModelDescription, AVocabularyLargerThanAnIdTableIsRejected) {
  // embed (ids < e) -> head (targets < h), for a model of vocab 8.
  auto embed_and_head = [](int64_t e, int64_t h) {
    ModelDescription model;
    model.name = "ids";
    model.num_units = 2;
    model.vocab = 8;
    model.activation = activation_rows(4);
    model.make_unit = [e, h](int64_t index) -> std::unique_ptr<Layer> {
      if (index == 0) return std::make_unique<Embedding>("embed", e, 4);
      return std::make_unique<LossHead>("head", 4, h);
    };
    return model;
  };
  EXPECT_EQ(error_of(embed_and_head(8, 8)), "");
  EXPECT_EQ(error_of(embed_and_head(9, 10)), "");  // larger tables take every id
  EXPECT_EQ(error_of(embed_and_head(5, 8)),
            "model 'ids' unit 0 accepts token ids below 5 but the model's vocab is 8; ids of "
            "the data could index past its table");
  EXPECT_NE(error_of(embed_and_head(8, 7)).find("unit 1 accepts target ids below 7"),
            std::string::npos);
}

// Each unit's own account of what it keeps, on the input the description gives it; that the
// figures are what the allocator measures is checked in engine/pipeline's unit_memory_test.
TEST(ModelDescription, UnitMemoryAsksEachUnitOnItsInput) {
  ModelConfig config = small_tiny();
  const ModelDescription model = reference_model(config);
  std::vector<ActivationMemory> memory;
  for (int64_t u = 0; u < model.num_units; ++u) {
    const std::optional<ActivationMemory> m = model.unit_memory(u, 7);
    ASSERT_TRUE(m.has_value()) << "unit " << u;
    memory.push_back(*m);
  }
  // The embedding keeps nothing of its own: its ids are a view of the step's.
  EXPECT_EQ(memory[0].saved, 0.0);
  EXPECT_EQ(memory[0].weight_pending, allocated_bytes({7, 12}));
  for (int64_t u = 2; u <= 3; ++u) {  // identical blocks
    EXPECT_EQ(memory[u].saved, memory[1].saved);
    EXPECT_EQ(memory[u].weight_pending, memory[1].weight_pending);
    EXPECT_EQ(memory[u].workspace, memory[1].workspace);
  }
  // A block keeps its input among other tensors; the head keeps its logits' gradient.
  EXPECT_GT(memory[1].saved, allocated_bytes({7, 12}));
  EXPECT_GT(memory[4].saved, allocated_bytes({7, config.vocab}));
  // A Linear unit sizes what it keeps from the activation the description gives it.
  ModelDescription linears = two_linear_units();
  EXPECT_EQ(linears.unit_memory(1, 300)->saved, allocated_bytes({300, 4}));
  EXPECT_THROW(model.unit_memory(5, 7), std::out_of_range);
}

// A layer's own memory figures reach the run's memory check: a NaN would read "needs about
// nan B", a negative figure let through a run that cannot fit.
class SaysItsMemory : public Linear {
 public:
  explicit SaysItsMemory(ActivationMemory says) : Linear("says", 4, 4), says_(says) {}
  std::optional<ActivationMemory> activation_memory(const Shape&) const override { return says_; }

 private:
  ActivationMemory says_;
};

TEST(ModelDescription, UnitMemoryThatIsNotAFiniteCountOfBytesIsRefused) {
  auto saying = [](ActivationMemory says) {
    ModelDescription model = two_linear_units();
    model.make_unit = [says](int64_t) -> std::unique_ptr<Layer> {
      return std::make_unique<SaysItsMemory>(says);
    };
    return model;
  };
  EXPECT_EQ(saying({64, 0, 128}).unit_memory(1, 5)->workspace, 128);
  const double nan = std::nan("");
  const double inf = std::numeric_limits<double>::infinity();
  for (const auto& [says, field] : {std::pair{ActivationMemory{nan, 0, 0}, "saved is nan"},
                                    std::pair{ActivationMemory{0, -64, 0}, "weight_pending is -64"},
                                    std::pair{ActivationMemory{0, 0, inf}, "workspace is inf"}}) {
    try {
      saying(says).unit_memory(1, 5);
      ADD_FAILURE() << field << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("model 'two linears' unit 1 ('says') says "
                                                       "activation_memory().") +
                                           field + " bytes for 5 tokens; expected a finite"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(ModelDescription, ACountPastInt64IsRefusedNotWrapped) {
  // fc1 and fc2 of each of 4 blocks hold 2^60 weights each (a tensor holds at most 2^61 - 1
  // floats): their sum passes 2^63.
  ModelConfig c = model_preset("tiny");
  c.d_model = int64_t{1} << 30;
  c.hidden = int64_t{1} << 30;
  c.n_layers = 4;
  c.vocab = 16;
  try {
    count_parameters(c);
    ADD_FAILURE() << "a count past int64_t was returned";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("parameters, more than a count can hold"),
              std::string::npos)
        << e.what();
  }
  // The reference model refuses such widths up front; a description of one's own is counted.
  ModelDescription big = two_linear_units();
  big.num_units = 8;
  big.make_unit = [](int64_t index) -> std::unique_ptr<Layer> {
    return std::make_unique<Linear>("unit." + std::to_string(index), int64_t{1} << 30,
                                    int64_t{1} << 30, /*bias=*/false);
  };
  try {
    big.count_parameters();
    ADD_FAILURE() << "a count past int64_t was returned";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("parameters, more than a count can hold"),
              std::string::npos)
        << e.what();
  }
}

// The command line's bounds, for programs too: the partitioner and validation walk every
// block, and a typo of a width would otherwise be refused only by the memory estimate.
TEST(ModelConfig, FieldsPastTheirBoundsAreRefusedNamingTheBound) {
  const auto refusal = [](void (*set)(ModelConfig&)) {
    ModelConfig c = model_preset("tiny");
    set(c);
    try {
      c.validate();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(refusal([](ModelConfig& c) { c.d_model = ModelConfig::kMaxWidth + 1; }),
            "ModelConfig::d_model must be from 1 to 65536, got 65537");
  EXPECT_EQ(refusal([](ModelConfig& c) { c.n_layers = 5000; }),
            "ModelConfig::n_layers must be from 1 to 4096, got 5000");
  EXPECT_EQ(refusal([](ModelConfig& c) { c.vocab = int64_t{1} << 31; }),
            "ModelConfig::vocab must be from 1 to 16777216, got 2147483648");
  EXPECT_EQ(refusal([](ModelConfig& c) { c.hidden = 0; }),
            "ModelConfig::hidden must be from 1 to 1048576, got 0");
  EXPECT_EQ(refusal([](ModelConfig& c) {
              c.d_model = ModelConfig::kMaxWidth;
              c.n_layers = ModelConfig::kMaxLayers;
              c.vocab = ModelConfig::kMaxVocab;
              c.hidden = ModelConfig::kMaxHidden;
            }),
            "accepted");
}

TEST(ModelDescription, AFactoryThatBuildsAnotherLayerOnALaterCallIsRefused) {
  const ModelConfig c = model_preset("tiny");
  ModelDescription model = reference_model(c);
  // Unit 1 built a second time comes back as unit 2 (other names): what a factory that
  // counts its calls, or draws its layers at random, does.
  int calls_of_unit_1 = 0;
  model.make_unit = [c, &calls_of_unit_1](int64_t i) {
    if (i == 1 && ++calls_of_unit_1 > 1) return make_model_unit(c, 2);
    return make_model_unit(c, i);
  };
  try {
    model.validate();
    ADD_FAILURE() << "a factory that builds another layer was taken";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("unit 1 is built differently by a second call of the unit factory"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("'blocks.0."), std::string::npos) << what;
    EXPECT_NE(what.find("'blocks.1."), std::string::npos) << what;
  }
  // The reference factory builds alike every time.
  EXPECT_NO_THROW(reference_model(c).validate());
}

// A layer of a size below 1 is refused as it is made, naming the layer and the size: used
// directly, outside a model's validation, it failed later in a kernel or allocation.
TEST(Layers, SizesBelowOneAreRefusedNamingTheLayer) {
  const auto refusal = [](auto make) -> std::string {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "not refused";
  };
  EXPECT_EQ(refusal([] { Linear("fc", -1, 4); }),
            "Linear 'fc': in (its input width) must be at least 1, got -1");
  EXPECT_EQ(refusal([] { Linear("fc", 4, 0); }),
            "Linear 'fc': out (its output width) must be at least 1, got 0");
  EXPECT_EQ(refusal([] { LayerNorm("ln", 0, 1e-5f); }),
            "LayerNorm 'ln': width must be at least 1, got 0");
  EXPECT_EQ(refusal([] { Embedding("emb", 0, 4); }),
            "Embedding 'emb': vocab must be at least 1, got 0");
  EXPECT_EQ(refusal([] { Embedding("emb", 8, -3); }),
            "Embedding 'emb': width must be at least 1, got -3");
  // Blocks made of them say which of their layers.
  EXPECT_EQ(refusal([] { LossHead("head", 4, 0, 1e-5f); }),
            "Linear 'head.proj': out (its output width) must be at least 1, got 0");
  EXPECT_EQ(refusal([] { Linear("fc", 1, 1); }), "not refused");
}

}  // namespace
}  // namespace conveyor
