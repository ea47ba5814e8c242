// SPDX-License-Identifier: Apache-2.0
#include "client/replica_pool.h"

#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/rendezvous.h"

namespace lossd {
namespace client {
namespace {

// Opens and closes a TCP connection to `endpoint` ("host:port", "[ipv6]:port") within
// `timeout`: OK when something listens there, UNAVAILABLE (refused, unreachable, a name that
// does not resolve) or DEADLINE_EXCEEDED.
absl::Status TcpConnect(const std::string& endpoint, absl::Duration timeout) {
  const size_t colon = endpoint.rfind(':');
  std::string host = endpoint.substr(0, colon);
  const std::string port = endpoint.substr(colon + 1);
  if (!host.empty() && host.front() == '[') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  const int fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  }
  int err = 0;
  if (connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    err = errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int ready = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
      if (ready == 0) {
        close(fd);
        freeaddrinfo(res);
        return absl::DeadlineExceededError(absl::StrCat(
            "no TCP connection to ", endpoint, " within ", absl::FormatDuration(timeout)));
      }
      socklen_t errlen = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &errlen);
    }
  }
  close(fd);
  freeaddrinfo(res);
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat("connect ", endpoint, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidatePoolOptions(const PoolOptions& o) {
  absl::StatusOr<std::vector<TargetEntry>> entries = ParseTargets(o.targets);
  if (!entries.ok()) return entries.status();
  if (!o.client.target.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "client.target must be empty in a pool (each replica's endpoint is its target), got '",
        o.client.target, "': give the replicas in targets"));
  }
  ClientOptions probe = o.client;
  probe.target = "127.0.0.1:1";  // checks the rest of the client options; connects nothing
  absl::StatusOr<std::unique_ptr<LossClient>> c = LossClient::Create(probe);
  if (!c.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("client: ", c.status().message()));
  }
  const struct {
    const char* name;
    absl::Duration value;
  } periods[] = {{"reresolve_period", o.reresolve_period},
                 {"down_for", o.down_for},
                 {"probe_deadline", o.probe_deadline}};
  for (const auto& p : periods) {
    if (p.value <= absl::ZeroDuration() || p.value == absl::InfiniteDuration()) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.name, " must be a positive, finite duration, got ", absl::FormatDuration(p.value)));
    }
  }
  if (o.tickets_kept == 0) {
    return absl::InvalidArgumentError(
        "tickets_kept must be at least 1, got 0 (a two-phase backward goes to the replica of "
        "its forward, which the pool must remember)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ReplicaPool>> ReplicaPool::Create(const PoolOptions& options) {
  absl::Status valid = ValidatePoolOptions(options);
  if (!valid.ok()) return valid;
  std::vector<TargetEntry> entries = *ParseTargets(options.targets);
  // The first resolution must find a replica: a pool of none is a configuration error the
  // trainer should hear at start-up, not at its first step.
  absl::StatusOr<std::vector<std::string>> first = ResolveTargets(entries, options.resolve);
  if (!first.ok()) return first.status();
  std::unique_ptr<ReplicaPool> pool(new ReplicaPool(options, std::move(entries)));
  absl::MutexLock lock(&pool->mu_);
  pool->endpoints_ = *std::move(first);
  pool->resolved_at_ = pool->Now();
  pool->resolve_now_ = false;
  return pool;
}

ReplicaPool::ReplicaPool(const PoolOptions& options, std::vector<TargetEntry> entries)
    : options_(options), entries_(std::move(entries)) {}

absl::Time ReplicaPool::Now() const { return options_.now ? options_.now() : absl::Now(); }

void ReplicaPool::Log(const std::string& line) const {
  if (options_.log) {
    options_.log(line);
  } else {
    std::cerr << "lossd pool: " << line << std::endl;
  }
}

void ReplicaPool::Resolve() {
  if (std::none_of(entries_.begin(), entries_.end(),
                   [](const TargetEntry& e) { return e.resolve; })) {
    absl::MutexLock lock(&mu_);  // a fixed list: nothing to look up, nothing counted
    resolved_at_ = Now();
    resolve_now_ = false;
    return;
  }
  absl::StatusOr<std::vector<std::string>> found = ResolveTargets(entries_, options_.resolve);
  absl::MutexLock lock(&mu_);
  resolved_at_ = Now();
  resolve_now_ = false;
  ++counters_.reresolutions;
  // A name that resolves to nothing for a moment (DNS down, every pod restarting) keeps the
  // replicas it had: calls to them fail on their own if they are gone.
  if (found.ok()) endpoints_ = *std::move(found);
}

std::vector<std::string> ReplicaPool::Order(const std::string& key) {
  bool resolve;
  std::vector<std::string> retry;
  {
    absl::MutexLock lock(&mu_);
    resolve = resolve_now_ || Now() - resolved_at_ >= options_.reresolve_period;
    const absl::Time now = Now();
    for (const auto& [e, until] : down_until_) {
      if (until <= now) retry.push_back(e);
    }
  }
  if (resolve) Resolve();
  // A replica whose down time is over is probed before it takes keys again: its connections
  // still hold the failures (and the reconnect backoff) of when it was down.
  for (const std::string& e : retry) {
    absl::StatusOr<std::string> up = Instance(e);
    absl::MutexLock lock(&mu_);
    if (up.ok()) {
      down_until_.erase(e);
    } else {
      down_until_[e] = Now() + options_.down_for;
    }
  }
  absl::MutexLock lock(&mu_);
  std::vector<std::string> up, down;
  for (std::string& e : RendezvousOrder(key, endpoints_)) {
    (down_until_.count(e) != 0 ? down : up).push_back(std::move(e));
  }
  up.insert(up.end(), down.begin(), down.end());
  return up;
}

LossClient* ReplicaPool::Client(const std::string& endpoint) {
  absl::MutexLock lock(&mu_);
  ++counters_.calls[endpoint];
  return ClientLocked(endpoint);
}

LossClient* ReplicaPool::ClientLocked(const std::string& endpoint) {
  std::unique_ptr<LossClient>& c = clients_[endpoint];
  if (c == nullptr) {
    ClientOptions o = options_.client;
    o.target = endpoint;
    c = *LossClient::Create(o);  // the options were validated with the pool's
  }
  return c.get();
}

absl::StatusOr<std::string> ReplicaPool::Instance(const std::string& endpoint) {
  // Nothing listening fails in one round trip; gRPC would only say so after its backoff.
  if (absl::Status tcp = TcpConnect(endpoint, options_.probe_deadline); !tcp.ok()) return tcp;
  LossClient* c;
  {
    absl::MutexLock lock(&mu_);
    c = ClientLocked(endpoint);
  }
  if (absl::Status s = c->Connect(options_.probe_deadline); !s.ok()) return s;
  CallOptions call;
  call.deadline = options_.probe_deadline;
  absl::StatusOr<ServerInfoResult> info = c->ServerInfo(call);
  if (!info.ok()) return info.status();
  return info->instance;
}

void ReplicaPool::MarkDown(const std::string& endpoint) {
  absl::MutexLock lock(&mu_);
  down_until_[endpoint] = Now() + options_.down_for;
  resolve_now_ = true;  // a replica that went away may have been replaced under the name
}

std::optional<std::string> ReplicaPool::LostReason(const std::string& endpoint,
                                                   const absl::Status& failure,
                                                   const std::string& instance) {
  if (failure.GetPayload(kLocalErrorPayload).has_value()) return std::nullopt;
  const absl::StatusCode code = failure.code();
  if (code != absl::StatusCode::kUnavailable && code != absl::StatusCode::kNotFound &&
      code != absl::StatusCode::kFailedPrecondition &&
      code != absl::StatusCode::kDeadlineExceeded && code != absl::StatusCode::kCancelled) {
    return std::nullopt;  // the call's own error (a bad request, a refused credential)
  }
  absl::StatusOr<std::string> now = Instance(endpoint);
  if (!now.ok()) {
    const absl::StatusCode pc = now.status().code();
    if (pc != absl::StatusCode::kUnavailable && pc != absl::StatusCode::kDeadlineExceeded) {
      return std::nullopt;
    }
    MarkDown(endpoint);
    return absl::StrCat("is unreachable (", failure.ToString(), ")");
  }
  if (!instance.empty() && *now != instance) {
    return absl::StrCat("restarted: it is now server instance '", *now, "', not '", instance,
                        "'");
  }
  return std::nullopt;
}

void ReplicaPool::CountMove(const std::string& line) {
  {
    absl::MutexLock lock(&mu_);
    ++counters_.moves;
  }
  Log(line);
}

void ReplicaPool::CountReupload(const std::string& line) {
  {
    absl::MutexLock lock(&mu_);
    ++counters_.reuploads;
  }
  Log(line);
}

void ReplicaPool::CountUpload() {
  absl::MutexLock lock(&mu_);
  ++counters_.uploads;
}

void ReplicaPool::CountLost(bool head, const std::string& line) {
  {
    absl::MutexLock lock(&mu_);
    ++(head ? counters_.heads_lost : counters_.steps_lost);
  }
  Log(line);
}

bool ReplicaPool::IsDown(const std::string& endpoint) const {
  absl::MutexLock lock(&mu_);
  auto it = down_until_.find(endpoint);
  return it != down_until_.end() && it->second > Now();
}

PoolCounters ReplicaPool::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

std::vector<std::string> ReplicaPool::endpoints() const {
  absl::MutexLock lock(&mu_);
  return endpoints_;
}

}  // namespace client
}  // namespace lossd
