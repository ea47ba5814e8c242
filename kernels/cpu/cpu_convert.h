// SPDX-License-Identifier: Apache-2.0
// Element conversion for the CPU backend: fp32 from and to the stored dtypes (bf16, fp16,
// fp32), rounding to nearest even, serially or in parallel blocks on a CpuTaskPool. It never
// allocates; block bounds depend on the element count only, never on the thread count.
#ifndef LOSSD_KERNELS_CPU_CPU_CONVERT_H_
#define LOSSD_KERNELS_CPU_CPU_CONVERT_H_

#include <cstdint>

#include "core/dtype.h"
#include "kernels/cpu/cpu_task_pool.h"

// Functions built for several instruction sets, picked at load time. Not under TSan: gcc
// instruments the load-time resolvers, which run before TSan is ready.
#if defined(__SANITIZE_THREAD__)
#define LOSSD_CPU_TARGET_CLONES
#else
#define LOSSD_CPU_TARGET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace lossd {

inline constexpr int64_t kConvertBlock = 1 << 16;  // elements per conversion task

// Rounds n fp32 values in place to dtype t (no-op for fp32). Compiled for AVX-512, AVX2 and
// baseline x86-64, without FMA contraction: every variant rounds alike.
void RoundInPlace(float* v,  // (n) fp32, rewritten
                  int64_t n, DType t);

// Widens n elements of src (dtype t) starting at element `first` into dst.
void WidenRange(const void* src,  // (first + n) dtype t
                DType t, int64_t first, int64_t n,
                float* dst);  // (n) fp32

// Stores n fp32 values as elements [first, first + n) of dst (dtype t), rounding to nearest even.
void NarrowRange(const float* src,  // (n) fp32
                 int64_t n, DType t,
                 void* dst,  // (first + n) dtype t
                 int64_t first);

// WidenRange and NarrowRange of n elements, in blocks of kConvertBlock on the pool.
void ParallelWiden(CpuTaskPool& pool, const void* src, DType t, int64_t n, float* dst);
void ParallelNarrow(CpuTaskPool& pool, const float* src, int64_t n, DType t, void* dst);

// NaN or Inf among `data`'s n elements (false for a null `data`), scanned in parallel blocks.
bool ParallelAnyNonFinite(CpuTaskPool& pool, const void* data, DType t, int64_t n);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CPU_CONVERT_H_
