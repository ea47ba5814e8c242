// SPDX-License-Identifier: Apache-2.0
// lossctl's `replicas` command: the replica pool's view of its targets, as a trainer's pool
// would see them (client/pooled_client.h): every replica they resolve to, whether it answers
// and as which instance, and where given keys live. Reads the flags lossctl.cc defines;
// changes nothing on any server.
#ifndef LOSSD_CLIENT_LOSSCTL_REPLICAS_H_
#define LOSSD_CLIENT_LOSSCTL_REPLICAS_H_

#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "client/lossctl_output.h"

ABSL_DECLARE_FLAG(std::string, replicas);
ABSL_DECLARE_FLAG(std::string, keys);

namespace lossd {
namespace client {

// UNAVAILABLE (after printing every replica) when one does not answer.
absl::Status RunReplicas(CommandOutput& out);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSCTL_REPLICAS_H_
