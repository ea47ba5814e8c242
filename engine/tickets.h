// SPDX-License-Identifier: Apache-2.0
// Two-phase log-prob tickets: what a LOSS_KIND_LOGPROB forward with keep_ms > 0 keeps on the
// server for its backward (X, the targets, the weight, the loss-shaping options, the owner),
// within a byte budget and a count, until a TTL. A backward that succeeds consumes its ticket;
// one that fails leaves it for a retry. Knows nothing of gRPC; never computes.
//
// Where the bytes live: X and the targets stay in the request's host buffers (pinned where the
// backend has pinned memory), because every backend reads LossProblem::x from host memory; an
// inline W and bias are copied into backend memory once; a weight handle's or a head's weight is
// shared, not copied (the ticket holds a reference, as a running call does).
#ifndef LOSSD_ENGINE_TICKETS_H_
#define LOSSD_ENGINE_TICKETS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/loss_problem.h"
#include "engine/heads.h"
#include "engine/host_buffer.h"
#include "engine/owner.h"
#include "engine/recent_keys.h"
#include "engine/weight_cache.h"

namespace lossd {

// One kept forward. Immutable once stored, but for last_used_ns.
struct Ticket {
  std::string id;     // "t-<instance>-<n>"
  std::string owner;  // the forward's principal (owner.h)
  int64_t bt = 0, h = 0, v = 0;
  DType dtype = DType::kBF16;
  DType target_dtype = DType::kI64;
  bool has_bias = false;
  // The forward's options: temperature, softcap, ignore_index and chunk_rows shape the
  // backward (a different value is refused); the rest are the kind's defaults.
  LossOptions options;
  HostBuffer x;        // (BT, H) dtype, host
  HostBuffer targets;  // (BT) target_dtype, host
  // The weight: a handle's entry, or an own backend copy of inline W; null for a head's.
  std::shared_ptr<const WeightEntry> weights;
  std::string weight_handle;  // the handle it came from ("" otherwise), for messages
  // A head's ticket: the head (not kept alive by the ticket: a dropped head's gigabytes are
  // freed at once, and its tickets' backwards are NOT_FOUND) and the version computed against;
  // the weight is the head's compute copy, as long as the head stays at that version.
  std::weak_ptr<Head> head;
  std::string head_name;
  uint64_t head_version = 0;
  uint64_t bytes = 0;       // what it holds against --ticket_bytes (a shared weight: 0 of it)
  int64_t expires_ns = 0;   // since the epoch
  mutable std::atomic<int64_t> last_used_ns{0};
};

// The bytes a ticket of this shape holds: X, the targets and, when `own_weights`, W and bias.
uint64_t TicketBytes(int64_t bt, int64_t h, int64_t v, DType dtype, DType target_dtype,
                     bool own_weights, bool has_bias);

class TicketStore {
 public:
  struct Options {
    std::string instance;                  // this server's, in every ticket id
    uint64_t budget_bytes = 4ull << 30;    // --ticket_bytes
    size_t max_tickets = 256;              // --max_tickets
    int64_t max_keep_ms = 10 * 60 * 1000;  // --ticket_max_ms: the longest TTL granted
    std::function<int64_t()> now_ns;       // the clock (tests inject one); null = NowNs
  };
  explicit TicketStore(Options options);

  // A reservation of a ticket's bytes and one slot of the count, taken before the forward
  // computes (so a full store refuses before the work is done) and given back unless
  // Insert turns it into a ticket.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept;
    Reservation& operator=(Reservation&& o) noexcept;
    ~Reservation();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class TicketStore;
    TicketStore* store_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // RESOURCE_EXHAUSTED when `bytes` can never fit (more than --ticket_bytes, or tickets off).
  absl::Status CheckFits(uint64_t bytes) const;
  // Frees the expired tickets, then reserves `bytes` and a slot. RESOURCE_EXHAUSTED naming
  // the live count and bytes and both limits when they are full.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes);
  // Stores `t` (its bytes as reserved) with a TTL of min(keep_ms, max_keep_ms); sets its id
  // and expiry and returns the stored ticket.
  std::shared_ptr<const Ticket> Insert(std::unique_ptr<Ticket> t, Reservation r,
                                       uint32_t keep_ms);

  // The ticket named `id` for a backward by `caller`: NOT_FOUND when it is unknown, expired or
  // consumed (the message says which where known, and to resend X as a one-phase call),
  // FAILED_PRECONDITION when another server instance issued it, PERMISSION_DENIED when
  // another principal owns it. Frees expired tickets first.
  absl::StatusOr<std::shared_ptr<const Ticket>> Get(const std::string& id,
                                                    const std::string& caller);
  // A backward runs: claims the ticket so that a second backward of it waits its turn
  // (FAILED_PRECONDITION while one runs) and checks it is still held and unexpired (Get's
  // NOT_FOUND otherwise). Then exactly one of Consume (success) or Release (failure).
  absl::Status Claim(const Ticket& t);
  void Consume(const Ticket& t);
  void Release(const Ticket& t);

  // The tickets `caller` owns (all for ""), for List.
  std::vector<StateInfo> List(const std::string& caller);
  // Live tickets and their bytes (expired ones are freed first), and how many expired.
  size_t count();
  uint64_t bytes();
  uint64_t expired() const { return expired_total_.load(); }
  const Options& options() const { return options_; }

 private:
  enum class Ended : uint8_t { kConsumed, kExpired };
  int64_t Now() const;
  void SweepLocked(int64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status GoneLocked(const std::string& id) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unreserve(uint64_t bytes);

  struct Slot {
    std::shared_ptr<const Ticket> ticket;
    bool claimed = false;
  };
  const Options options_;
  const std::string prefix_;  // "t-<instance>-"
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Slot> map_ ABSL_GUARDED_BY(mu_);
  RecentKeys<Ended> ended_ ABSL_GUARDED_BY(mu_){4096};
  uint64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // stored tickets' and reservations'
  size_t held_count_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::atomic<uint64_t> expired_total_{0};
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_TICKETS_H_
