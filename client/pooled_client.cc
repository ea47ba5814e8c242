// SPDX-License-Identifier: Apache-2.0
// PooledClient: placement, weights and accumulators (hosted heads in pooled_heads.cc).
#include "client/pooled_client.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "client/rendezvous.h"
#include "client/request_views.h"

namespace lossd {
namespace client {
namespace {

constexpr size_t kMaxWeightsName = 128;

absl::string_view BytesOf(const HostTensor& t) {
  return absl::string_view(reinterpret_cast<const char*>(t.data()), t.num_bytes());
}

// A checksum of W and the bias, to prove bytes unchanged within this process (absl::Hash is
// seeded per process, which is all it needs: it is never sent nor stored).
size_t Checksum(const HostTensor& w, const std::optional<HostTensor>& bias) {
  return absl::Hash<std::pair<absl::string_view, absl::string_view>>()(
      {BytesOf(w), bias ? BytesOf(*bias) : absl::string_view()});
}

// `r` with views of its tensors (no copies of owned ones) and another weight handle.
ComputeRequest WithHandle(const ComputeRequest& r, const std::string& handle) {
  ComputeRequest out = ViewsOf(r);
  out.weight_handle = handle;
  return out;
}

// Marks an error the pool made itself, before any call: it says nothing of a replica.
absl::Status Local(absl::Status s) {
  s.SetPayload(kLocalErrorPayload, absl::Cord("1"));
  return s;
}

bool HandleNotFound(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound && absl::StrContains(s.message(), "weight handle");
}

}  // namespace

struct PooledClient::Weights {
  std::string name;
  WeightsRetention keep = WeightsRetention::kVerifyCallerMemory;
  HostTensor w;                    // views or the pool's copy; empty for kNone
  std::optional<HostTensor> bias;
  size_t checksum = 0;
  absl::Mutex mu;  // one upload of these weights at a time
  std::map<std::string, std::string> handles ABSL_GUARDED_BY(mu);  // endpoint -> handle
  // Replicas whose handle of these weights was lost and not yet replaced by a re-upload.
  std::set<std::string> lost_on ABSL_GUARDED_BY(mu);
};

absl::StatusOr<std::unique_ptr<PooledClient>> PooledClient::Create(const PoolOptions& options) {
  absl::StatusOr<std::unique_ptr<ReplicaPool>> pool = ReplicaPool::Create(options);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<PooledClient>(new PooledClient(*std::move(pool)));
}

PooledClient::PooledClient(std::unique_ptr<ReplicaPool> pool)
    : pool_(std::move(pool)),
      calls_(std::make_unique<CallQueue>(pool_->options().client.max_in_flight)) {}
PooledClient::~PooledClient() = default;

std::string PooledClient::ReplicaOf(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  auto it = placed_.find(key);
  return it == placed_.end() ? "" : it->second.endpoint;
}

absl::StatusOr<PooledClient::Placement> PooledClient::Route(const std::string& key,
                                                            bool refuse_lost) {
  Placement p;
  {
    absl::MutexLock lock(&mu_);
    auto it = placed_.find(key);
    if (it != placed_.end()) {
      if (it->second.lost && refuse_lost) return absl::AbortedError(it->second.why);
      if (!it->second.endpoint.empty()) return it->second;
      p = it->second;
    }
  }
  p.endpoint = FirstFor(key, p.previous);
  p.instance.clear();  // not placed: nothing there to lose yet
  return p;
}

std::string PooledClient::FirstFor(const std::string& key, const std::string& lost_on) {
  return lost_on.empty() ? pool_->Order(key).front() : HomeOrder(key, lost_on).front();
}

std::vector<std::string> PooledClient::HomeOrder(const std::string& key,
                                                 const std::string& lost_on) {
  // Order() first: it resolves again and probes replicas whose down time is over.
  const std::vector<std::string> order = pool_->Order(key);
  std::vector<std::string> up, down;
  for (std::string& e : OrderAfterLoss(key, order, lost_on)) {
    (pool_->IsDown(e) ? down : up).push_back(std::move(e));
  }
  up.insert(up.end(), down.begin(), down.end());
  up.push_back(lost_on);
  return up;
}

std::optional<std::string> PooledClient::Lost(const std::string& endpoint,
                                              const absl::Status& failure,
                                              const std::string& instance) {
  std::optional<std::string> lost = pool_->LostReason(endpoint, failure, instance);
  if (!lost) return lost;
  std::vector<std::shared_ptr<Weights>> all;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, w] : weights_) all.push_back(w);
  }
  for (const std::shared_ptr<Weights>& w : all) {
    absl::MutexLock lock(&w->mu);
    if (w->handles.erase(endpoint) > 0) w->lost_on.insert(endpoint);
  }
  return lost;
}

