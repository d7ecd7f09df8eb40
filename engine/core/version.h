#pragma once
namespace conveyor {
// "0.1.0"; the project version from CMake.
const char* version();
}  // namespace conveyor
