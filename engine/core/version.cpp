#include "engine/core/version.h"

namespace conveyor {
const char* version() { return CONVEYOR_VERSION; }
const char* build_commit() { return CONVEYOR_COMMIT; }
}  // namespace conveyor