void PooledClient::Place(const std::string& key, const std::string& endpoint,
                         const std::string& instance, const std::string& reason,
                         bool keep_lost) {
  std::string from;
  {
    absl::MutexLock lock(&mu_);
    Placement& p = placed_[key];
    if (keep_lost && p.lost) return;
    from = p.endpoint.empty() ? p.previous : p.endpoint;
    if (p.endpoint == endpoint && instance.empty()) return;
    p.instance = instance.empty() && p.endpoint == endpoint ? p.instance : instance;
    p.endpoint = endpoint;
    p.previous.clear();
    p.lost = false;
    p.why.clear();
  }
  if (!from.empty() && from != endpoint) {
    pool_->CountMove(absl::StrCat("'", key, "' moved from replica ", from, " to ", endpoint,
                                  reason.empty() ? "" : ": ", reason));
  }
}

absl::Status PooledClient::MarkLost(const std::string& key, const Placement& p,
                                    const std::string& why) {
  {
    absl::MutexLock lock(&mu_);
    Placement& q = placed_[key];
    q.endpoint.clear();
    q.instance.clear();
    q.previous = p.endpoint;
    q.excluded.insert(p.endpoint);
    q.lost = true;
    q.why = why;
  }
  pool_->CountLost(absl::StartsWith(key, "head:"), why);
  return absl::AbortedError(why);
}

std::string PooledClient::NextAfterLoss(const std::string& key, const Placement& p) {
  return FirstFor(key, p.endpoint);
}

std::string PooledClient::AccumulatorLostMessage(const std::string& acc,
                                                 const std::string& endpoint,
                                                 const std::string& reason,
                                                 const std::string& next) {
  return absl::StrCat(
      "accumulator '", acc, "' was on replica ", endpoint, ", which ", reason,
      ": whatever was added to it this step is lost, and the pool never sends a Compute "
      "into an accumulator again elsewhere. Redo the step: DropAccumulator('",
      acc, "'), then compute every micro-batch of the step again (it will start on replica ",
      next, ")");
}

// --- Weights ---

std::shared_ptr<PooledClient::Weights> PooledClient::FindWeights(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = weights_.find(name);
  return it == weights_.end() ? nullptr : it->second;
}

absl::StatusOr<PutWeightsResult> PooledClient::PutWeights(const std::string& name,
                                                          const HostTensor& w,
                                                          const HostTensor* bias,
                                                          WeightsRetention keep,
                                                          const CallOptions& call) {
  if (name.empty() || name.size() > kMaxWeightsName) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights name must be 1 to ", kMaxWeightsName, " bytes, got ", name.size()));
  }
  if (absl::Status s = w.Validate("w"); !s.ok()) return s;
  if (bias != nullptr) {
    if (absl::Status s = bias->Validate("bias"); !s.ok()) return s;
  }
  auto entry = std::make_shared<Weights>();
  entry->name = name;
  entry->keep = keep;
  if (keep == WeightsRetention::kVerifyCallerMemory) {
    entry->w = ViewOf(w);
    if (bias != nullptr) entry->bias = ViewOf(*bias);
    entry->checksum = Checksum(entry->w, entry->bias);
  } else if (keep == WeightsRetention::kCopy) {
    entry->w = CopyOf(w);
    if (bias != nullptr) entry->bias = CopyOf(*bias);
  }
  // A whole upload holds nothing partial: one that finds its replica gone goes to the next.
  const std::string key = WeightsKey(name);
  const std::vector<std::string> order = pool_->Order(key);
  absl::Status last;
  std::string reason;
  for (const std::string& e : order) {
    absl::StatusOr<PutWeightsResult> put = pool_->Client(e)->PutWeights(w, bias, call);
    if (!put.ok()) {
      std::optional<std::string> lost = Lost(e, put.status(), "");
      if (!lost) return put.status();
      last = put.status();
      reason = absl::StrCat("replica ", e, " ", *lost);
      continue;
    }
    pool_->CountUpload();
    std::shared_ptr<Weights> old;
    {
      absl::MutexLock entry_lock(&entry->mu);
      entry->handles[e] = put->handle;
    }
    {
      absl::MutexLock lock(&mu_);
      old = weights_[name];
      weights_[name] = entry;
    }
    Place(key, e, "", reason);
    if (old != nullptr) {  // replaced: the old weights' handles are garbage now
      absl::MutexLock old_lock(&old->mu);
      for (const auto& [endpoint, handle] : old->handles) {
        (void)pool_->Client(endpoint)->DropWeights(handle, call);
      }
    }
    PutWeightsResult out = *put;
    out.handle = name;
    return out;
  }
  return last;
}

