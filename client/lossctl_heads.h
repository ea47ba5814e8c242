// SPDX-License-Identifier: Apache-2.0
// lossctl's hosted-head commands: `lossctl head create|step|export|import|info|list|drop`,
// and what `compute --head` needs (the head's shape and dtype for random data). An export
// is a folder: one .npy per tensor, written as the ranges arrive, and head.txt (the header,
// "key value" lines), written last; import reads it back. Defines the head commands' flags
// and reads those lossctl.cc defines (all declared below); never changes what the server
// computes.
#ifndef LOSSD_CLIENT_LOSSCTL_HEADS_H_
#define LOSSD_CLIENT_LOSSCTL_HEADS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/head_types.h"
#include "client/lossctl_output.h"
#include "client/lossd_client.h"

ABSL_DECLARE_FLAG(std::string, head);
ABSL_DECLARE_FLAG(uint64_t, head_version);
ABSL_DECLARE_FLAG(uint32_t, rank);
ABSL_DECLARE_FLAG(uint32_t, world_size);
ABSL_DECLARE_FLAG(uint64_t, micro_batch);
ABSL_DECLARE_FLAG(std::string, optimizer);
ABSL_DECLARE_FLAG(std::optional<double>, lr);
ABSL_DECLARE_FLAG(std::optional<double>, weight_decay);
ABSL_DECLARE_FLAG(double, bias_weight_decay);
ABSL_DECLARE_FLAG(double, momentum);
ABSL_DECLARE_FLAG(double, dampening);
ABSL_DECLARE_FLAG(bool, nesterov);
ABSL_DECLARE_FLAG(double, beta1);
ABSL_DECLARE_FLAG(double, beta2);
ABSL_DECLARE_FLAG(double, eps);
ABSL_DECLARE_FLAG(bool, amsgrad);
ABSL_DECLARE_FLAG(std::string, compute_dtype);
ABSL_DECLARE_FLAG(std::string, state_dir);
ABSL_DECLARE_FLAG(int64_t, optimizer_step);
ABSL_DECLARE_FLAG(std::string, phase);
ABSL_DECLARE_FLAG(std::optional<double>, clip_coef);
ABSL_DECLARE_FLAG(std::optional<double>, max_norm);
ABSL_DECLARE_FLAG(bool, skip);
ABSL_DECLARE_FLAG(int64_t, range_bytes);
ABSL_DECLARE_FLAG(std::string, in_dir);
ABSL_DECLARE_FLAG(std::string, out_dir);
ABSL_DECLARE_FLAG(std::vector<std::string>, group_members);
ABSL_DECLARE_FLAG(uint32_t, group_member);
ABSL_DECLARE_FLAG(std::string, group_id);

namespace lossd {
namespace client {

// `lossctl head <sub>`; INVALID_ARGUMENT naming the subcommands for another one.
absl::Status RunHead(const std::string& sub, CommandOutput& out);

// compute --head on random data: --v, --h and --dtype from the head's Info where not given.
absl::Status HeadShapeFlagsForCompute(LossClient& client);

// head.txt: a header as "key value" lines, and back (INVALID_ARGUMENT naming a missing or
// malformed key).
std::string HeadSpecText(const HeadSpec& spec, const std::string& instance);
absl::StatusOr<HeadSpec> ParseHeadSpecText(const std::string& text);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSCTL_HEADS_H_
