// SPDX-License-Identifier: Apache-2.0
// PooledClient: the calls that describe replicas rather than touch state (ServerInfo, List).
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/pooled_client.h"
#include "client/rendezvous.h"

namespace lossd {
namespace client {

absl::StatusOr<ServerInfoResult> PooledClient::ServerInfo(const CallOptions& call) {
  absl::Status last;
  for (const std::string& e : pool_->Order(RankKey(pool_->options().rank))) {
    absl::StatusOr<ServerInfoResult> info = pool_->Client(e)->ServerInfo(call);
    if (info.ok() || !Lost(e, info.status(), "")) return info;
    last = info.status();
  }
  return last;
}

std::map<std::string, absl::StatusOr<std::vector<StateEntry>>> PooledClient::List(
    const CallOptions& call) {
  std::map<std::string, absl::StatusOr<std::vector<StateEntry>>> out;
  for (const std::string& e : pool_->endpoints()) out.emplace(e, pool_->Client(e)->List(call));
  return out;
}

}  // namespace client
}  // namespace lossd
