// SPDX-License-Identifier: Apache-2.0
// A device check for NaN and Inf in a float tensor (bf16, fp16, fp32), run after a Compute on
// its outputs: it reads each element once, by its exponent bits, and ORs a bit into a flag
// word. Never allocates memory and never synchronises.
#ifndef LOSSD_KERNELS_CUDA_NONFINITE_H_
#define LOSSD_KERNELS_CUDA_NONFINITE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace lossd {
namespace cuda {

// *flags |= bit when any of data's n elements is NaN or Inf; flags untouched otherwise.
// elem: ElemType (0 bf16, 1 fp16, 2 fp32). data must be 4-byte aligned (every device
// allocation is); 16-byte aligned data is read 16 bytes at a time.
cudaError_t LaunchNonFiniteCheck(const void* data,  // (n) elem, device
                                 int32_t elem, int64_t n, uint32_t bit,
                                 uint32_t* flags,  // (1) device
                                 cudaStream_t stream);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_NONFINITE_H_
