#pragma once
// A number as a message shows it: the shortest of fixed and scientific notation at six
// significant digits (0.003, 1e+39, nan, inf), as an ostream writes a double by default.
#include <sstream>
#include <string>
#include <string_view>

namespace conveyor {

inline std::string number_text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

// A count and its noun, the noun singular for one: counted(1, "step") is "1 step",
// counted(3, "batch", "batches") "3 batches". `many` defaults to `one` and an s.
template <typename Count>
std::string counted(Count n, std::string_view one, std::string_view many = {}) {
  std::string text = std::to_string(n) + " ";
  if (n == 1) return text.append(one);
  return many.empty() ? text.append(one).append("s") : text.append(many);
}

}  // namespace conveyor
