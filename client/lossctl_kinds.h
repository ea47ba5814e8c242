// SPDX-License-Identifier: Apache-2.0
// lossctl's flags of the loss kinds other than cross-entropy (`lossctl compute --kind=logprob|
// policy|distill`): the kind, its temperature and options, and its inputs from .npy files or
// random data; and the lines a policy result adds. Defines the flags it reads; talks to no
// server.
#ifndef LOSSD_CLIENT_LOSSCTL_KINDS_H_
#define LOSSD_CLIENT_LOSSCTL_KINDS_H_

#include <cstdint>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "client/lossctl_output.h"
#include "client/lossd_client.h"

ABSL_DECLARE_FLAG(std::string, kind);
ABSL_DECLARE_FLAG(uint32_t, keep_ms);
ABSL_DECLARE_FLAG(std::string, ticket);

namespace lossd {
namespace client {

// The kind's fields of `r` (whose X, W or handle, and targets are set; V = `v`) from the
// flags. INVALID_ARGUMENT for an unknown kind or loss type, and for a flag of another kind.
absl::Status KindFromFlags(int64_t v, ComputeRequest* r);
// The backward of a two-phase logprob forward (--ticket): dlogp and/or dentropy from .npy
// files, the wanted gradients, grad_scale, grad_dtype, an accumulator, a head's --rank and
// --micro_batch. INVALID_ARGUMENT for a flag that gives what the ticket holds (--x, --w,
// --bias, --targets, --weight_handle, --head, ...) or another kind.
absl::StatusOr<ComputeRequest> BackwardFromFlags();
// A policy call's kl and clip_fraction, a kept forward's ticket (nothing for the others).
void PrintKindResult(const ComputeRequest& r, const ComputeResult& res, CommandOutput& out);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSCTL_KINDS_H_
