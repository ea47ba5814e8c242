// SPDX-License-Identifier: Apache-2.0
// The CPU backend's loss kinds beyond cross-entropy (logprob, policy, distill;
// core/loss_problem.h, whose float64 references are the oracle): the same chunked head as
// cross-entropy (cpu_chunk: the logits GEMM, a row function, the gradient GEMMs) with the
// kinds' row functions (kind_rows) and their per-row coefficients, outputs and reductions.
#ifndef LOSSD_KERNELS_CPU_CPU_KINDS_H_
#define LOSSD_KERNELS_CPU_CPU_KINDS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_chunk.h"
#include "kernels/cpu/cpu_task_pool.h"

namespace lossd {

// The kinds this backend computes (BackendInfo::loss_kinds).
inline constexpr uint32_t kCpuLossKinds =
    LossKindBit(LossKind::kCrossEntropy) | LossKindBit(LossKind::kLogprob) |
    LossKindBit(LossKind::kPolicy) | LossKindBit(LossKind::kDistill) | kPolicySequenceBit |
    kPolicyIsRatioBit | kDistillWeightsBit | kPolicyKlEstimatorBit | kPolicyEntropyBit |
    kPolicyAggregationBit | kPolicyGpgBit | kPolicyGeoMeanBit | kPolicyKlCovBit |
    kPolicyVespoBit | kPolicyCispoClampBit | kDistillTopkBit;

// INVALID_ARGUMENT for what this backend does not compute: an unknown kind, one outside
// kCpuLossKinds, and outputs it does not write for a kind (entropy for policy; logp and entropy
// for distill). Every other rule is core/loss_problem_check.h's, checked once by the engine.
absl::Status CheckKindProblem(const LossProblem& p, const LossOutputs& out);

// What a kind needs beyond the cross-entropy plan's workspace at `chunk` rows: per-row
// results, and for distill the teacher's logits chunk, X chunk and W in fp32.
uint64_t KindExtraBytes(const WorkspaceShape& s, int64_t chunk);

// What the backend's Compute hands the kinds' pass: its pool, the workspace it allocated
// (W, X chunk, logits chunk, gradients: as for cross-entropy) and its plan.
struct KindPassSetup {
  CpuTaskPool& pool;
  CpuWorkspace& ws;
  int64_t chunk;
  bool x_copy, want_dx, dx_scratch, want_grad;
};

// Runs every chunk of p (kind != kCrossEntropy, CheckKindProblem passed) and writes the
// outputs other than the gradients' narrowing to the gradient dtype (the caller's, as for
// cross-entropy). RESOURCE_EXHAUSTED for the teacher's buffers; a row stream's error.
absl::Status ComputeKind(const LossProblem& p, const LossOutputs& out, const KindPassSetup& k);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_CPU_KINDS_H_
