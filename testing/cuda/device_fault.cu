// SPDX-License-Identifier: Apache-2.0
#include "testing/cuda/device_fault.h"

namespace lossd {
namespace cuda {
namespace {

__global__ void TrapKernel() { __trap(); }

}  // namespace

cudaError_t TrapOnDevice(cudaStream_t stream) {
  TrapKernel<<<1, 1, 0, stream>>>();
  const cudaError_t launch = cudaGetLastError();
  if (launch != cudaSuccess) return launch;
  return cudaStreamSynchronize(stream);
}

}  // namespace cuda
}  // namespace lossd
