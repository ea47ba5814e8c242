// SPDX-License-Identifier: Apache-2.0
// The replicas of a pool and what the pool knows of them: the endpoints its targets resolve
// to (again every reresolve_period, and at once after a replica is unreachable), one
// LossClient per endpoint, which replicas are down, each replica's server instance, and the
// counters. Places nothing: client/pooled_client.h decides where each call goes.
#ifndef LOSSD_CLIENT_REPLICA_POOL_H_
#define LOSSD_CLIENT_REPLICA_POOL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/lossd_client.h"
#include "client/replica_resolver.h"

namespace lossd {
namespace client {

// ClientOptions' defaults without a target (each replica's endpoint is its target).
inline ClientOptions PoolClientDefaults() {
  ClientOptions c;
  c.target.clear();
  return c;
}

struct PoolOptions {
  // "host:port,host:port" (each an IP or a name), or one name "dns:///name:port" / "name:port"
  // (a headless Service), every address a name resolves to one replica.
  std::string targets;
  // Every replica's LossClient options; `client.target` is set per replica and must be left
  // empty.
  ClientOptions client = PoolClientDefaults();
  // Resolve the targets again after this long (checked when a call starts), and at once after
  // a replica is unreachable.
  absl::Duration reresolve_period = absl::Seconds(30);
  // A replica that was unreachable takes no new keys for this long; then it is tried again.
  absl::Duration down_for = absl::Seconds(10);
  // Deadline of each part of the probe (a TCP connection, the channels connecting, a
  // ServerInfo) that tells a lost replica (unreachable, or a new instance) from a call's own
  // failure.
  absl::Duration probe_deadline = absl::Seconds(5);
  // The trainer's rank: its stateless Computes (no head, accumulator or weights name) go to
  // RankKey(rank)'s replica. A process of several ranks makes one pool per rank.
  uint32_t rank = 0;
  // The rank named in a lost head's error as the one that imports it from its last export:
  // one rank, the same in every trainer of the job.
  uint32_t import_rank = 0;
  // Two-phase log-prob tickets whose replica the pool remembers (for their backward): the
  // newest this many unexpired; past it, the one that expires first is forgotten. At least 1.
  size_t tickets_kept = 4096;
  // Tests: resolves a host name to addresses (nullptr = getaddrinfo) ...
  ResolveFunction resolve;
  // ... and receives each move and re-upload line (nullptr = stderr).
  std::function<void(const std::string&)> log;
  // Tests: the clock (nullptr = absl::Now).
  std::function<absl::Time()> now;
};

// What the pool has done, for monitoring.
struct PoolCounters {
  uint64_t moves = 0;  // keys whose replica changed (failover)
  // Weights uploaded again (from verified bytes) to replace a handle lost with its replica,
  // each lost handle at most once ...
  uint64_t reuploads = 0;
  // ... and every weights upload: PutWeights, re-uploads, and W sent to the replica of an
  // accumulator or head that a Compute names with it.
  uint64_t uploads = 0;
  uint64_t reresolutions = 0;  // resolutions after the first
  uint64_t steps_lost = 0;     // accumulators lost with a sum in them
  uint64_t heads_lost = 0;     // hosted heads lost (once per pool that met the loss)
  std::map<std::string, uint64_t> calls;  // calls sent, by endpoint
};

// The payload that marks an error the pool made itself (weights it cannot upload again, a
// name it does not know): LostReason never takes it for a replica's.
inline constexpr char kLocalErrorPayload[] = "lossd.pool/local";

// INVALID_ARGUMENT naming the field for every option a pool cannot use.
absl::Status ValidatePoolOptions(const PoolOptions& options);

// Thread-safe.
class ReplicaPool {
 public:
  static absl::StatusOr<std::unique_ptr<ReplicaPool>> Create(const PoolOptions& options);

  // The endpoints by rendezvous order for `key`, those up first (re-resolving first when the
  // period has passed). Never empty.
  std::vector<std::string> Order(const std::string& key);
  // The LossClient of `endpoint` (made on first use), and one more call counted for it.
  LossClient* Client(const std::string& endpoint);
  // Whether a failed call's replica is lost, and why ("is unreachable (...)", "restarted:
  // now instance ..."): unreachable (the probe, Instance(), fails so too), or up
  // as another instance than `instance` where that is not empty. nullopt: up, the call's own
  // failure. An unreachable replica is marked down and the targets are resolved again.
  std::optional<std::string> LostReason(const std::string& endpoint, const absl::Status& failure,
                                        const std::string& instance);
  // The probe: the replica's server instance, asked once a TCP connection and then its
  // channels connect (each within probe_deadline); UNAVAILABLE or DEADLINE_EXCEEDED else.
  absl::StatusOr<std::string> Instance(const std::string& endpoint);

  // Counters and their log lines (each event logged once, by its caller).
  void CountMove(const std::string& line);
  void CountReupload(const std::string& line);
  void CountUpload();
  void CountLost(bool head, const std::string& line);
  // Marked down (unreachable) now.
  bool IsDown(const std::string& endpoint) const;
  PoolCounters counters() const;
  std::vector<std::string> endpoints() const;
  const PoolOptions& options() const { return options_; }
  // PoolOptions::now, else absl::Now().
  absl::Time Now() const;

 private:
  ReplicaPool(const PoolOptions& options, std::vector<TargetEntry> entries);
  void Log(const std::string& line) const;
  // Resolves the targets; keeps the last endpoints when none resolve.
  void Resolve() ABSL_LOCKS_EXCLUDED(mu_);
  void MarkDown(const std::string& endpoint);
  LossClient* ClientLocked(const std::string& endpoint) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const PoolOptions options_;
  const std::vector<TargetEntry> entries_;
  mutable absl::Mutex mu_;
  std::vector<std::string> endpoints_ ABSL_GUARDED_BY(mu_);
  absl::Time resolved_at_ ABSL_GUARDED_BY(mu_);
  bool resolve_now_ ABSL_GUARDED_BY(mu_) = true;
  std::map<std::string, absl::Time> down_until_ ABSL_GUARDED_BY(mu_);
  // Every endpoint ever resolved keeps its client: state placed there is still reached
  // through it after the name stops listing it.
  std::map<std::string, std::unique_ptr<LossClient>> clients_ ABSL_GUARDED_BY(mu_);
  PoolCounters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_REPLICA_POOL_H_
