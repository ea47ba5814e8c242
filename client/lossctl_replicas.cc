// SPDX-License-Identifier: Apache-2.0
#include "client/lossctl_replicas.h"

#include <memory>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/lossctl_inputs.h"
#include "client/rendezvous.h"
#include "client/replica_pool.h"
#include "core/status_macros.h"

namespace lossd {
namespace client {

absl::Status RunReplicas(CommandOutput& out) {
  const std::string targets = absl::GetFlag(FLAGS_replicas);
  if (targets.empty()) {
    return absl::InvalidArgumentError(
        "replicas needs --replicas=host:port,host:port or --replicas=dns:///name:port");
  }
  PoolOptions o;
  o.targets = targets;
  LOSSD_ASSIGN_OR_RETURN(o.client, ClientOptionsFromFlags());
  o.client.target.clear();  // each replica's endpoint is its target
  absl::StatusOr<std::unique_ptr<ReplicaPool>> pool = ReplicaPool::Create(o);
  if (!pool.ok()) {
    return absl::Status(pool.status().code(),
                        absl::StrCat("--replicas: ", pool.status().message()));
  }
  const std::vector<std::string> endpoints = (*pool)->endpoints();
  int silent = 0;
  for (const std::string& e : endpoints) {
    absl::StatusOr<ServerInfoResult> info = (*pool)->Client(e)->ServerInfo();
    if (info.ok()) {
      out.Row("replica",
              {{"endpoint", e}, {"instance", info->instance}, {"version", info->version},
               {"backend", info->backend}},
              absl::StrFormat("%-28s %-24s %s %s", e, info->instance, info->version,
                              info->backend));
    } else {
      ++silent;
      const std::string why = info.status().ToString();
      out.Row("replica", {{"endpoint", e}, {"error", why}},
              absl::StrFormat("%-28s unreachable: %s", e, why));
    }
  }
  for (absl::string_view key : absl::StrSplit(absl::GetFlag(FLAGS_keys), ',',
                                              absl::SkipWhitespace())) {
    const std::vector<std::string> order = RendezvousOrder(key, endpoints);
    out.Row("key", {{"key", std::string(key)}, {"order", absl::StrJoin(order, ",")}},
            absl::StrFormat("%-28s -> %s (then %s)", key, order.front(),
                            order.size() > 1 ? absl::StrJoin(order.begin() + 1, order.end(), ", ")
                                             : std::string("none")));
  }
  if (silent > 0) {
    return absl::UnavailableError(
        absl::StrCat(silent, " of ", endpoints.size(), " replicas did not answer"));
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace lossd
