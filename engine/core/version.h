#pragma once
namespace conveyor {
// "0.1.0"; the project version from CMake.
const char* version();
// The git commit the build was configured from (12 hex digits, "-dirty" when the tree had
// changes then), or "unknown" outside a git checkout. Read when CMake configures, so a
// build reconfigured at another commit says so, an incremental one may not.
const char* build_commit();
}  // namespace conveyor
