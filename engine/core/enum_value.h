#pragma once
// A program that sets a config's fields directly can put any number of an enum's underlying
// type in it by a cast; a switch then matches no case and falls through to a default that
// names nothing, or the value runs as another. The checks of configs refuse such a value here.
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace conveyor {

// Throws std::invalid_argument unless `value` is one of `allowed`, saying "<field> must be
// <expected>, got the value <n>".
template <class Enum>
void check_enum_value(Enum value, std::initializer_list<Enum> allowed, const std::string& field,
                      const std::string& expected) {
  for (const Enum a : allowed)
    if (value == a) return;
  const auto n = static_cast<long long>(static_cast<std::underlying_type_t<Enum>>(value));
  throw std::invalid_argument(field + " must be " + expected + ", got the value " +
                              std::to_string(n));
}

}  // namespace conveyor
