// SPDX-License-Identifier: Apache-2.0
// The loss kinds' launch (row_loss_kernels.h), which picks a kernel, and the two-pass logprob /
// policy kernel: one block per row, two reads of the row (statistics, then the gradient), as
// the cross-entropy's two-pass kernel. Where the one-read kernels apply (row_loss_launch.h's
// RowLossCluster) they run instead; this one runs the rest, every dtype alike.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/one_read_kernel.h"
#include "kernels/cuda/row_loss_device.cuh"
#include "kernels/cuda/row_loss_kernels.h"
#include "kernels/cuda/row_loss_launch.h"

namespace lossd {
namespace cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) RowLossKernel(RowLossParams p) {
  __shared__ Stats shared[kWarps + 1];
  __shared__ float coef[2];
  const int64_t i = blockIdx.x;
  T* row = static_cast<T*>(p.logits) + i * p.v;
  const int t = p.targets[i];
  const float inv_cap = InverseOf(p.softcap);
  float chain = 0.0f;
  Stats st = Stats::Empty();
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    Add1(st, Logit<T>(p, row, j, inv_cap, &chain), static_cast<int>(j));
  }
  st = BlockReduce(st, shared);
  const float log_s = logf(st.s);
  const float lse = Add(st.m, log_s);
  const float entropy = Sub(log_s, st.q / st.s);
  if (threadIdx.x == 0) {
    float logp = 0.0f, c = 0.0f, e = 0.0f;
    if (t >= 0) {
      logp = Sub(Logit<T>(p, row, t, inv_cap, &chain), lse);
      if (p.kind == kRowLossPolicy) {
        const float w = p.row_weight[i];
        if (w != 0.0f) c = static_cast<float>(w * PolicyCoefficient(p, i, logp));
      } else {
        c = p.coef_logp != nullptr ? p.coef_logp[i] : 0.0f;
      }
      e = p.coef_entropy != nullptr ? p.coef_entropy[i] : 0.0f;
    }
    p.row_lse[i] = lse;
    p.row_logp[i] = logp;
    p.row_entropy[i] = t >= 0 ? entropy : 0.0f;
    if (p.row_pred != nullptr) p.row_pred[i] = st.best_j;
    coef[0] = c;
    coef[1] = e;
  }
  if (!p.write_grad) return;
  __syncthreads();
  const float c = coef[0], e = coef[1];
  if (t < 0 || (c == 0.0f && e == 0.0f)) {
    for (int64_t j = threadIdx.x; j < p.v; j += kThreads) row[j] = FromFloat<T>(0.0f);
    return;
  }
  // Every thread has read its own elements only, so each may overwrite them now.
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    const float z = Logit<T>(p, row, j, inv_cap, &chain);
    const float pj = expf(Sub(z, lse));
    float g = Mul(c, j == t ? Sub(1.0f, pj) : -pj);
    if (e != 0.0f) g = fmaf(-Mul(e, pj), Add(Sub(z, lse), entropy), g);
    row[j] = FromFloat<T>(Mul(g, chain));
  }
}

}  // namespace

int RowLossCluster(const RowLossParams& p) {
  // Contiguous rows and biases 16-byte aligned for every dtype alike (V % 8 == 0), so that the
  // choice, and with it the summation order, depends on V (and the GPU) alone.
  if (p.v % 8 != 0 || p.v <= 0) return 0;
  const bool distill = p.kind == kRowLossDistill;
  if (distill && p.hard_coef != 0.0f) return 0;  // the hard-label term: two-pass kernel only
  for (const void* ptr : {static_cast<const void*>(p.logits), p.bias,
                          distill ? p.teacher_logits : nullptr, distill ? p.teacher_bias : nullptr}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return 0;
  }
  const int64_t cols = distill ? kDistillOneReadSegCols : kRowOneReadSegCols;
  const int64_t cluster = (p.v + cols - 1) / cols;
  if (cluster > 16 || p.rows * cluster > 0x7fffffff) return 0;
  return cluster <= DeviceMaxCluster() ? static_cast<int>(cluster) : 0;
}

cudaError_t LaunchRowLoss(const RowLossParams& p, cudaStream_t stream) {
  if (p.rows <= 0) return cudaSuccess;
  if (p.rows > 0x7fffffff || p.v > 0x7fffffff) return cudaErrorInvalidValue;
  const int cluster = RowLossCluster(p);
  if (cluster > 0) {
    const cudaError_t e = p.kind == kRowLossDistill ? LaunchDistillOneRead(p, cluster, stream)
                                                    : LaunchRowLossOneRead(p, cluster, stream);
    if (e == cudaSuccess) return e;
    // A configuration this GPU refuses at launch (a cluster it cannot place): the launch did
    // not start, so the two-pass kernel computes the rows instead; its own launch reports
    // anything else.
    cudaGetLastError();
  }
  if (p.kind == kRowLossDistill) return LaunchDistillTwoPass(p, stream);
  const dim3 grid(static_cast<unsigned>(p.rows));
  switch (p.elem) {
    case kElemBF16:
      RowLossKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
      break;
    case kElemF16:
      RowLossKernel<__half><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      RowLossKernel<float><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace lossd