absl::Status PooledClient::DropWeights(const std::string& name, const CallOptions& call) {
  std::shared_ptr<Weights> entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = weights_.find(name);
    if (it == weights_.end()) {
      return absl::NotFoundError(absl::StrCat("weights '", name, "' were not put in this pool"));
    }
    entry = it->second;
    weights_.erase(it);
    placed_.erase(WeightsKey(name));
  }
  absl::Status first;
  absl::MutexLock entry_lock(&entry->mu);
  for (const auto& [endpoint, handle] : entry->handles) {
    absl::Status s = pool_->Client(endpoint)->DropWeights(handle, call);
    // A replica that is gone took the handle with it.
    if (!s.ok() && s.code() != absl::StatusCode::kUnavailable && first.ok()) first = s;
  }
  return first;
}

absl::StatusOr<std::string> PooledClient::WeightsOn(const std::string& name,
                                                    const std::string& endpoint,
                                                    const CallOptions& call) {
  std::shared_ptr<Weights> entry = FindWeights(name);
  if (entry == nullptr) {
    return Local(absl::NotFoundError(absl::StrCat("weight_handle '", name,
                                                  "' names no weights put in this pool: call "
                                                  "PutWeights('", name, "', W) first")));
  }
  absl::MutexLock lock(&entry->mu);
  auto it = entry->handles.find(endpoint);
  if (it != entry->handles.end()) return it->second;
  // Handles on replicas marked down went with them.
  for (auto h = entry->handles.begin(); h != entry->handles.end();) {
    if (pool_->IsDown(h->first)) {
      entry->lost_on.insert(h->first);
      h = entry->handles.erase(h);
    } else {
      ++h;
    }
  }
  const std::string ask = absl::StrCat(
      "weights '", name, "' must be uploaded again to replica ", endpoint,
      " (the replica they were on lost them, or a head or accumulator there needs them), but ");
  const std::string redo =
      absl::StrCat(": call PutWeights('", name, "', W) again with the W this step computes "
                   "with, then redo the call");
  std::string how;
  switch (entry->keep) {
    case WeightsRetention::kNone:
      return Local(absl::FailedPreconditionError(
          absl::StrCat(ask, "the pool keeps nothing of them (WeightsRetention::kNone)", redo)));
    case WeightsRetention::kVerifyCallerMemory:
      if (Checksum(entry->w, entry->bias) != entry->checksum) {
        return Local(absl::FailedPreconditionError(absl::StrCat(
            ask, "the memory given to PutWeights no longer holds the bytes uploaded (W or the "
                 "bias changed in place)", redo)));
      }
      how = "the caller's bytes, verified unchanged by checksum";
      break;
    case WeightsRetention::kCopy:
      how = "the pool's copy";
      break;
  }
  absl::StatusOr<PutWeightsResult> put = pool_->Client(endpoint)->PutWeights(
      entry->w, entry->bias ? &*entry->bias : nullptr, call);
  if (!put.ok()) return put.status();
  entry->handles[endpoint] = put->handle;
  pool_->CountUpload();
  if (!entry->lost_on.empty()) {  // this upload replaces a handle lost with its replica
    const std::string replaced = *entry->lost_on.begin();
    entry->lost_on.erase(entry->lost_on.begin());
    pool_->CountReupload(absl::StrCat("weights '", name, "' uploaded again to replica ",
                                      endpoint, " (their handle on ", replaced,
                                      " was lost) from ", how));
  }
  return put->handle;
}

void PooledClient::ForgetWeightsOn(const std::string& name, const std::string& endpoint) {
  std::shared_ptr<Weights> entry = FindWeights(name);
  if (entry == nullptr) return;
  absl::MutexLock lock(&entry->mu);
  if (entry->handles.erase(endpoint) > 0) entry->lost_on.insert(endpoint);
}

// --- Compute ---

