// SPDX-License-Identifier: Apache-2.0
// What the one-read kernels share (the cross-entropy's, one_read_kernel.cu; the loss kinds',
// row_one_read_kernel.cu and distill_one_read_kernel.cu): the block size, the halves of a
// cluster barrier, the 2^x of one instruction, the wait for a thread's asynchronous copies, and
// the launch configuration of a row split over a cluster of blocks.
// nvcc only; one copy per .cu in an anonymous namespace, as ce_device.cuh.
#ifndef LOSSD_KERNELS_CUDA_ONE_READ_DEVICE_CUH_
#define LOSSD_KERNELS_CUDA_ONE_READ_DEVICE_CUH_

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace lossd {
namespace cuda {
namespace {

// One cluster per row, each block 512 threads holding its segment of the row in shared memory.
constexpr int kOneReadThreads = 512;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int kOneReadWarps = kOneReadThreads / 32;

// The two halves of a cluster barrier, so that a block can do its own work in between.
__device__ __forceinline__ void ClusterArriveRelease() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterArriveRelaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ClusterWait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// 2^x in one multi-function-unit instruction; results below 2^-126 flush to zero (they are
// below what the gradient's bf16/fp16/fp32 values are compared at).
__device__ __forceinline__ float Exp2Ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Waits until at most n of this thread's cp.async groups are pending; n is a constant once the
// caller's loop is unrolled, so the switch folds to one instruction.
__device__ __forceinline__ void WaitAsyncGroupsAtMost(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;\n" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;\n" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;\n" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;\n" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;\n" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;\n" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;\n" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;\n" ::: "memory"); break;
  }
}

// Starts the asynchronous copy of `bytes` (a multiple of 16) from global `src` to shared
// `dst`, 16 bytes at a time, in the thread's current group.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, int bytes) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  for (int q = 0; q < bytes; q += 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d + q),
                 "l"(static_cast<const char*>(src) + q)
                 : "memory");
  }
}
__device__ __forceinline__ void CommitAsyncGroup() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
#endif

// The launch configuration of `blocks` one-read blocks in clusters of `cluster`, each with
// `smem` bytes of segment. Holds the attribute the configuration points at, so it is not copied.
struct OneReadLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  OneReadLaunch(unsigned blocks, int cluster, size_t smem, cudaStream_t stream) {
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(kOneReadThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  OneReadLaunch(const OneReadLaunch&) = delete;
  OneReadLaunch& operator=(const OneReadLaunch&) = delete;
};

// Columns per block of a row of v split over `cluster` blocks: whole 16-byte vectors.
inline int64_t OneReadSegmentCols(int64_t v, int cluster) {
  return ((v + cluster - 1) / cluster + 7) / 8 * 8;
}

// Sets a one-read kernel's function attributes on the current device once (bit d of `ready`),
// not on every launch; two threads may both set them the first time, harmlessly: clusters of
// 16 allowed (Hopper places them), `smem` bytes of dynamic shared memory, and as much of the
// unified L1 as shared memory as can be.
template <typename Kernel>
cudaError_t PrepareClusterKernel(Kernel* kernel, size_t smem, std::atomic<uint64_t>* ready) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (ready->load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return e;
  ready->fetch_or(bit, std::memory_order_release);
  return cudaSuccess;
}

}  // namespace
}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ONE_READ_DEVICE_CUH_
