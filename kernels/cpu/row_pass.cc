// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/row_pass.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/cpu_convert.h"
#include "kernels/cpu/row_math.h"

namespace lossd {
namespace {

// The helpers below are inlined into each instruction-set variant of RowPass (always_inline:
// a call would run the baseline x86-64 code), so they vectorise as the one function did.
#define LOSSD_ROW_INLINE inline __attribute__((always_inline))

// sum_j cw_j z_j (sum_j z_j without weights) in kLanes partial sums, for label smoothing.
LOSSD_ROW_INLINE double WeightedSum(const RowPassParams& rp, const float* z) {
  const int64_t v = rp.v;
  float wz[kLanes] = {0};
  int64_t j = 0;
  if (rp.cw != nullptr) {
    for (; j + kLanes <= v; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) wz[l] += rp.cw[j + l] * z[j + l];
    }
    for (int l = 0; j < v; ++j, ++l) wz[l] += rp.cw[j] * z[j];
  } else {
    for (; j + kLanes <= v; j += kLanes) {
      for (int l = 0; l < kLanes; ++l) wz[l] += z[j + l];
    }
    for (int l = 0; j < v; ++j, ++l) wz[l] += z[j];
  }
  double s = 0;
  for (int l = 0; l < kLanes; ++l) s += wz[l];
  return s;
}

// Overwrites the row z (the stored logits of a row whose target is t) with G, rounded to the
// input dtype: g_j = A p_j - B cw_j - [j == t] C, p_j = exp(z_j - lse), then times the
// softcap's 1 - tanh^2 = 1 - (z_j / cap)^2. cwt = cw[t] (1 without weights).
LOSSD_ROW_INLINE void WriteGradient(const RowPassParams& rp, float* z, int64_t t, double lse,
                                    double cwt, double sc, double sz) {
  const int64_t v = rp.v;
  int64_t j;
  const float a = static_cast<float>(
      sc * ((1 - rp.eps) * cwt + rp.eps * rp.cw_sum / static_cast<double>(v)) +
      2 * sz * rp.zs * lse);
  const float b = static_cast<float>(sc * rp.eps / static_cast<double>(v));
  const float c = static_cast<float>(sc * (1 - rp.eps) * cwt);
  const float lse_f = static_cast<float>(lse);
  const float zt = z[t];
  if (rp.cap > 0) {
    const float inv = static_cast<float>(1.0 / rp.cap);
    for (j = 0; j < v; ++j) {
      const float th = z[j] * inv;
      const float cwj = rp.cw != nullptr ? rp.cw[j] : 1.0f;
      z[j] = (a * ExpNonPositive(z[j] - lse_f) - b * cwj) * (1.0f - th * th);
    }
    const float th = zt * inv;
    z[t] = (a * ExpNonPositive(zt - lse_f) - b * (rp.cw != nullptr ? rp.cw[t] : 1.0f) - c) *
           (1.0f - th * th);
  } else if (rp.cw != nullptr) {
    for (j = 0; j < v; ++j) z[j] = a * ExpNonPositive(z[j] - lse_f) - b * rp.cw[j];
    z[t] -= c;
  } else {
    for (j = 0; j < v; ++j) z[j] = a * ExpNonPositive(z[j] - lse_f) - b;
    z[t] -= c;
  }
  // G is stored in the input dtype, as the GPU stores it over its logits.
  RoundInPlace(z, v, rp.dtype);
}

#undef LOSSD_ROW_INLINE

}  // namespace

LOSSD_CPU_TARGET_CLONES
RowResult RowPass(const RowPassParams& rp, float* z, int64_t t, double sc, double sz) {
  const int64_t v = rp.v;
  RowResult res;
  if (rp.bias != nullptr) {
    for (int64_t j = 0; j < v; ++j) z[j] += rp.bias[j];
  }
  RoundInPlace(z, v, rp.dtype);
  if (rp.cap > 0) {
    const float cap = static_cast<float>(rp.cap), inv = static_cast<float>(1.0 / rp.cap);
    for (int64_t j = 0; j < v; ++j) z[j] = cap * std::tanh(z[j] * inv);
  }
  const float m = RowMax(z, v, &res.argmax);
  const double sum = SumExpBelowMax(z, v, m);
  const double lse = m + std::log(sum);
  res.lse = static_cast<float>(lse);
  if (t < 0) {
    if (rp.want_grad) std::fill(z, z + v, 0.0f);
    return res;
  }
  double smooth = 0;
  if (rp.eps > 0) {
    // -(1/V) sum_j cw_j (z_j - lse)
    smooth = (rp.cw_sum * lse - WeightedSum(rp, z)) / static_cast<double>(v);
  }
  const double cwt = rp.cw != nullptr ? rp.cw[t] : 1.0;
  res.ce = (1 - rp.eps) * cwt * (lse - z[t]) + rp.eps * smooth;
  res.zl = rp.zs * lse * lse;
  if (rp.token_scaling) {
    // s = p_t from the stored (softcapped) logits, rounded to the input dtype as
    // torch.softmax rounds its output; a constant to the gradient, so it scales G's row.
    float s = static_cast<float>(std::exp(static_cast<double>(z[t]) - lse));
    RoundInPlace(&s, 1, rp.dtype);
    res.ce *= s;
    res.zl *= s;
    sc *= s;
    sz *= s;
  }
  if (!rp.want_grad) return res;
  WriteGradient(rp, z, t, lse, cwt, sc, sz);
  return res;
}

}  // namespace lossd
