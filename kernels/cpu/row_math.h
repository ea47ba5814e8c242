// SPDX-License-Identifier: Apache-2.0
// Arithmetic the CPU backend's row functions share (row_pass for cross-entropy, kind_rows for
// the other loss kinds): a vectorisable exp for non-positive arguments, the lane count of
// their partial sums, and a row's max and sum of exp below it. Header-only so that it inlines into every target_clones variant.
#ifndef LOSSD_KERNELS_CPU_ROW_MATH_H_
#define LOSSD_KERNELS_CPU_ROW_MATH_H_

#include <cstdint>
#include <cstring>

namespace lossd {

// exp(x) for x <= 0 (every argument here is z - max or z - lse), to about 1 ulp, in a form
// the compiler vectorises: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 polynomial
// (Cephes' coefficients), 2^n put into the exponent bits. Below -87 (where exp underflows to
// a denormal) it returns about 1e-38 instead of 0; a NaN stays NaN.
inline __attribute__((always_inline)) float ExpNonPositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  // Round to nearest by adding and subtracting 1.5 * 2^23 (vectorises, unlike nearbyint).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // n is NaN when x is; converting a NaN to int is undefined, so feed 0 (p stays NaN).
  const int32_t e = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

// Independent fp32 partial sums per row reduction: vectorisable, and more accurate.
inline constexpr int kLanes = 16;

// The max of z (v >= 1) and, in *arg, the first index reaching it.
inline __attribute__((always_inline)) float RowMax(const float* z,  // (v)
                                                   int64_t v, int64_t* arg) {
  float m = z[0];
  int64_t a = 0;  // a local, not *arg, so the loop keeps it in a register
  for (int64_t j = 1; j < v; ++j) {
    if (z[j] > m) {
      m = z[j];
      a = j;
    }
  }
  *arg = a;
  return m;
}

// sum_j exp(z_j - m) for m = max_j z_j, in kLanes fp32 partial sums added in double. Two passes
// (max, then this) rather than an online max/sum: the row is in cache, and the exact max needs
// no rescaling.
inline __attribute__((always_inline)) double SumExpBelowMax(const float* z,  // (v)
                                                            int64_t v, float m) {
  float acc[kLanes] = {0};
  int64_t j = 0;
  for (; j + kLanes <= v; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += ExpNonPositive(z[j + l] - m);
  }
  for (int l = 0; j < v; ++j, ++l) acc[l] += ExpNonPositive(z[j] - m);
  double sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += acc[l];
  return sum;
}

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_ROW_MATH_H_
