#include "layering/layering_check.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <map>
#include <regex>
#include <set>

namespace conveyor::layering {
namespace {

namespace fs = std::filesystem;

// Longest prefix first: engine/conveyor.h before engine/<layer>/.
const std::array<std::pair<const char*, const char*>, 9> kLayerOfPrefix = {{
    {"engine/conveyor.h", "api"},
    {"engine/core/", "core"},
    {"engine/schedule/", "schedule"},
    {"engine/pipeline/", "pipeline"},
    {"engine/train/", "train"},
    {"kernels/", "kernels"},
    {"layers/", "layers"},
    {"comm/", "comm"},
    {"tools/", "tools"},
}};

// What each layer stands on (besides itself); transitive closure written out, so the table
// reads as the rule.
const std::map<std::string, std::set<std::string>> kMayInclude = {
    {"kernels", {}},
    {"core", {"kernels"}},
    {"layers", {"core", "kernels"}},
    {"comm", {"core", "kernels"}},
    {"schedule", {}},
    {"pipeline", {"layers", "comm", "schedule", "core", "kernels"}},
    {"train", {"pipeline", "layers", "comm", "schedule", "core", "kernels"}},
    {"api", {"train", "pipeline", "layers", "comm", "schedule", "core", "kernels"}},
    {"tools", {"api", "train", "pipeline", "layers", "comm", "schedule", "core", "kernels"}},
};

const std::array<const char*, 5> kLibraryFolders = {"kernels", "engine", "layers", "comm", "tools"};

bool is_source(const fs::path& p) {
  const std::string ext = p.extension().string();
  return ext == ".h" || ext == ".cpp" || ext == ".cu" || ext == ".cuh";
}

}  // namespace

std::string layer_of(const std::string& relative_path) {
  for (const auto& [prefix, layer] : kLayerOfPrefix)
    if (relative_path.rfind(prefix, 0) == 0) return layer;
  return "";
}

bool may_include(const std::string& from, const std::string& to) {
  if (from == to) return true;
  auto it = kMayInclude.find(from);
  return it != kMayInclude.end() && it->second.count(to) > 0;
}

std::vector<Violation> check_tree(const fs::path& root, int* files_checked) {
  std::vector<fs::path> files;
  for (const char* folder : kLibraryFolders) {
    const fs::path dir = root / folder;
    if (!fs::is_directory(dir)) continue;
    for (const auto& entry : fs::recursive_directory_iterator(dir))
      if (entry.is_regular_file() && is_source(entry.path())) files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  if (files_checked) *files_checked = static_cast<int>(files.size());

  static const std::regex include_line(R"re(^\s*#\s*include\s*"([^"]+)")re");
  std::vector<Violation> out;
  for (const fs::path& file : files) {
    const std::string rel = fs::relative(file, root).generic_string();
    const std::string from = layer_of(rel);
    if (from.empty()) {
      out.push_back({rel, 0, "", "the file lies in no layer (folders: see layering_check.h)"});
      continue;
    }
    std::ifstream in(file);
    std::string text;
    int line_no = 0;
    while (std::getline(in, text)) {
      ++line_no;
      std::smatch m;
      if (!std::regex_search(text, m, include_line)) continue;
      const std::string inc = m[1];
      // A quoted include resolves against the including file's folder first, then the root.
      std::string target;
      if (fs::exists(file.parent_path() / inc))
        target = fs::relative(file.parent_path() / inc, root).lexically_normal().generic_string();
      else if (fs::exists(root / inc))
        target = fs::path(inc).lexically_normal().generic_string();
      if (target.empty()) {
        out.push_back({rel, line_no, inc, "names no file of the tree"});
        continue;
      }
      const std::string to = layer_of(target);
      if (to.empty()) {
        out.push_back({rel, line_no, inc, "includes a file that lies in no layer"});
      } else if (!may_include(from, to)) {
        out.push_back(
            {rel, line_no, inc, "layer '" + from + "' may not include layer '" + to + "'"});
      }
    }
  }
  return out;
}

std::string to_string(const Violation& v) {
  return v.file + ":" + std::to_string(v.line) + ": #include \"" + v.include + "\": " + v.reason;
}

}  // namespace conveyor::layering
