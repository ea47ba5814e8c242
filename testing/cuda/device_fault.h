// SPDX-License-Identifier: Apache-2.0
// Test-only: puts the current CUDA context into a sticky error on purpose, so that tests can
// check what the backend does after a device fault. Never linked into the server or plugin.
#ifndef LOSSD_TESTING_CUDA_DEVICE_FAULT_H_
#define LOSSD_TESTING_CUDA_DEVICE_FAULT_H_

#include <cuda_runtime_api.h>

namespace lossd {
namespace cuda {

// Launches one thread that executes a trap instruction on `stream` and waits for it. Returns
// the error the wait reported (cudaErrorLaunchFailure on the GPUs we know); from then on every
// call in this process's context fails, so a test that calls it must run in its own process.
cudaError_t TrapOnDevice(cudaStream_t stream);

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_TESTING_CUDA_DEVICE_FAULT_H_
