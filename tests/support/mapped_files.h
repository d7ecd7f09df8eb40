#pragma once
// Whether this process has mapped a file whose path contains `name` (a shared library the
// dynamic loader or dlopen brought in, say), read from /proc/self/maps.
#include <fstream>
#include <string>

namespace conveyor::testing {

inline bool process_maps_file(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(name) != std::string::npos) return true;
  return false;
}

}  // namespace conveyor::testing
