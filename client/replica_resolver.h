// The replica pool's names: parses a pool's targets ("host:port,host:port", or one DNS name
// "dns:///name:port" / "name:port") and resolves them to replica endpoints "ip:port" (IPv6 as
// "[ip]:port"), every A/AAAA record one replica, as the client's own getaddrinfo sees them (a
// Kubernetes headless Service lists every ready pod). Never caches: the pool decides when to
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
  bool literal = false;  // an IP address: used as it is, never resolved
};

// The addresses (IPv4 dotted, IPv6 without brackets) of a host name; NOT_FOUND / UNAVAILABLE
// when it has none. Tests inject their own; the default asks getaddrinfo.
using ResolveFunction =
    std::function<absl::StatusOr<std::vector<std::string>>(const std::string& host)>;
absl::StatusOr<std::vector<std::string>> GetAddrInfoResolve(const std::string& host);

// INVALID_ARGUMENT naming `field` and the entry: empty targets or entry, a missing or bad
// port (1..65535), an unclosed IPv6 bracket, a scheme other than dns:///.
absl::StatusOr<std::vector<TargetEntry>> ParseTargets(const std::string& targets,
                                                      const char* field = "targets");

// "ip:port", or "[ip]:port" for IPv6: the endpoint string both clients hash.
std::string EndpointString(const std::string& ip, int port);

// Every endpoint of `entries`, sorted and without duplicates. A name that does not resolve
// is skipped while others do; an error (naming each failure) when none resolves.
absl::StatusOr<std::vector<std::string>> ResolveTargets(const std::vector<TargetEntry>& entries,
                                                        const ResolveFunction& resolve);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_REPLICA_RESOLVER_H_
