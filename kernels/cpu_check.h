#pragma once
// Argument checks shared by the CPU kernels: a bad size is a caller bug that should say so
// (std::invalid_argument naming the kernel, the argument and the value), not loop zero times
// or index out of bounds.
#include <cstdint>
#include <stdexcept>
#include <string>

namespace conveyor::kernels::cpu::detail {

inline void require_at_least(const char* kernel, const char* name, int64_t value, int64_t min) {
  if (value < min)
    throw std::invalid_argument(std::string(kernel) + ": " + name + " must be >= " +
                                std::to_string(min) + ", got " + std::to_string(value));
}

}  // namespace conveyor::kernels::cpu::detail
