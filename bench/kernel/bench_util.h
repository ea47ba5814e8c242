// SPDX-License-Identifier: Apache-2.0
// Device helpers for the kernel benchmark only: random fills and a byte-exact comparison.
// Never linked into the server.
#ifndef LOSSD_BENCH_KERNEL_BENCH_UTIL_H_
#define LOSSD_BENCH_KERNEL_BENCH_UTIL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lossd {
namespace bench {

// dst[i] = uniform(-scale, scale) from a counter-based hash of (seed, i), as bf16.
cudaError_t FillUniformBf16(void* dst,  // (n) bf16
                            int64_t n, uint64_t seed, float scale, cudaStream_t stream);

// dst[i] = uniform integer in [0, range).
cudaError_t FillTargets(int32_t* dst,  // (n)
                        int64_t n, uint64_t seed, int32_t range, cudaStream_t stream);

// *mismatches = number of 32-bit words that differ between a and b (n_words each).
cudaError_t CountMismatches(const void* a, const void* b, int64_t n_words,
                            unsigned long long* mismatches,  // device counter, zeroed here
                            cudaStream_t stream);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_BENCH_UTIL_H_
