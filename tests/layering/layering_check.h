#pragma once
// Reads the `#include "…"` lines of a source tree and reports every include that goes against
// the order of the layers (docs/architecture.md):
//   kernels <- engine/core <- {layers, comm}; engine/schedule alone;
//   engine/pipeline <- engine/train <- engine/conveyor.h (the public umbrella) <- tools
// A folder may include itself and the folders its layer stands on, nothing else; a quoted
// include that names no file of the tree is reported too, so a typo cannot hide an edge.
#include <filesystem>
#include <string>
#include <vector>

namespace conveyor::layering {

struct Violation {
  std::string file;  // relative to the root
  int line = 0;
  std::string include;
  std::string reason;
};

// The layer a source path (relative to the root) belongs to, or "" when it is in none.
std::string layer_of(const std::string& relative_path);

// Whether a file of layer `from` may include a file of layer `to`.
bool may_include(const std::string& from, const std::string& to);

// Every violation under `root` (its library folders kernels/, engine/, layers/, comm/,
// tools/), in file order; `files_checked` receives how many files were read.
std::vector<Violation> check_tree(const std::filesystem::path& root, int* files_checked = nullptr);

std::string to_string(const Violation& v);

}  // namespace conveyor::layering
