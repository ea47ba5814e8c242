// SPDX-License-Identifier: Apache-2.0
#include "kernels/cpu/cpu_convert.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "kernels/cpu/cpu_task_pool.h"
#include "kernels/cpu/nonfinite_scan.h"

namespace lossd {
namespace {

// x rounded to bf16 and widened back (round to nearest even; NaN stays NaN).
inline float RoundBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  uint32_t r = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  r = nan ? (bits | 0x00400000u) & 0xffff0000u : r;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

inline float RoundF16(float x) { return F16ToFloat(FloatToF16(x)); }

}  // namespace

LOSSD_CPU_TARGET_CLONES
void RoundInPlace(float* v, int64_t n, DType t) {
  if (t == DType::kBF16) {
    for (int64_t k = 0; k < n; ++k) v[k] = RoundBf16(v[k]);
  } else if (t == DType::kF16) {
    for (int64_t k = 0; k < n; ++k) v[k] = RoundF16(v[k]);
  }
}

void WidenRange(const void* src, DType t, int64_t first, int64_t n, float* dst) {
  if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + first;
    for (int64_t k = 0; k < n; ++k) dst[k] = Bf16ToFloat(s[k]);
  } else if (t == DType::kF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + first;
    for (int64_t k = 0; k < n; ++k) dst[k] = F16ToFloat(s[k]);
  } else {
    std::memcpy(dst, static_cast<const float*>(src) + first, n * sizeof(float));
  }
}

void NarrowRange(const float* src, int64_t n, DType t, void* dst, int64_t first) {
  if (t == DType::kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + first;
    for (int64_t k = 0; k < n; ++k) d[k] = FloatToBf16(src[k]);
  } else if (t == DType::kF16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + first;
    for (int64_t k = 0; k < n; ++k) d[k] = FloatToF16(src[k]);
  } else {
    std::memcpy(static_cast<float*>(dst) + first, src, n * sizeof(float));
  }
}

void ParallelWiden(CpuTaskPool& pool, const void* src, DType t, int64_t n, float* dst) {
  pool.Run(CeilDiv(n, kConvertBlock), [&](int64_t task) {
    const int64_t first = task * kConvertBlock;
    WidenRange(src, t, first, std::min(kConvertBlock, n - first), dst + first);
  });
}

bool ParallelAnyNonFinite(CpuTaskPool& pool, const void* data, DType t, int64_t n) {
  if (data == nullptr) return false;
  std::atomic<bool> any{false};
  pool.Run(CeilDiv(n, kConvertBlock), [&](int64_t task) {
    const int64_t first = task * kConvertBlock;
    if (AnyNonFinite(data, t, first, std::min(kConvertBlock, n - first))) any.store(true);
  });
  return any.load();
}

void ParallelNarrow(CpuTaskPool& pool, const float* src, int64_t n, DType t, void* dst) {
  pool.Run(CeilDiv(n, kConvertBlock), [&](int64_t task) {
    const int64_t first = task * kConvertBlock;
    NarrowRange(src + first, std::min(kConvertBlock, n - first), t, dst, first);
  });
}

}  // namespace lossd
