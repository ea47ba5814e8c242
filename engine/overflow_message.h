// SPDX-License-Identifier: Apache-2.0
// Why a Compute's loss came out non-finite from finite inputs, in words that name what to
// scale down: for a policy loss, the KL term's exp(ref_logp - logp) or the importance ratio's
// exp(logp - old_logp) at the first row whose exponent overflows fp32 (found by a log-prob
// forward of the same rows, on the refusal path only); else the logits and the z-loss. Reads
// the problem, never writes it or the call's outputs.
#ifndef LOSSD_ENGINE_OVERFLOW_MESSAGE_H_
#define LOSSD_ENGINE_OVERFLOW_MESSAGE_H_

#include <string>

#include "core/loss_problem.h"
#include "engine/compute_plan.h"
#include "kernels/backend.h"

namespace lossd {

// Whether the loss `out` holds ((BT) with reduction none, else one value) is finite.
bool LossIsFinite(const ComputePlan& plan, const LossOutputs& out);

// The message of the INVALID_ARGUMENT that refuses a non-finite loss of `plan` over `p`
// (finite inputs). For kPolicy it runs `backend` once more: a forward-only kLogprob over p's
// rows, into buffers of its own.
std::string OverflowMessage(Backend& backend, const ComputePlan& plan, const LossProblem& p);

}  // namespace lossd

#endif  // LOSSD_ENGINE_OVERFLOW_MESSAGE_H_
