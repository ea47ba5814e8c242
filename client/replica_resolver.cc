// SPDX-License-Identifier: Apache-2.0
#include "client/replica_resolver.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace lossd {
namespace client {
namespace {

// The canonical text of an IP literal (so "127.000.0.1"-like spellings and IPv6 zero runs
// hash as one endpoint), or "" when `host` is not one.
std::string CanonicalIp(const std::string& host) {
  char text[INET6_ADDRSTRLEN];
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return inet_ntop(AF_INET, &v4, text, sizeof(text)) ? std::string(text) : "";
  }
  in6_addr v6;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    return inet_ntop(AF_INET6, &v6, text, sizeof(text)) ? std::string(text) : "";
  }
  return "";
}

// One "host:port" / "[ipv6]:port" entry, without its dns:/// prefix.
absl::StatusOr<TargetEntry> ParseEntry(absl::string_view e, const std::string& quoted,
                                       const char* field) {
  TargetEntry out;
  absl::string_view port;
  if (absl::ConsumePrefix(&e, "[")) {
    const size_t close = e.find(']');
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " entry ", quoted, ": '[' without ']'"));
    }
    out.host = std::string(e.substr(0, close));
    absl::string_view rest = e.substr(close + 1);
    if (!absl::ConsumePrefix(&rest, ":")) rest = "";
    port = rest;
  } else {
    const size_t colon = e.rfind(':');
    if (colon == absl::string_view::npos || e.find(':') != colon) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " entry ", quoted,
          ": expected host:port (an IPv6 address in brackets: [::1]:50051)"));
    }
    out.host = std::string(e.substr(0, colon));
    port = e.substr(colon + 1);
  }
  if (out.host.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " entry ", quoted, ": empty host"));
  }
  int p = 0;
  if (port.empty() || !absl::SimpleAtoi(port, &p) || p < 1 || p > 65535 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return absl::InvalidArgumentError(absl::StrCat(field, " entry ", quoted, ": port '", port,
                                                   "' is not a number in [1, 65535]"));
  }
  out.port = p;
  return out;
}

}  // namespace

absl::StatusOr<std::vector<TargetEntry>> ParseTargets(const std::string& targets,
                                                      const char* field) {
  if (absl::StripAsciiWhitespace(targets).empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is empty: give host:port[,host:port...] or dns:///name:port"));
  }
  const std::vector<absl::string_view> raw = absl::StrSplit(targets, ',');
  std::vector<TargetEntry> out;
  std::set<std::string> seen;
  for (absl::string_view r : raw) {
    absl::string_view e = absl::StripAsciiWhitespace(r);
    const std::string quoted = absl::StrCat("'", e, "'");
    if (e.empty()) return absl::InvalidArgumentError(absl::StrCat(field, " has an empty entry"));
    const bool dns = absl::ConsumePrefix(&e, "dns:///");
    if (absl::StrContains(e, "://")) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " entry ", quoted, ": only dns:/// names and host:port are understood"));
    }
    if (dns && raw.size() > 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " entry ", quoted,
          ": a dns:/// name stands alone (it resolves to every replica), not in a list"));
    }
    absl::StatusOr<TargetEntry> entry = ParseEntry(e, quoted, field);
    if (!entry.ok()) return entry.status();
    const std::string ip = CanonicalIp(entry->host);
    if (!ip.empty()) entry->host = ip;
    // A name alone is resolved; in a list every entry is one replica, hashed as written.
    entry->resolve = raw.size() == 1 && (dns || ip.empty());
    if (!seen.insert(EndpointString(entry->host, entry->port)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " entry ", quoted, ": a replica listed twice"));
    }
    out.push_back(*std::move(entry));
  }
  return out;
}

std::string EndpointString(const std::string& ip, int port) {
  if (ip.find(':') != std::string::npos) return absl::StrCat("[", ip, "]:", port);
  return absl::StrCat(ip, ":", port);
}

absl::StatusOr<std::vector<std::string>> GetAddrInfoResolve(const std::string& host) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  char text[INET6_ADDRSTRLEN];
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const void* addr = nullptr;
    if (a->ai_family == AF_INET) {
      addr = &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr;
    } else if (a->ai_family == AF_INET6) {
      addr = &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr;
    } else {
      continue;
    }
    if (inet_ntop(a->ai_family, addr, text, sizeof(text)) != nullptr) out.push_back(text);
  }
  freeaddrinfo(res);
  if (out.empty()) return absl::NotFoundError(absl::StrCat("'", host, "' has no addresses"));
  return out;
}

absl::StatusOr<std::vector<std::string>> ResolveTargets(const std::vector<TargetEntry>& entries,
                                                        const ResolveFunction& resolve) {
  std::vector<std::string> endpoints;
  std::vector<std::string> failures;
  for (const TargetEntry& e : entries) {
    if (!e.resolve) {
      endpoints.push_back(EndpointString(e.host, e.port));
      continue;
    }
    absl::StatusOr<std::vector<std::string>> ips =
        resolve ? resolve(e.host) : GetAddrInfoResolve(e.host);
    if (ips.ok() && ips->empty()) ips = absl::NotFoundError(absl::StrCat("no addresses"));
    if (!ips.ok()) {
      failures.push_back(absl::StrCat(e.host, ": ", ips.status().message()));
      continue;
    }
    for (const std::string& ip : *ips) {
      const std::string canonical = CanonicalIp(ip);
      if (canonical.empty()) {
        failures.push_back(absl::StrCat(e.host, ": resolved to '", ip, "', not an address"));
        continue;
      }
      endpoints.push_back(EndpointString(canonical, e.port));
    }
  }
  std::sort(endpoints.begin(), endpoints.end());
  endpoints.erase(std::unique(endpoints.begin(), endpoints.end()), endpoints.end());
  if (endpoints.empty()) {
    return absl::UnavailableError(
        absl::StrCat("no replica endpoints: ", absl::StrJoin(failures, "; ")));
  }
  return endpoints;
}

}  // namespace client
}  // namespace lossd
