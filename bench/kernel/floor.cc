// SPDX-License-Identifier: Apache-2.0
#include "bench/kernel/floor.h"

#include <algorithm>
#include <cstdio>

#include "absl/flags/flag.h"
#include "bench/kernel/bench_util.h"
#include "bench/kernel/kernel_flags.h"
#include "bench/kernel/timing.h"

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
                          int role, int32_t rank, bool tune) {
  auto gemm = [&](bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                  const void* b, int64_t ldb, float beta, void* d, int64_t ldd,
                  cudaDataType dt) {
    return tune ? engine.TuneGemm(stream, ws, ws_bytes, ta, tb, m, n, k, 1.0f, a, lda, b, ldb,
                                  CUDA_R_16BF, beta, d, ldd, dt)
                : engine.Gemm(stream, ws, ws_bytes, ta, tb, m, n, k, 1.0f, a, lda, b, ldb,
                              CUDA_R_16BF, beta, d, ldd, dt, 0, rank);
  };
  for (int64_t c0 = 0; c0 < bt; c0 += chunk) {
    const int64_t r = std::min(chunk, bt - c0);
    const char* xc = static_cast<const char*>(x) + c0 * h * 2;
    absl::Status s;
    if (role < 0 || role == 0) s = gemm(true, false, v, r, h, w, h, xc, h, 0.0f, z, v, CUDA_R_16BF);
    if (s.ok() && (role < 0 || role == 1)) {
      s = gemm(false, false, h, r, v, w, h, z, v, 0.0f, static_cast<char*>(dx) + c0 * h * 2, h,
               CUDA_R_16BF);
    }
    if (s.ok() && (role < 0 || role == 2)) {
      s = gemm(false, true, h, v, r, xc, h, z, v, c0 > 0 ? 1.0f : 0.0f, dw, h, CUDA_R_32F);
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Each GEMM alone at cuBLASLt heuristic ranks 0..N-1 and workspaces of 4 and 32 MiB: the
// floor's three (unchunked) and the chunks' three (all chunks of `chunk` rows, dW with beta 1
// after the first, as the fused op runs them). Prints one line per point; a rank cuBLASLt does
// not offer ends that sweep.
int SweepAlgos(cuda::FusedLoss& engine, int64_t bt, int64_t h, int64_t v, int64_t chunk,
               const void* x, const void* w, void* dx, void* dw) {
  cudaStream_t stream = engine.stream();
  const int runs = std::max(5, absl::GetFlag(FLAGS_runs) / 2);
  void *z, *ws;
  BENCH_CHECK_CUDA(cudaMalloc(&z, bt * v * 2));
  BENCH_CHECK_CUDA(cudaMalloc(&ws, 32ull << 20));
  BENCH_CHECK_CUDA(FillUniformBf16(z, bt * v, 4, 0.01f, stream));
  const char* names[3] = {"logits", "dX", "dW"};
  for (int chunked = 0; chunked < 2; ++chunked) {
    const int64_t c = chunked ? chunk : bt;
    for (int role = 0; role < 3; ++role) {
      for (unsigned long long ws_mib : {4ull, 32ull}) {
        for (int rank = 0; rank < absl::GetFlag(FLAGS_algo_sweep); ++rank) {
          auto body = [&]() {
            return ChunkedGemms(engine, stream, ws, ws_mib << 20, bt, h, v, c, x, w, z, dx, dw,
                                role, rank);
          };
          // A rank that is not offered fails on the first call; probe before timing.
          const absl::Status probe = body();
          if (!probe.ok()) {
            std::fprintf(stderr, "  sweep %s %s ws %llu MiB rank %d: %s\n",
                         chunked ? "chunks" : "floor", names[role], ws_mib, rank,
                         probe.ToString().c_str());
            break;
          }
          double ms = 0;
          if (TimeMs(stream, 1, runs, body, &ms)) return 1;
          std::printf("sweep %lldx%lldx%lld %s C=%lld %s ws=%llu MiB rank=%d: %.3f ms\n",
                      static_cast<long long>(bt), static_cast<long long>(h),
                      static_cast<long long>(v), chunked ? "chunks" : "floor",
                      static_cast<long long>(c), names[role], ws_mib, rank, ms);
          std::fflush(stdout);
        }
      }
    }
  }
  BENCH_CHECK_CUDA(cudaFree(z));
  BENCH_CHECK_CUDA(cudaFree(ws));
  return 0;
}

}  // namespace bench
}  // namespace lossd
