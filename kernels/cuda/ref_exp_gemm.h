// SPDX-License-Identifier: Apache-2.0
// The reference-exp logits GEMM: E = exp(X_c W^T - ref[row]) in bf16, straight from the fp32
// accumulator, with each row tile's sum of E and its largest logit (rounded to bf16, as the
// stored logits of the other paths are) and that logit's first column in the epilogue (sm90/row_ref_exp_node.cuh). The backward then needs no pass over the logits
// (fused_loss_ref_exp.cc says how). A CUTLASS sm_90a kernel, compiled in only where the plugin
// is built with --define=lossd_sm90=1 (CUTLASS's headers, tools/setup_cutlass.sh); elsewhere
// MakeRefExpGemm returns null and the engine keeps its other path. Plain C++ here: no CUTLASS
// header reaches the callers.
#ifndef LOSSD_KERNELS_CUDA_REF_EXP_GEMM_H_
#define LOSSD_KERNELS_CUDA_REF_EXP_GEMM_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>

namespace lossd {
namespace cuda {

// The CTA tile of the kernel: the statistics come one entry per (row, tile of kRefExpTileN
// columns), rows padded to a multiple of kRefExpTileM.
inline constexpr int64_t kRefExpTileM = 128;
inline constexpr int64_t kRefExpTileN = 128;

struct RefExpGemmArgs {
  const void* x = nullptr;      // (c, h) bf16 row-major
  const void* w = nullptr;      // (v, h) bf16 row-major
  void* e = nullptr;            // (c, v) bf16 row-major: exp(z - ref[row])
  const float* ref = nullptr;   // (ld)
  float* tile_sum = nullptr;    // (ceil(v / kRefExpTileN), ld) row-major
  float* tile_max = nullptr;    // (ceil(v / kRefExpTileN), ld) row-major: largest bf16 logit
  int32_t* tile_arg = nullptr;  // (ceil(v / kRefExpTileN), ld) row-major: its column
  int64_t ld = 0;               // c rounded up to kRefExpTileM
  int64_t c = 0, h = 0, v = 0;  // h and v multiples of 8, x, w and e 16-byte aligned
};

class RefExpGemm {
 public:
  virtual ~RefExpGemm() = default;
  // Device workspace Run needs for these arguments (the persistent scheduler's).
  virtual size_t WorkspaceBytes(const RefExpGemmArgs& a) = 0;
  // Checks and binds the arguments and enqueues the GEMM on `stream`. "" on success, else what
  // failed. Not thread-safe: one caller at a time.
  virtual std::string Run(const RefExpGemmArgs& a, void* workspace, cudaStream_t stream) = 0;
};

// The kernel where it is compiled in (sm90/ref_exp_gemm.cu), else null (ref_exp_gemm_none.cc).
// Runs on compute capability 9.0 only; the caller checks the device.
std::unique_ptr<RefExpGemm> MakeRefExpGemm();

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_REF_EXP_GEMM_H_
