#include "engine/version.h"

namespace conveyor {
const char* version() { return "0.1.0"; }
}  // namespace conveyor
