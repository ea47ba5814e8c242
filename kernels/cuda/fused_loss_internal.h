// Helpers the parts of FusedLoss share (fused_loss*.cc): alignment, pointer arithmetic on
// device addresses, the cuBLASLt type of a dtype, and a chunk's cross-entropy parameters.
// Private to the fused_loss library; never dereferences a device pointer.
#ifndef LOSSD_KERNELS_CUDA_FUSED_LOSS_INTERNAL_H_
#define LOSSD_KERNELS_CUDA_FUSED_LOSS_INTERNAL_H_

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

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

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_FUSED_LOSS_INTERNAL_H_
