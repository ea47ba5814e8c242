// SPDX-License-Identifier: Apache-2.0
// The loss kind's part of Engine::Plan (plan.cc): whether the backend computes the kind, the
// kind's options and its own tensors (the per-row fp32 inputs, the distill teacher inline or
// by weight handle), their byte counts and the outputs only it returns. Reads no tensor data.
#ifndef LOSSD_ENGINE_PLAN_KIND_H_
#define LOSSD_ENGINE_PLAN_KIND_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "engine/compute_plan.h"
#include "engine/weight_cache.h"

namespace lossd {

// INVALID_ARGUMENT for a kind out of range; UNIMPLEMENTED naming `backend` when its
// `loss_kinds` (BackendInfo) lacks the kind. First of the checks: nothing else about a
// request matters when the server cannot compute it. Also UNIMPLEMENTED for a policy request
// with sequence-level importance sampling where `loss_kinds` lacks kPolicySequenceBit.
absl::Status CheckKindServed(const ComputeSpec& spec, const std::string& backend,
                             uint32_t loss_kinds);

// After the student's shape (plan->bt, h, v, dtype) is known: the kind's options (core's
// CheckKindOptions, CheckPolicyParams, CheckDistillParams), its tensors (another kind's are
// refused naming the header field, its required ones must be there), the teacher's weights
// (inline (V, Ht) of X's dtype, or the caller's own handle of the same V and dtype; Ht at most
// `max_h`), the wanted outputs the kind writes; sets the plan's kind fields and the input
// bytes of the kind's tensors.
absl::Status PlanKind(const ComputeSpec& spec, int64_t max_h, WeightCache& weights,
                      ComputePlan* plan);

}  // namespace lossd

#endif  // LOSSD_ENGINE_PLAN_KIND_H_
