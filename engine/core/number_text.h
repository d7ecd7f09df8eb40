#pragma once
// A number as a message shows it: the shortest of fixed and scientific notation at six
// significant digits (0.003, 1e+39, nan, inf), as an ostream writes a double by default.
#include <sstream>
#include <string>

namespace conveyor {

inline std::string number_text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

}  // namespace conveyor
