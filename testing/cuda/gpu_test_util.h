// SPDX-License-Identifier: Apache-2.0
// What the GPU tests share: whether this machine has a usable GPU, so that a test skips
// (GTEST_SKIP) rather than fails without one. Asks the CUDA runtime for the device count only;
// never creates a context on purpose or touches device memory.
#ifndef LOSSD_TESTING_CUDA_GPU_TEST_UTIL_H_
#define LOSSD_TESTING_CUDA_GPU_TEST_UTIL_H_

#include <cuda_runtime_api.h>

namespace lossd {
namespace cuda {

// True when the CUDA runtime reports at least one device. Without a GPU the runtime answers
// with an error (no device, or no driver), which counts as none.
inline bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_TESTING_CUDA_GPU_TEST_UTIL_H_
