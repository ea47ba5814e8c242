// SPDX-License-Identifier: Apache-2.0
// The float64 policy reference's input rules (policy_reference.h's PolicyOptions and
// PolicyProblem): every option's range and combination, the head, the mask and the targets
// of the rows that count, the per-row inputs. Apart from the math so that each reads alone.
#ifndef LOSSD_KERNELS_CPU_POLICY_REFERENCE_CHECK_H_
#define LOSSD_KERNELS_CPU_POLICY_REFERENCE_CHECK_H_

#include "absl/status/status.h"
#include "kernels/cpu/policy_reference.h"

namespace lossd {

// OK, or INVALID_ARGUMENT naming the field and value of the first rule `p` breaks.
absl::Status CheckPolicyProblem(const PolicyProblem& p);

}  // namespace lossd

#endif  // LOSSD_KERNELS_CPU_POLICY_REFERENCE_CHECK_H_
