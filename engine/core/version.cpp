#include "engine/core/version.h"

namespace conveyor {
const char* version() { return CONVEYOR_VERSION; }
}  // namespace conveyor
