// SPDX-License-Identifier: Apache-2.0
// The 3-GEMM cuBLAS floor the fused op is measured against, and the same three GEMMs over the
// fused op's chunks (no cross-entropy): what the fused op would cost if the GEMMs were all it
// did. Enqueues and times GEMMs; never checks their results.
#ifndef LOSSD_BENCH_KERNEL_FLOOR_H_
#define LOSSD_BENCH_KERNEL_FLOOR_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace bench {

// The fused op's three GEMMs over chunks of `chunk` rows, one after the other on `stream` (the
// timed stream, whichever engine's algorithm cache picks the kernels), no CE: logits
// z = X_c W^T (bf16), dX_c = z W (bf16), dW (+)= z^T X_c into fp32 (beta 1 after the first
// chunk). With chunk = BT these are the 3-GEMM floor. `role` picks one of the three (0 logits,
// 1 dX, 2 dW; -1 all), `rank` cuBLASLt's candidate (0: the engine's choice); `tune` times the
// candidates (FusedLoss::TuneGemm) instead of running the GEMMs.
absl::Status ChunkedGemms(cuda::FusedLoss& engine, cudaStream_t stream, void* ws,
                          uint64_t ws_bytes, int64_t bt, int64_t h, int64_t v, int64_t chunk,
                          const void* x, const void* w, void* z, void* dx, void* dw,
                          int role = -1, int32_t rank = 0, bool tune = false);

// Each GEMM alone at cuBLASLt heuristic ranks 0..N-1 and workspaces of 4 and 32 MiB: the
// floor's three (unchunked) and the chunks' three (all chunks of `chunk` rows, dW with beta 1
// after the first, as the fused op runs them). Prints one line per point; a rank cuBLASLt does
// not offer ends that sweep.
int SweepAlgos(cuda::FusedLoss& engine, int64_t bt, int64_t h, int64_t v, int64_t chunk,
               const void* x, const void* w, void* dx, void* dw);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_FLOOR_H_
