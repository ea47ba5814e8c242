// SPDX-License-Identifier: Apache-2.0
// The status codes CUDA and cuBLASLt failures turn into (host code only: runs wherever the
// toolkit is, GPU or not). Requests are validated before any device call, so only memory and
// a missing GPU are the caller's business; everything else is lossd's and INTERNAL.
#include "kernels/cuda/cuda_status.h"

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace lossd {
namespace cuda {
namespace {

TEST(CudaStatusTest, CudaCodes) {
  EXPECT_TRUE(CudaStatus(cudaSuccess, "cudaMemcpyAsync").ok());
  const absl::Status oom = CudaStatus(cudaErrorMemoryAllocation, "cudaMallocAsync(workspace)");
  EXPECT_TRUE(absl::IsResourceExhausted(oom)) << oom;
  EXPECT_NE(oom.message().find("cudaMallocAsync(workspace)"), std::string::npos) << oom;
  EXPECT_NE(oom.message().find("cudaErrorMemoryAllocation"), std::string::npos) << oom;
  EXPECT_TRUE(absl::IsUnavailable(CudaStatus(cudaErrorNoDevice, "cudaSetDevice")));
  EXPECT_TRUE(absl::IsUnavailable(CudaStatus(cudaErrorInsufficientDriver, "cudaSetDevice")));
  for (cudaError_t e : {cudaErrorInvalidValue, cudaErrorInvalidConfiguration,
                        cudaErrorIllegalAddress, cudaErrorLaunchFailure}) {
    const absl::Status s = CudaStatus(e, "LaunchCrossEntropy");
    EXPECT_TRUE(absl::IsInternal(s)) << s;
    EXPECT_NE(s.message().find("LaunchCrossEntropy: "), std::string::npos) << s;
  }
}

TEST(CudaStatusTest, CublasCodes) {
  EXPECT_TRUE(CublasStatus(CUBLAS_STATUS_SUCCESS, "cublasLtMatmul").ok());
  const absl::Status oom = CublasStatus(CUBLAS_STATUS_ALLOC_FAILED, "cublasLtCreate");
  EXPECT_TRUE(absl::IsResourceExhausted(oom)) << oom;
  EXPECT_NE(oom.message().find("cublasLtCreate"), std::string::npos) << oom;
  for (cublasStatus_t c : {CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_NOT_SUPPORTED,
                           CUBLAS_STATUS_EXECUTION_FAILED, CUBLAS_STATUS_INTERNAL_ERROR}) {
    const absl::Status s = CublasStatus(c, "cublasLtMatmul");
    EXPECT_TRUE(absl::IsInternal(s)) << s;
    EXPECT_NE(s.message().find("cublasLtMatmul: cuBLAS status"), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
