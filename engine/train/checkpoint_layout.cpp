#include "engine/train/checkpoint_layout.h"

#include <charconv>
#include <string_view>
#include <system_error>

#include "engine/train/checkpoint_error.h"
#include "engine/train/checkpoint_io.h"

namespace conveyor::checkpoint_layout {
namespace fs = std::filesystem;

namespace {

std::optional<int64_t> step_before(std::string_view name, std::string_view suffix) {
  if (name.size() <= 5 + suffix.size() || !name.starts_with("step_") || !name.ends_with(suffix))
    return std::nullopt;
  const std::string_view rest = name.substr(5, name.size() - 5 - suffix.size());
  if (rest.size() > 18) return std::nullopt;
  for (char c : rest)
    if (c < '0' || c > '9') return std::nullopt;
  int64_t step = 0;
  std::from_chars(rest.data(), rest.data() + rest.size(), step);
  return step;
}

}  // namespace

std::optional<int64_t> step_of_folder(const std::string& name, bool temp) {
  return step_before(name, temp ? ".tmp" : "");
}

std::optional<int64_t> step_of_removal(const std::string& name) {
  return step_before(name, kRemovalSuffix);
}

std::string step_folder_name(int64_t step) { return "step_" + std::to_string(step); }

std::string read_latest_name(const fs::path& latest) {
  std::string name = checkpoint_io::read_small_file(latest, 4096);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' '))
    name.pop_back();
  return name;
}

std::optional<int64_t> published_step(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / kLatestName, ec)) return std::nullopt;
  try {
    return step_of_folder(read_latest_name(dir / kLatestName), /*temp=*/false);
  } catch (const CheckpointError&) {
    return std::nullopt;
  }
}

}  // namespace conveyor::checkpoint_layout
