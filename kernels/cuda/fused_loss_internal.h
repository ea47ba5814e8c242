// SPDX-License-Identifier: Apache-2.0
// Helpers the parts of FusedLoss share (fused_loss*.cc): alignment, pointer arithmetic on
// device addresses, the cuBLASLt type of a dtype, a chunk's cross-entropy parameters, and the
// row-chunk pass (which the reference-exp path falls back to).
// Private to the fused_loss library; never dereferences a device pointer.
#ifndef LOSSD_KERNELS_CUDA_FUSED_LOSS_INTERNAL_H_
#define LOSSD_KERNELS_CUDA_FUSED_LOSS_INTERNAL_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/fused_loss.h"
#include "kernels/cuda/row_loss_kernels.h"

namespace lossd {
namespace cuda {

inline constexpr uint64_t kAlign = 256;

inline uint64_t RoundUp(uint64_t x, uint64_t m) { return (x + m - 1) / m * m; }

// The cuBLASLt element type of a float dtype.
inline cudaDataType CudaType(DType t) {
  switch (t) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// Largest power of two (up to 256) dividing the address: what cuBLASLt may assume of it.
inline uint32_t PointerAlignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align >>= 1;
  return align;
}

// The address `elements` elements of `elem_size` bytes past `base`.
inline const char* Offset(const void* base, int64_t elements, size_t elem_size) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(elem_size);
}

// Whether the logits GEMMs add the bias (cuBLASLt's bias epilogue): there is one, and its slice
// at each of the `n` first columns is 16-byte aligned.
inline bool BiasInGemm(const void* bias, size_t elem, const int64_t* first_cols, int n) {
  if (bias == nullptr) return false;
  for (int i = 0; i < n; ++i) {
    if (PointerAlignment(Offset(bias, first_cols[i], elem)) < 16) return false;
  }
  return true;
}

// The cross-entropy parameters of rows [r0, r0 + n) of a problem; the caller says where the
// logits are (logits, or the blocked layout's segments).
CrossEntropyParams RowParams(const DeviceLossArgs& a, const GradScales& scales, bool write_grad,
                             int64_t r0, int64_t n);

// The logprob / policy row kernel's parameters for rows [r0, r0 + n); the caller sets logits.
RowLossParams RowLossParamsOf(const DeviceLossArgs& a, bool write_grad, int64_t r0, int64_t n);

// What the steps of one row-chunk Enqueue share: the problem, the plan, the chunk buffer and
// the two GEMM workspaces, how the vocabulary splits into column halves, and the chunk's GEMMs
// and kernels. FusedLoss's own steps (fused_loss.h) order them on the streams.
class FusedLoss::ChunkPass {
 public:
  ChunkPass(FusedLoss& f, const DeviceLossArgs& a, const ChunkPlan& plan, void* workspace);

  absl::Status CrossEntropy(int64_t c0, int64_t r0, int64_t n);
  absl::Status LogitsGemm(int64_t c0, int64_t r0, int64_t n, int64_t v0, int64_t nv,
                          int32_t sms);
  absl::Status DxGemm(int64_t c0, int64_t rows, int32_t sms);
  absl::Status DwGemm(int64_t c0, int64_t rows, int64_t v0, int64_t nv, int32_t sms);
  // Rows already waited for are not asked again (a chunk the reference-exp path redoes).
  absl::Status XReady(int64_t c0, int64_t rows);
  absl::Status DxEnqueued(int64_t c0, int64_t rows);
  absl::Status DbSum(int64_t rows);

  FusedLoss& f;
  const DeviceLossArgs& a;
  const ChunkPlan& plan;
  size_t elem;
  cudaDataType ab;
  GradScales scales;
  bool want_dw, want_db, write_grad;
  uint64_t gws;
  char* logits;  // (C, V) row-major, input dtype: the logits, then G over them
  char* teacher_logits;  // (C, V) row-major, input dtype: distill's teacher logits, or null
  void* ws_main;
  void* ws_side;
  int32_t rank_logits, rank_dx, rank_dw;
  bool columns;
  int64_t vbegin[2], vcount[2];
  bool gemm_bias, teacher_gemm_bias;
  int32_t side_sms, main_sms;
  // In the tuning pass (before any real work) a GEMM whose key is new is timed instead, on
  // main_ alone; a GEMM with a pinned rank is left as it is.
  bool tuning = false;
  int64_t x_ready_rows = 0;  // rows [0, x_ready_rows) of X are known to be on the device

 private:
  // Every chunk GEMM goes through here.
  absl::Status Gemm(cudaStream_t stream, void* ws, float alpha, const Spec& g, int32_t rank) {
    return f.RunOrTune(tuning, stream, ws, alpha, g, rank);
  }
};

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_FUSED_LOSS_INTERNAL_H_