absl::StatusOr<ComputeResult> PooledClient::ComputeOn(const std::string& endpoint,
                                                      const ComputeRequest& r,
                                                      const CallOptions& call,
                                                      const std::string& state_instance) {
  if (r.weight_handle.empty()) return pool_->Client(endpoint)->Compute(r, call);
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<std::string> handle = WeightsOn(r.weight_handle, endpoint, call);
    if (!handle.ok()) return handle.status();
    absl::StatusOr<ComputeResult> res =
        pool_->Client(endpoint)->Compute(WithHandle(r, *handle), call);
    if (res.ok() || attempt > 0 || !HandleNotFound(res.status())) return res;
    // A replica restarted under an accumulator or head: that state is gone too, and W is
    // needed where it goes next, not here.
    if (!state_instance.empty() && Lost(endpoint, res.status(), state_instance)) return res;
    ForgetWeightsOn(r.weight_handle, endpoint);
  }
}

absl::StatusOr<ComputeResult> PooledClient::Compute(const ComputeRequest& r,
                                                    const CallOptions& call) {
  if (!r.ticket.empty()) return ComputeTicket(r, call);
  if (!r.head.empty()) {
    if (std::optional<GroupRoute> g = GroupFor(r.head, call)) return ComputeInGroup(*g, r, call);
    return ComputeInto(HeadKey(r.head), r, call);
  }
  if (!r.accumulator.empty()) return ComputeInto(AccumulatorKey(r.accumulator), r, call);
  return ComputeStateless(r.weight_handle.empty() ? RankKey(pool_->options().rank)
                                                   : WeightsKey(r.weight_handle),
                          r, call);
}

absl::StatusOr<ComputeResult> PooledClient::ComputeStateless(const std::string& key,
                                                             const ComputeRequest& r,
                                                             const CallOptions& call) {
  // Nothing on the server changes: sending it again where the key moves adds nothing twice.
  // Weights first try where their handle is; a rank follows its order (it holds nothing, so
  // it goes back to its home as soon as that is up again).
  std::vector<std::string> candidates = pool_->Order(key);
  if (!r.weight_handle.empty()) {
    absl::StatusOr<Placement> home = Route(key, false);
    if (!home.ok()) return home.status();
    candidates.erase(std::remove(candidates.begin(), candidates.end(), home->endpoint),
                     candidates.end());
    candidates.insert(candidates.begin(), home->endpoint);
  }
  absl::Status last;
  std::string reason;
  for (const std::string& e : candidates) {
    absl::StatusOr<ComputeResult> res = ComputeOn(e, r, call);
    std::optional<std::string> lost;
    if (!res.ok()) {
      lost = Lost(e, res.status(), "");
      // Unreachable a moment ago, up now (its probe just connected): a replica back from a
      // restart, or a connection that broke. Once more there.
      if (!lost && res.status().code() == absl::StatusCode::kUnavailable) {
        res = ComputeOn(e, r, call);
        if (!res.ok()) lost = Lost(e, res.status(), "");
      }
    }
    if (res.ok()) {
      Place(key, e, res->instance, reason);
      NoteTicket(*res, e);
      return res;
    }
    if (!lost) return res.status();
    last = res.status();
    reason = absl::StrCat("replica ", e, " ", *lost);
  }
  return last;
}

absl::StatusOr<ComputeResult> PooledClient::ComputeInto(const std::string& key,
                                                        const ComputeRequest& r,
                                                        const CallOptions& call) {
  const bool acc = r.head.empty();
  for (int moves = 0;; ++moves) {
    absl::StatusOr<Placement> p = acc ? Route(key, true) : HeadRoute(r.head, true, call);
    if (!p.ok()) return p.status();
    if (acc) Track(key, +1, false);
    absl::StatusOr<ComputeResult> res = ComputeOn(p->endpoint, r, call, p->instance);
    if (res.ok()) {
      Place(key, p->endpoint, res->instance, "", /*keep_lost=*/true);
      if (acc) Track(key, -1, true);
      NoteTicket(*res, p->endpoint);  // a head's forward that keeps
      return res;
    }
    std::optional<std::string> lost = Lost(p->endpoint, res.status(), p->instance);
    // An accumulator that holds nothing loses nothing: this Compute goes on to its next
    // replica (at most once per replica).
    const bool quiet = lost && acc && moves < 3 && MoveIfEmpty(key, p->endpoint);
    if (acc) Track(key, -1, false);
    if (!lost && acc && res.status().code() == absl::StatusCode::kUnavailable) {
      // The replica is up, but this call was cut off: it may have been added or not, and a
      // sum that may hold a micro-batch twice or not at all must not be fetched.
      return MarkLost(key, *p, absl::StrCat(
          "accumulator '", r.accumulator, "' on replica ", p->endpoint, ": a Compute into it "
          "was cut off (", res.status().ToString(), ") and may or may not have been added. "
          "Redo the step: DropAccumulator('", r.accumulator, "'), then compute every "
          "micro-batch of the step again"));
    }
    if (!lost) return res.status();
    if (quiet) {
      // That replica's client must forget the sum's instance: a replica restarted in place
      // is the next one, and would refuse a Compute naming the instance it lost.
      CallOptions quick = call;
      quick.deadline = pool_->options().probe_deadline;
      (void)pool_->Client(p->endpoint)->DropAccumulator(r.accumulator, quick);
      // A backward's ticket went with that replica: the accumulator moves, the backward not.
      if (!r.ticket.empty()) return TicketGone(r.ticket, p->endpoint, *lost);
      continue;
    }
    if (!acc) return MarkLost(key, *p, HeadLostMessage(r.head, *p, *lost));
    return MarkLost(key, *p,
                    AccumulatorLostMessage(r.accumulator, p->endpoint, *lost,
                                           NextAfterLoss(key, *p)));
  }
}

