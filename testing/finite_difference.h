// SPDX-License-Identifier: Apache-2.0
// Central finite differences of a float64 objective in inputs stored as fp32, for the
// references' gradient tests: every element compared (each comparison asserted), and the
// largest analytic magnitude returned so a test can show its check was not of zeros alone.
// Test-only.
//
// Tolerance: a central difference with step h has truncation error h^2/6 |f'''| and rounding
// error ~ 1e-16 |f| / h. With h = 1e-3 (the step actually stored in fp32 is divided by) and the
// tests' O(1) inputs, |f'''| stays below ~30, so the error is below ~5e-6 absolute; callers use
// atol 1e-5 plus rtol 1e-4, far below the O(1e-2..1) gradients a wrong formula would be off by.
#ifndef LOSSD_TESTING_FINITE_DIFFERENCE_H_
#define LOSSD_TESTING_FINITE_DIFFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {

inline constexpr double kFdAtol = 1e-5;
inline constexpr double kFdRtol = 1e-4;

// (f(v + h) - f(v - h)) / (the stored difference of the two steps), *value restored after.
inline double CentralDifference(const std::function<double()>& f, float* value,
                                float step = 1e-3f) {
  const float orig = *value;
  const float up = orig + step, down = orig - step;
  *value = up;
  const double f_up = f();
  *value = down;
  const double f_down = f();
  *value = orig;
  return (f_up - f_down) / (static_cast<double>(up) - static_cast<double>(down));
}

// EXPECTs analytic[k] near the central difference of f in values[k], for k < analytic.size();
// returns max_k |analytic[k]|.
inline double ExpectGradientMatches(const std::string& what, float* values,  // (n)
                                    const std::vector<double>& analytic,     // (n)
                                    const std::function<double()>& f,
                                    double atol = kFdAtol, double rtol = kFdRtol) {
  double largest = 0;
  for (size_t k = 0; k < analytic.size(); ++k) {
    const double fd = CentralDifference(f, &values[k]);
    EXPECT_NEAR(analytic[k], fd, atol + rtol * std::fabs(fd)) << what << "[" << k << "]";
    largest = std::max(largest, std::fabs(analytic[k]));
  }
  return largest;
}

}  // namespace lossd

#endif  // LOSSD_TESTING_FINITE_DIFFERENCE_H_
