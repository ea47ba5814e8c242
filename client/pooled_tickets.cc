// SPDX-License-Identifier: Apache-2.0
// PooledClient: two-phase log-prob tickets. A ticket lives on the replica whose forward took
// it, so its backward goes there and nowhere else (another replica would answer NOT_FOUND,
// having never held it). The pool remembers each ticket's replica until the expiry the server
// gave, for at most PoolOptions::tickets_kept tickets. What it cannot route (a ticket it does
// not know, or whose replica is gone) is NOT_FOUND before or instead of sending, as a server
// answers for a ticket it does not hold: the caller then sends the one-phase call, which the
// pool routes as any other. The same rules as the Python pool (lossd/_pool_tickets.py).
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/compute_call.h"
#include "client/pooled_client.h"
#include "client/rendezvous.h"

namespace lossd {
namespace client {
namespace {

// An error the pool made itself: it says nothing of a replica (ReplicaPool::LostReason).
absl::Status Local(absl::Status s) {
  s.SetPayload(kLocalErrorPayload, absl::Cord("1"));
  return s;
}

constexpr char kOnePhase[] = "send the one-phase call (X with dlogp/dentropy)";

}  // namespace

void PooledClient::NoteTicket(const ComputeResult& res, const std::string& endpoint) {
  if (res.ticket.empty()) return;
  TicketHome home{endpoint, res.instance, res.ticket_expires_unix_ms};
  // No expiry given: kept until the cap forgets it, after every ticket that has one.
  const int64_t order = home.expires_unix_ms > 0 ? home.expires_unix_ms
                                                 : std::numeric_limits<int64_t>::max();
  const int64_t now_ms = absl::ToUnixMillis(pool_->Now());
  absl::MutexLock lock(&mu_);
  auto old = tickets_.find(res.ticket);
  if (old != tickets_.end()) {  // a server never issues one id twice; a restarted one might
    const int64_t was = old->second.expires_unix_ms;
    ticket_expiry_.erase({was > 0 ? was : std::numeric_limits<int64_t>::max(), res.ticket});
  }
  tickets_[res.ticket] = std::move(home);
  ticket_expiry_.insert({order, res.ticket});
  DropExpiredTicketsLocked(now_ms);
  // Past the cap, the ticket that expires first goes: the likeliest to be of no use.
  while (tickets_.size() > pool_->options().tickets_kept) {
    tickets_.erase(ticket_expiry_.begin()->second);
    ticket_expiry_.erase(ticket_expiry_.begin());
  }
}

void PooledClient::DropExpiredTicketsLocked(int64_t now_ms) {
  while (!ticket_expiry_.empty() && ticket_expiry_.begin()->first <= now_ms) {
    tickets_.erase(ticket_expiry_.begin()->second);
    ticket_expiry_.erase(ticket_expiry_.begin());
  }
}

void PooledClient::ForgetTicket(const std::string& ticket) {
  absl::MutexLock lock(&mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return;
  const int64_t was = it->second.expires_unix_ms;
  ticket_expiry_.erase({was > 0 ? was : std::numeric_limits<int64_t>::max(), ticket});
  tickets_.erase(it);
}

std::string PooledClient::ReplicaOfTicket(const std::string& ticket) {
  const int64_t now_ms = absl::ToUnixMillis(pool_->Now());
  absl::MutexLock lock(&mu_);
  DropExpiredTicketsLocked(now_ms);
  auto it = tickets_.find(ticket);
  return it == tickets_.end() ? "" : it->second.endpoint;
}

size_t PooledClient::TicketsRemembered() {
  const int64_t now_ms = absl::ToUnixMillis(pool_->Now());
  absl::MutexLock lock(&mu_);
  DropExpiredTicketsLocked(now_ms);
  return tickets_.size();
}

absl::StatusOr<PooledClient::TicketHome> PooledClient::TicketRoute(const std::string& ticket) {
  const int64_t now_ms = absl::ToUnixMillis(pool_->Now());
  TicketHome home;
  {
    absl::MutexLock lock(&mu_);
    auto it = tickets_.find(ticket);
    if (it != tickets_.end() && it->second.expires_unix_ms > 0 &&
        it->second.expires_unix_ms <= now_ms) {
      const TicketHome gone = it->second;
      DropExpiredTicketsLocked(now_ms);
      return Local(absl::NotFoundError(absl::StrCat(
          "ticket '", ticket, "' (on replica ", gone.endpoint, ") expired at ",
          absl::FormatTime(absl::FromUnixMillis(gone.expires_unix_ms)), ", ",
          absl::FormatDuration(absl::Milliseconds(now_ms - gone.expires_unix_ms)),
          " ago: ", kOnePhase)));
    }
    DropExpiredTicketsLocked(now_ms);
    if (it == tickets_.end()) {
      return Local(absl::NotFoundError(absl::StrCat(
          "ticket '", ticket, "' was not taken through this pool, or is forgotten (it "
          "remembers the replica of the newest ", pool_->options().tickets_kept,
          " unexpired tickets, PoolOptions::tickets_kept): ", kOnePhase)));
    }
    home = it->second;
  }
  if (pool_->IsDown(home.endpoint)) {
    return TicketGone(ticket, home.endpoint, "is unreachable (marked down)");
  }
  return home;
}

absl::Status PooledClient::TicketGone(const std::string& ticket, const std::string& endpoint,
                                      const std::string& reason) {
  ForgetTicket(ticket);
  return Local(absl::NotFoundError(absl::StrCat(
      "ticket '", ticket, "' was held by replica ", endpoint, ", which ", reason,
      ": the ticket went with it, and no other replica holds it; ", kOnePhase)));
}

absl::Status PooledClient::PlaceAccumulatorAtTicket(const ComputeRequest& r,
                                                    const TicketHome& home) {
  const std::string key = AccumulatorKey(r.accumulator);
  std::string at;
  bool passed_over = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = placed_.find(key);
    // A lost accumulator is ComputeInto's to refuse (ABORTED: redo the step).
    if (it != placed_.end() && it->second.lost) return absl::OkStatus();
    if (it != placed_.end()) {
      at = it->second.endpoint;
      passed_over = it->second.excluded.count(home.endpoint) > 0;
    }
  }
  if (at.empty() && passed_over) {  // it lost a sum there before: placed anew elsewhere
    return Local(absl::NotFoundError(absl::StrCat(
        "ticket '", r.ticket, "' lives on replica ", home.endpoint, ", where accumulator '",
        r.accumulator, "' was lost before and is not placed again; ", kOnePhase,
        ", which goes to the accumulator")));
  }
  if (at.empty()) {  // not placed yet: it begins where the ticket is
    Place(key, home.endpoint, home.instance, absl::StrCat("ticket '", r.ticket, "' is there"));
    return absl::OkStatus();
  }
  if (at == home.endpoint) return absl::OkStatus();
  return Local(absl::NotFoundError(absl::StrCat(
      "ticket '", r.ticket, "' lives on replica ", home.endpoint, ", accumulator '",
      r.accumulator, "' on ", at, ": a backward cannot add there; ", kOnePhase,
      ", which goes to the accumulator")));
}

absl::StatusOr<ComputeResult> PooledClient::ComputeTicket(const ComputeRequest& r,
                                                          const CallOptions& call) {
  // A backward malformed on its face is refused by its field, not by where it would go.
  if (absl::Status s = ValidateRequest(r); !s.ok()) return Local(s);
  absl::StatusOr<TicketHome> home = TicketRoute(r.ticket);
  if (!home.ok()) return home.status();
  if (!r.accumulator.empty()) {
    if (absl::Status s = PlaceAccumulatorAtTicket(r, *home); !s.ok()) return s;
    // ComputeInto never sends it elsewhere: a quiet move of an empty accumulator returns
    // TicketGone instead.
    absl::StatusOr<ComputeResult> res = ComputeInto(AccumulatorKey(r.accumulator), r, call);
    if (res.ok() || res.status().code() == absl::StatusCode::kNotFound ||
        pool_->IsDown(home->endpoint)) {
      ForgetTicket(r.ticket);  // consumed, or gone
    }
    return res;
  }
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<ComputeResult> res = pool_->Client(home->endpoint)->Compute(r, call);
    if (res.ok()) {
      ForgetTicket(r.ticket);  // consumed
      return res;
    }
    std::optional<std::string> lost = Lost(home->endpoint, res.status(), home->instance);
    if (lost) return TicketGone(r.ticket, home->endpoint, *lost);
    // Cut off while the replica answers: once more there (a ticket the first call consumed
    // answers NOT_FOUND).
    if (attempt == 0 && res.status().code() == absl::StatusCode::kUnavailable) continue;
    if (res.status().code() == absl::StatusCode::kNotFound) ForgetTicket(r.ticket);
    return res.status();
  }
}

}  // namespace client
}  // namespace lossd
