// SPDX-License-Identifier: Apache-2.0
// The logits GEMM z = X W^T (bf16 in, fp32 accumulate, bf16 out) as CUTLASS 3.x sm_90a
// kernels, with or without the per-(row, column tile) max and sum of exp in their epilogue
// (row_stats_node.cuh): the spike of issue 26 that bench/kernel/cutlass_logits_bench times
// beside lossd's cuBLASLt GEMM. Plain C++ here: no CUTLASS header reaches the callers.
// Never linked into the server.
#ifndef LOSSD_BENCH_KERNEL_CUTLASS_LOGITS_H_
#define LOSSD_BENCH_KERNEL_CUTLASS_LOGITS_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lossd {
namespace bench {

struct CutlassLogitsArgs {
  const void* x = nullptr;     // (C, H) bf16 row-major
  const void* w = nullptr;     // (V, H) bf16 row-major
  void* z = nullptr;           // (C, V) bf16 row-major
  float* tile_max = nullptr;   // (ceil(V / tile_n), ld) row-major; used by stats kernels only
  float* tile_sum = nullptr;   // (ceil(V / tile_n), ld) row-major: sum of exp(z - tile_max)
  int64_t ld = 0;              // C rounded up to tile_m
  int64_t c = 0, h = 0, v = 0;
  int raster = 0;              // the persistent scheduler's order: 0 heuristic, 1 along M, 2 along N
  int swizzle = 1;             // its max swizzle: 1, 2, 4 or 8
  int sms = 0;                 // SMs the persistent grid covers (0: all), the rest left to a
                               // kernel on another stream
};

// One compiled kernel. Init checks and binds the arguments (the workspace must outlive every
// Run); Run enqueues the GEMM. Both return "" on success, else what failed.
class CutlassLogits {
 public:
  virtual ~CutlassLogits() = default;
  virtual std::string Name() const = 0;
  virtual int TileM() const = 0;
  virtual int TileN() const = 0;
  virtual bool Stats() const = 0;  // writes z and per-tile max and sum of exp
  virtual size_t WorkspaceBytes(const CutlassLogitsArgs& a) const = 0;
  virtual std::string Init(const CutlassLogitsArgs& a, void* workspace) = 0;
  virtual std::string Run(cudaStream_t stream) = 0;
};

// Every configuration compiled in (cutlass_logits_*.cu), plain and with statistics.
std::vector<std::unique_ptr<CutlassLogits>> MakeCooperativeKernels();
std::vector<std::unique_ptr<CutlassLogits>> MakeCooperative256Kernels();
std::vector<std::unique_ptr<CutlassLogits>> MakePingpongKernels();

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_CUTLASS_LOGITS_H_
