// SPDX-License-Identifier: Apache-2.0
// The two-pass distill kernel (row_loss_kernels.h's distill math) and its launch: one block
// per row, three reads of the student's row (statistics, the divergence and sum d, the
// gradient) and two of the teacher's. LaunchRowLoss runs it where the one-read distill kernel
// (distill_one_read_kernel.cu) does not apply, and for the hard-label term, whose statistics
// at temperature 1 the first read gathers beside the others.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/cuda/ce_device.cuh"
#include "kernels/cuda/ce_kernels.h"
#include "kernels/cuda/row_loss_device.cuh"
#include "kernels/cuda/row_loss_kernels.h"
#include "kernels/cuda/row_loss_launch.h"

namespace lossd {
namespace cuda {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) DistillKernel(RowLossParams p) {
  __shared__ Stats shared[kWarps + 1];
  __shared__ float2 sums[kWarps + 1];
  const int64_t i = blockIdx.x;
  T* row = static_cast<T*>(p.logits) + i * p.v;
  const T* trow = static_cast<const T*>(p.teacher_logits) + i * p.v;
  const int t = p.targets[i];
  const bool counts = t >= 0;
  const bool hard = p.hard_coef != 0.0f;
  const float inv_t = p.inv_temperature;
  Stats st = Stats::Empty(), tt = Stats::Empty(), ht = Stats::Empty();
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    Add1(st, Scaled<T>(row, p.bias, j, inv_t), static_cast<int>(j));
    Add1(tt, Scaled<T>(trow, p.teacher_bias, j, inv_t), static_cast<int>(j));
    if (hard) Add1(ht, Scaled<T>(row, p.bias, j, 1.0f), static_cast<int>(j));
  }
  st = BlockReduce(st, shared);
  tt = BlockReduce(tt, shared);
  if (hard) ht = BlockReduce(ht, shared);
  const float lse = Add(st.m, logf(st.s)), tlse = Add(tt.m, logf(tt.s));
  // The hard term's lse at temperature 1 (the logits before T divides them).
  const float lse1 = hard ? Add(ht.m, logf(ht.s)) : 0.0f;
  float2 acc = make_float2(0.0f, 0.0f);
  if (counts) {
    for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
      const float log_q = Sub(Scaled<T>(row, p.bias, j, inv_t), lse);
      const float log_p = Sub(Scaled<T>(trow, p.teacher_bias, j, inv_t), tlse);
      const float2 t = Divergence(p.jsd_beta, log_q, log_p);
      acc.x = Add(acc.x, t.x);
      acc.y = Add(acc.y, t.y);
    }
  }
  acc = SumReduce(acc, sums);
  if (threadIdx.x == 0) {
    p.row_lse[i] = lse;
    p.row_logp[i] = counts ? acc.x : 0.0f;
    // The row's cross-entropy of its label at temperature 1 (the hard term's), else 0.
    p.row_entropy[i] = counts && hard ? Sub(lse1, Scaled<T>(row, p.bias, t, 1.0f)) : 0.0f;
    if (p.row_pred != nullptr) p.row_pred[i] = st.best_j;
  }
  if (!p.write_grad) return;
  const float c = counts ? p.distill_coef : 0.0f;
  const float h = counts ? p.hard_coef : 0.0f;
  const float d_sum = acc.y;
  const float scale = Mul(c, inv_t);
  // Every thread has read its row's elements (the hard term's label included) before any
  // writes: the ce above and the sums came through the block reduction's barriers.
  __syncthreads();
  // Each thread rewrites only the elements it read itself.
  for (int64_t j = threadIdx.x; j < p.v; j += kThreads) {
    float g = 0.0f;
    if (c != 0.0f) {
      const float log_q = Sub(Scaled<T>(row, p.bias, j, inv_t), lse);
      const float log_p = Sub(Scaled<T>(trow, p.teacher_bias, j, inv_t), tlse);
      const float dj = Divergence(p.jsd_beta, log_q, log_p).y;
      g = Mul(scale, fmaf(-expf(log_q), d_sum, dj));
    }
    if (h != 0.0f) {
      const float soft = expf(Sub(Scaled<T>(row, p.bias, j, 1.0f), lse1));
      g = fmaf(h, j == t ? Sub(soft, 1.0f) : soft, g);
    }
    row[j] = FromFloat<T>(g);
  }
}

}  // namespace

cudaError_t LaunchDistillTwoPass(const RowLossParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.rows));
  switch (p.elem) {
    case kElemBF16:
      DistillKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(p);
      break;
    case kElemF16:
      DistillKernel<__half><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      DistillKernel<float><<<grid, kThreads, 0, stream>>>(p);
      break;
  }
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace lossd
