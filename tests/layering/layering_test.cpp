// The layering of the library is a fact the build checks: every `#include "…"` of kernels/,
// engine/, layers/, comm/ and tools/ must point down the order of docs/architecture.md. The
// fixture tree beside this file plants one include of each wrong kind, so the checker is
// shown to catch them.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <tuple>

#include "layering/layering_check.h"

namespace conveyor::layering {
namespace {

TEST(Layering, TheLibraryTreeHasNoIncludeAgainstTheOrder) {
  int files = 0;
  const auto violations = check_tree(CONVEYOR_SOURCE_DIR, &files);
  std::string listing;
  for (const auto& v : violations) listing += to_string(v) + "\n";
  EXPECT_TRUE(violations.empty()) << listing;
  // Not vacuous: the real tree was read.
  EXPECT_GT(files, 50);
}

TEST(Layering, EveryLayerOfTheLibraryHoldsFiles) {
  // If a folder moved without the table following, its files would fall into no layer and be
  // reported above; this checks the other direction: every layer of the table is in use.
  std::map<std::string, int> per_layer;
  for (const char* path :
       {"kernels/linear.h", "engine/core/tensor.h", "layers/ops.h", "comm/transport.h",
        "engine/schedule/schedule.h", "engine/pipeline/executor.h", "engine/train/trainer.h",
        "tools/main.cpp"}) {
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(CONVEYOR_SOURCE_DIR) / path)) << path;
    per_layer[layer_of(path)]++;
  }
  EXPECT_EQ(per_layer.size(), 8u);
}

TEST(Layering, PlantedIncludesInTheFixtureAreCaughtWithFileAndLine) {
  const auto violations = check_tree(CONVEYOR_LAYERING_FIXTURE_DIR);
  std::set<std::tuple<std::string, int, std::string>> seen;
  for (const auto& v : violations) seen.insert({v.file, v.line, v.include});
  const std::set<std::tuple<std::string, int, std::string>> expected = {
      {"engine/core/upward.h", 4, "layers/layer.h"},
      {"engine/schedule/schedule.h", 3, "engine/core/tensor.h"},
      {"comm/transport.h", 4, "layers/layer.h"},
      {"engine/pipeline/executor.cpp", 3, "engine/train/trainer.h"},
      {"engine/train/trainer.h", 4, "engine/core/tensr.h"},
  };
  EXPECT_EQ(seen, expected);
  for (const auto& v : violations) {
    if (v.include == "engine/core/tensr.h")
      EXPECT_NE(v.reason.find("names no file"), std::string::npos) << to_string(v);
    else
      EXPECT_NE(v.reason.find("may not include"), std::string::npos) << to_string(v);
  }
}

TEST(Layering, TheOrderPointsDownOnly) {
  EXPECT_TRUE(may_include("core", "kernels"));
  EXPECT_FALSE(may_include("kernels", "core"));
  EXPECT_FALSE(may_include("core", "layers"));
  EXPECT_FALSE(may_include("layers", "comm"));
  EXPECT_FALSE(may_include("comm", "layers"));
  EXPECT_FALSE(may_include("schedule", "core"));
  EXPECT_TRUE(may_include("pipeline", "schedule"));
  EXPECT_FALSE(may_include("pipeline", "train"));
  EXPECT_TRUE(may_include("train", "pipeline"));
  EXPECT_TRUE(may_include("api", "train"));
  EXPECT_FALSE(may_include("train", "api"));
  EXPECT_TRUE(may_include("tools", "api"));
  EXPECT_EQ(layer_of("engine/conveyor.h"), "api");
  EXPECT_EQ(layer_of("engine/stray.h"), "");
  EXPECT_EQ(layer_of("tests/engine/core/tensor_test.cpp"), "");
}

}  // namespace
}  // namespace conveyor::layering
