#include "engine/core/test_pause.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace conveyor {

void pause_if_asked(const char* variable, std::string_view point, std::string_view where) {
  const char* wanted = std::getenv(variable);
  if (wanted == nullptr || point != wanted) return;
  std::fprintf(stderr, "conveyor: paused %s %s\n", std::string(where).c_str(),
               std::string(point).c_str());
  std::fflush(stderr);
  for (;;) ::pause();
}

}  // namespace conveyor