void PooledClient::Track(const std::string& key, int delta, bool filled) {
  absl::MutexLock lock(&mu_);
  auto it = placed_.find(key);
  if (it == placed_.end()) {
    if (delta < 0) return;  // dropped meanwhile
    it = placed_.emplace(key, Placement{}).first;
  }
  it->second.in_flight = std::max(0, it->second.in_flight + delta);
  if (filled) it->second.empty = false;
}

bool PooledClient::MoveIfEmpty(const std::string& key, const std::string& endpoint) {
  absl::MutexLock lock(&mu_);
  auto it = placed_.find(key);
  if (it == placed_.end()) return false;
  Placement& q = it->second;
  if (!q.empty || q.in_flight != 1 || q.lost) return false;
  if (!q.endpoint.empty()) q.previous = q.endpoint;
  q.excluded.insert(endpoint);
  q.endpoint.clear();
  q.instance.clear();
  return true;
}

// --- Accumulators ---

absl::StatusOr<FetchGradientsResult> PooledClient::FetchGradients(const std::string& acc,
                                                                  bool reset,
                                                                  const CallOptions& call) {
  const std::string key = AccumulatorKey(acc);
  absl::StatusOr<Placement> p = Route(key, true);
  if (!p.ok()) return p.status();
  absl::StatusOr<FetchGradientsResult> res =
      pool_->Client(p->endpoint)->FetchGradients(acc, reset, call);
  if (res.ok()) {
    Place(key, p->endpoint, res->instance, "", /*keep_lost=*/true);
    if (reset) {
      absl::MutexLock lock(&mu_);
      placed_[key].empty = true;
    }
    return res;
  }
  if (p->instance.empty()) return res.status();  // never computed into through this pool
  std::optional<std::string> lost = Lost(p->endpoint, res.status(), p->instance);
  if (!lost) return res.status();
  return MarkLost(key, *p,
                  AccumulatorLostMessage(acc, p->endpoint, *lost, NextAfterLoss(key, *p)));
}

absl::Status PooledClient::DropAccumulator(const std::string& acc, const CallOptions& call) {
  const std::string key = AccumulatorKey(acc);
  Placement p;
  {
    absl::MutexLock lock(&mu_);
    auto it = placed_.find(key);
    if (it != placed_.end()) p = it->second;
  }
  const std::string endpoint = !p.endpoint.empty() ? p.endpoint
                               : p.lost           ? p.previous
                                                  : pool_->Order(key).front();
  // Also makes that replica's client forget the sum's instance, so that a redo on a replica
  // restarted in place is not refused as the old sum's.
  CallOptions quick = call;
  if (p.lost) quick.deadline = pool_->options().probe_deadline;
  absl::Status s = pool_->Client(endpoint)->DropAccumulator(acc, quick);
  {
    absl::MutexLock lock(&mu_);
    if (p.lost) {
      Placement& q = placed_[key];
      q.lost = false;  // heard: the redo places it anew (a move when it lands elsewhere)
      q.why.clear();
      q.empty = true;
    } else {
      placed_.erase(key);
    }
  }
  return p.lost ? absl::OkStatus() : s;
}

}  // namespace client
}  // namespace lossd
