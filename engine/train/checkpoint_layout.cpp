#include "engine/train/checkpoint_layout.h"

#include <charconv>
#include <string_view>
#include <system_error>

#include "engine/train/checkpoint_error.h"
#include "engine/train/checkpoint_io.h"

namespace conveyor::checkpoint_layout {
namespace fs = std::filesystem;

std::optional<int64_t> step_of_folder(const std::string& name, bool temp) {
  std::string_view rest = name;
  if (!rest.starts_with("step_")) return std::nullopt;
  rest.remove_prefix(5);
  if (temp) {
    if (!rest.ends_with(".tmp")) return std::nullopt;
    rest.remove_suffix(4);
  }
  if (rest.empty() || rest.size() > 18) return std::nullopt;
  for (char c : rest)
    if (c < '0' || c > '9') return std::nullopt;
  int64_t step = 0;
  std::from_chars(rest.data(), rest.data() + rest.size(), step);
  return step;
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
