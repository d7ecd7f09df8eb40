#pragma once
// The names inside a checkpoint folder (docs/checkpoint-format.md): a step's folder
// step_<N> (step_<N>.tmp while it is written, step_<N>.removing while an old one is removed),
// the manifest in it, and the `latest` file naming the newest published one. Shared by the
// writer and the loader of checkpoint.h.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace conveyor::checkpoint_layout {

inline constexpr const char* kManifestName = "manifest.json";
inline constexpr const char* kLatestName = "latest";
// An old checkpoint is renamed step_<N>.removing before its files go, so that one whose
// removal fails halfway is never taken for a checkpoint.
inline constexpr const char* kRemovalSuffix = ".removing";

// The step of a folder named "step_<N>" (and, with `temp`, "step_<N>.tmp"); nullopt otherwise.
std::optional<int64_t> step_of_folder(const std::string& name, bool temp);
// The step of a folder named "step_<N>.removing"; nullopt otherwise.
std::optional<int64_t> step_of_removal(const std::string& name);

std::string step_folder_name(int64_t step);

// The folder name a `latest` file holds: its one line, without the line end.
std::string read_latest_name(const std::filesystem::path& latest);

// The step of the folder that `dir`/latest names; nullopt when there is no readable `latest`
// naming a step folder.
std::optional<int64_t> published_step(const std::filesystem::path& dir);

}  // namespace conveyor::checkpoint_layout
