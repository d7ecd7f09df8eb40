#pragma once
// Helpers for the CPU kernel tests: double copies and central finite differences.
#include <cstring>
#include <functional>
#include <vector>

namespace conveyor::testing {

inline std::vector<double> to_double(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Central differences (f(v + h e_k) - f(v - h e_k)) / 2h for every k; v is restored.
inline std::vector<double> numeric_gradient(std::vector<double>& v,
                                            const std::function<double()>& f, double h) {
  std::vector<double> grad(v.size());
  for (size_t k = 0; k < v.size(); ++k) {
    const double saved = v[k];
    v[k] = saved + h;
    const double plus = f();
    v[k] = saved - h;
    const double minus = f();
    v[k] = saved;
    grad[k] = (plus - minus) / (2.0 * h);
  }
  return grad;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace conveyor::testing
