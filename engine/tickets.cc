// SPDX-License-Identifier: Apache-2.0
#include "engine/tickets.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "engine/instance_id.h"

namespace lossd {
namespace {

constexpr char kResend[] =
    "; resend X as a one-phase logprob call with dlogp/dentropy";

// The instance part of an id written "t-<instance>-<n>", or empty when it has not that form.
absl::string_view TicketInstance(absl::string_view id) {
  if (!absl::ConsumePrefix(&id, "t-")) return {};
  const size_t dash = id.find('-');
  if (dash == absl::string_view::npos) return {};
  const absl::string_view inst = id.substr(0, dash);
  uint64_t n = 0;
  if (!IsInstanceId(inst) || !absl::SimpleAtoi(id.substr(dash + 1), &n) || n == 0) return {};
  return inst;
}

}  // namespace

uint64_t TicketBytes(int64_t bt, int64_t h, int64_t v, DType dtype, DType target_dtype,
                     bool own_weights, bool has_bias) {
  const uint64_t es = DTypeSize(dtype);
  uint64_t b = static_cast<uint64_t>(bt) * h * es + static_cast<uint64_t>(bt) *
                                                        DTypeSize(target_dtype);
  if (own_weights) b += static_cast<uint64_t>(v) * h * es + (has_bias ? v * es : 0);
  return b;
}

TicketStore::TicketStore(Options options)
    : options_(std::move(options)), prefix_(absl::StrCat("t-", options_.instance, "-")) {}

int64_t TicketStore::Now() const { return options_.now_ns ? options_.now_ns() : NowNs(); }

TicketStore::Reservation::Reservation(Reservation&& o) noexcept
    : store_(std::exchange(o.store_, nullptr)), bytes_(o.bytes_) {}

TicketStore::Reservation& TicketStore::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    if (store_ != nullptr) store_->Unreserve(bytes_);
    store_ = std::exchange(o.store_, nullptr);
    bytes_ = o.bytes_;
  }
  return *this;
}

TicketStore::Reservation::~Reservation() {
  if (store_ != nullptr) store_->Unreserve(bytes_);
}

void TicketStore::Unreserve(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  held_bytes_ -= bytes;
  --held_count_;
}

absl::Status TicketStore::CheckFits(uint64_t bytes) const {
  if (options_.max_tickets == 0 || bytes > options_.budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a ticket for this forward holds ", bytes, " bytes; this server keeps at most ",
        options_.budget_bytes, " bytes in ", options_.max_tickets,
        " tickets (--ticket_bytes, --max_tickets): send it as a one-phase call with "
        "dlogp/dentropy"));
  }
  return absl::OkStatus();
}

void TicketStore::SweepLocked(int64_t now) {
  for (auto it = map_.begin(); it != map_.end();) {
    const Ticket& t = *it->second.ticket;
    // A claimed ticket is a backward in progress: it outlives its TTL until that ends.
    if (it->second.claimed || t.expires_ns > now) {
      ++it;
      continue;
    }
    held_bytes_ -= t.bytes;
    --held_count_;
    ended_.Remember(it->first, Ended::kExpired);
    expired_total_.fetch_add(1);
    map_.erase(it++);
  }
}

absl::StatusOr<TicketStore::Reservation> TicketStore::Reserve(uint64_t bytes) {
  if (absl::Status s = CheckFits(bytes); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  SweepLocked(Now());
  if (held_count_ >= options_.max_tickets || held_bytes_ + bytes > options_.budget_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the ticket store is full: ", held_count_, " tickets hold ", held_bytes_,
        " bytes, and this forward's ticket needs ", bytes, " more (--ticket_bytes=",
        options_.budget_bytes, ", --max_tickets=", options_.max_tickets,
        "); run the backwards of the tickets held, let them expire, or send this as a "
        "one-phase call with dlogp/dentropy"));
  }
  held_bytes_ += bytes;
  ++held_count_;
  Reservation r;
  r.store_ = this;
  r.bytes_ = bytes;
  return r;
}

