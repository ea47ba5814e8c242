// SPDX-License-Identifier: Apache-2.0
// What kinds_bench.cc and kinds_bench_policy.cc share: one shape's device buffers, the fused
// op's arguments and plan shape for a kind on them, the GEMM floor, one kind's timed row, and
// the policy rows kinds_bench_policy.cc times (policy_verl; policy_seq and the loss types run
// by group). kinds_bench.cc's top comment says what the bench prints.
#ifndef LOSSD_BENCH_KERNEL_KINDS_BENCH_SHAPE_H_
#define LOSSD_BENCH_KERNEL_KINDS_BENCH_SHAPE_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "bench/kernel/kinds_table.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/fused_loss.h"

ABSL_DECLARE_FLAG(double, temperature);

namespace lossd {
namespace bench {

inline constexpr uint64_t kFloorWsBytes = 32ull << 20;

// One shape's device buffers, shared by every kind.
struct ShapeBuffers {
  int64_t bt = 0, h = 0, v = 0, th = 0;
  void *x = nullptr, *w = nullptr, *dx = nullptr, *dw = nullptr, *rows = nullptr,
       *tg = nullptr;
  void *fz = nullptr, *fws = nullptr;           // the floor's logits and workspace
  void *tx = nullptr, *tw = nullptr, *ftz = nullptr;  // distill: teacher X, W, floor logits
  int32_t* counted = nullptr;                    // distill: every row counts (0)
  // Per-row inputs: logprob's coefficients, policy's weights, advantages, old and ref logp.
  float *coef_logp = nullptr, *coef_entropy = nullptr, *row_weight = nullptr,
        *advantages = nullptr, *old_logp = nullptr, *ref_logp = nullptr,
        *policy_entropy = nullptr;
  float logprob_alpha = 1, policy_alpha = 1;
};

// The fused op's arguments for `kind` on the shape's buffers (dX bf16, a fresh fp32 dW).
cuda::DeviceLossArgs ArgsOf(LossKind kind, const ShapeBuffers& b, float temperature);

// The shape a trainer with weight handles sends: W (and the teacher's) resident, dX and dW
// wanted; what CudaBackend::Plan takes.
WorkspaceShape ShapeFor(LossKind kind, const ShapeBuffers& b);

// The floor: the GEMMs of the kind's work, unchunked, on `e`'s algorithm cache.
absl::Status Floor(cuda::FusedLoss& e, cudaStream_t stream, const ShapeBuffers& b, bool teacher,
                   bool tune);

// One kind at one shape: plan, workspace, the floor, tuned floor and fused op in the same
// rounds, the memory measured across them and the sanity statistic. With `args`, those
// arguments instead of the kind's own (ArgsOf). 0, or 1 on a failed call.
int RunKind(cuda::CudaBackend& backend, cuda::FusedLoss& engine, cuda::FusedLoss& floor_engine,
            LossKind kind, const ShapeBuffers& b, KindRow* row, bool* finite,
            const cuda::DeviceLossArgs* args = nullptr);

// The row policy_verl: the policy kind with verl's k2 estimator and an entropy bonus of 0.01
// (its e_i per row), on the policy row's inputs.
int RunPolicyVerl(cuda::CudaBackend& backend, cuda::FusedLoss& engine,
                  cuda::FusedLoss& floor_engine, const ShapeBuffers& b, KindRow* row,
                  bool* finite);

// The policy kind by group over sequences of `seq` rows, as CudaBackend::Compute runs it:
// dapo at sequence level (the row policy_seq), or a loss type that is by group at token level
// (geo_mean, kl_cov, vespo: the row policy_<type>); in the same rounds as the floor and the
// tuned floor.
int RunPolicySequence(cuda::CudaBackend& backend, cuda::FusedLoss& engine,
                      cuda::FusedLoss& floor_engine, const ShapeBuffers& b, int64_t seq,
                      PolicyLossType type, KindRow* row);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_KERNEL_KINDS_BENCH_SHAPE_H_
