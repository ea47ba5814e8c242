// SPDX-License-Identifier: Apache-2.0
// Turns CUDA runtime and cuBLASLt return codes into absl::Status values that name the failed
// call. Out-of-memory becomes RESOURCE_EXHAUSTED, no usable GPU UNAVAILABLE, anything else
// INTERNAL; nothing here aborts or throws. Its two macros are for CUDA and cuBLAS return codes
// only, and stay inside kernels/cuda; code that returns absl::Status uses core/status_macros.h.
#ifndef LOSSD_KERNELS_CUDA_CUDA_STATUS_H_
#define LOSSD_KERNELS_CUDA_CUDA_STATUS_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace lossd {
namespace cuda {

// True for errors that leave the CUDA context unusable (every later call fails too).
inline bool IsStickyCudaError(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
    case cudaErrorContextIsDestroyed:
    case cudaErrorUnknown:
      return true;
    default:
      return false;
  }
}

// True for the errors a process without a usable GPU gets from its first runtime call.
inline bool IsNoGpuError(cudaError_t e) {
  return e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver ||
         e == cudaErrorInitializationError;
}

inline absl::Status CudaStatus(cudaError_t e, absl::string_view call) {
  if (e == cudaSuccess) return absl::OkStatus();
  std::string msg = absl::StrCat(call, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
  if (e == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  if (IsNoGpuError(e)) return absl::UnavailableError(msg);
  // An invalid value or launch configuration is not the client's: every request is validated
  // before it reaches the device, so a CUDA call that refuses its arguments is lossd's fault,
  // and INVALID_ARGUMENT would tell the client to change a request that is fine.
  return absl::InternalError(msg);
}

inline absl::Status CublasStatus(cublasStatus_t s, absl::string_view call) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  std::string msg = absl::StrCat(call, ": cuBLAS status ", static_cast<int>(s), " (",
                                 cublasLtGetStatusName(s), ": ", cublasLtGetStatusString(s), ")");
  if (s == CUBLAS_STATUS_ALLOC_FAILED) return absl::ResourceExhaustedError(msg);
  // As for CUDA: an unsupported or invalid GEMM description comes from lossd's own code.
  return absl::InternalError(msg);
}

}  // namespace cuda
}  // namespace lossd

// Evaluates `expr` (a cudaError_t) once and returns a Status naming it on failure.
#define LOSSD_CUDA_RETURN_IF_ERROR(expr)                                   \
  do {                                                                     \
    const cudaError_t lossd_cuda_err_ = (expr);                            \
    if (lossd_cuda_err_ != cudaSuccess) {                                  \
      return ::lossd::cuda::CudaStatus(lossd_cuda_err_, #expr);            \
    }                                                                      \
  } while (0)

// Same for a cublasStatus_t.
#define LOSSD_CUBLAS_RETURN_IF_ERROR(expr)                                 \
  do {                                                                     \
    const cublasStatus_t lossd_cublas_st_ = (expr);                        \
    if (lossd_cublas_st_ != CUBLAS_STATUS_SUCCESS) {                       \
      return ::lossd::cuda::CublasStatus(lossd_cublas_st_, #expr);         \
    }                                                                      \
  } while (0)

#endif  // LOSSD_KERNELS_CUDA_CUDA_STATUS_H_