std::shared_ptr<const Ticket> TicketStore::Insert(std::unique_ptr<Ticket> t, Reservation r,
                                                  uint32_t keep_ms) {
  const int64_t ttl_ms = std::min<int64_t>(keep_ms, options_.max_keep_ms);
  absl::MutexLock lock(&mu_);
  const int64_t now = Now();
  t->id = absl::StrCat(prefix_, next_id_++);
  t->bytes = r.bytes_;
  t->expires_ns = now + ttl_ms * 1000000;
  t->last_used_ns.store(now);
  // The reservation's bytes and slot become the ticket's.
  r.store_ = nullptr;
  std::shared_ptr<const Ticket> stored(std::move(t));
  map_[stored->id] = Slot{stored, false};
  return stored;
}

absl::Status TicketStore::GoneLocked(const std::string& id) const {
  if (const Ended* e = ended_.Find(id); e != nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "ticket '", id, "' ", *e == Ended::kConsumed ? "was consumed by its backward"
                                                     : "expired (its keep_ms passed)",
        kResend));
  }
  const absl::string_view inst = TicketInstance(id);
  if (!inst.empty() && inst != options_.instance) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ticket '", id, "' was issued by server instance '", inst, "', not this one ('",
        options_.instance, "'): another replica, or this server before a restart; send the "
        "backward to the replica that ran the forward, or resend X as a one-phase logprob "
        "call with dlogp/dentropy"));
  }
  return absl::NotFoundError(absl::StrCat(
      "ticket '", id, "' is not held here (unknown, or expired or consumed longer ago than "
      "this server remembers)", kResend));
}

absl::StatusOr<std::shared_ptr<const Ticket>> TicketStore::Get(const std::string& id,
                                                               const std::string& caller) {
  absl::MutexLock lock(&mu_);
  const int64_t now = Now();
  SweepLocked(now);
  auto it = map_.find(id);
  if (it == map_.end()) return GoneLocked(id);
  const Ticket& t = *it->second.ticket;
  if (absl::Status s = CheckOwner(t.owner, caller, absl::StrCat("ticket '", id, "'"));
      !s.ok()) {
    return s;
  }
  t.last_used_ns.store(now);
  return it->second.ticket;
}

absl::Status TicketStore::Claim(const Ticket& t) {
  absl::MutexLock lock(&mu_);
  SweepLocked(Now());
  auto it = map_.find(t.id);
  if (it == map_.end() || it->second.ticket.get() != &t) return GoneLocked(t.id);
  if (it->second.claimed) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ticket '", t.id, "' is in use by another backward call; a ticket has one backward"));
  }
  it->second.claimed = true;
  return absl::OkStatus();
}

void TicketStore::Consume(const Ticket& t) {
  absl::MutexLock lock(&mu_);
  auto it = map_.find(t.id);
  if (it == map_.end() || it->second.ticket.get() != &t) return;
  held_bytes_ -= t.bytes;
  --held_count_;
  ended_.Remember(t.id, Ended::kConsumed);
  map_.erase(it);
}

void TicketStore::Release(const Ticket& t) {
  absl::MutexLock lock(&mu_);
  auto it = map_.find(t.id);
  if (it != map_.end() && it->second.ticket.get() == &t) it->second.claimed = false;
}

std::vector<StateInfo> TicketStore::List(const std::string& caller) {
  absl::MutexLock lock(&mu_);
  SweepLocked(Now());
  std::vector<StateInfo> out;
  for (const auto& [id, slot] : map_) {
    if (!OwnerAllows(slot.ticket->owner, caller)) continue;
    StateInfo s;
    s.kind = StateInfo::Kind::kTicket;
    s.name = id;
    s.bytes = slot.ticket->bytes;
    s.last_used_ns = slot.ticket->last_used_ns.load();
    out.push_back(std::move(s));
  }
  return out;
}

size_t TicketStore::count() {
  absl::MutexLock lock(&mu_);
  SweepLocked(Now());
  return map_.size();
}

uint64_t TicketStore::bytes() {
  absl::MutexLock lock(&mu_);
  SweepLocked(Now());
  uint64_t b = 0;
  for (const auto& [id, slot] : map_) b += slot.ticket->bytes;
  return b;
}

}  // namespace lossd
