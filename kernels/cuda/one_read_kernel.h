// SPDX-License-Identifier: Apache-2.0
// The one-read cross-entropy kernel's launch, for ce_kernels.cu's LaunchCrossEntropy (not part
// of ce_kernels.h's public contract): the same CrossEntropyParams, a row split over a cluster
// of `cluster` blocks (CrossEntropyCluster chose it). Never checks the problem itself.
#ifndef LOSSD_KERNELS_CUDA_ONE_READ_KERNEL_H_
#define LOSSD_KERNELS_CUDA_ONE_READ_KERNEL_H_

#include <cuda_runtime.h>

#include "kernels/cuda/ce_kernels.h"

namespace lossd {
namespace cuda {

// Launches the one-read kernel for p's element type on `stream`; cudaErrorInvalidValue for
// an element type it does not know.
cudaError_t LaunchOneRead(const CrossEntropyParams& p, int cluster, cudaStream_t stream);

// The largest cluster of one-read blocks the current device runs (0, 8 or 16); asked once per
// device.
int DeviceMaxCluster();

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ONE_READ_KERNEL_H_
