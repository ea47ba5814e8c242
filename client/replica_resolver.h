// SPDX-License-Identifier: Apache-2.0
// The replica pool's names: parses a pool's targets and turns them into replica endpoints,
// the strings both clients hash. A list "host:port,host:port" names its replicas as written
// (IP literals in canonical form; host names are not resolved, so every trainer must spell
// them alike); one name "dns:///name:port" or "name:port" is resolved by the client itself
// (getaddrinfo), every A/AAAA record one replica "ip:port" ("[ip]:port" for IPv6), as a
// Kubernetes headless Service lists every ready pod. Never caches: the pool decides when to
// resolve again.
#ifndef LOSSD_CLIENT_REPLICA_RESOLVER_H_
#define LOSSD_CLIENT_REPLICA_RESOLVER_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lossd {
namespace client {

// One entry of the targets: a host (name or IP literal, IPv6 without brackets) and a port.
struct TargetEntry {
  std::string host;
  int port = 0;
  bool resolve = false;  // a name standing alone: every address it resolves to is a replica
};

// The addresses (IPv4 dotted, IPv6 without brackets) of a host name; NOT_FOUND / UNAVAILABLE
// when it has none. Tests inject their own; the default asks getaddrinfo.
using ResolveFunction =
    std::function<absl::StatusOr<std::vector<std::string>>(const std::string& host)>;
absl::StatusOr<std::vector<std::string>> GetAddrInfoResolve(const std::string& host);

// INVALID_ARGUMENT naming `field` and the entry: empty targets or entry, a missing or bad
// port (1..65535), an unclosed IPv6 bracket, a scheme other than dns:///, dns:/// in a list
// (a name to resolve stands alone), a replica listed twice.
absl::StatusOr<std::vector<TargetEntry>> ParseTargets(const std::string& targets,
                                                      const char* field = "targets");

// "ip:port", or "[ip]:port" for IPv6: the endpoint string both clients hash.
std::string EndpointString(const std::string& ip, int port);

// Every endpoint of `entries`, sorted and without duplicates: a list's entries as they are,
// a name's addresses. UNAVAILABLE (naming the failures) when a name resolves to none.
absl::StatusOr<std::vector<std::string>> ResolveTargets(const std::vector<TargetEntry>& entries,
                                                        const ResolveFunction& resolve);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_REPLICA_RESOLVER_H_
