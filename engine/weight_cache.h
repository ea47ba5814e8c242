// SPDX-License-Identifier: Apache-2.0
// Weights uploaded once and referenced by handle: held in backend memory within a byte
// budget, least recently used evicted first. Knows nothing of gRPC.
// An entry in use by a running request stays alive (shared ownership) even when evicted, so
// a request never sees its weights change or vanish under it; an evicted handle is never
// served again. Its bytes stay charged to the budget until its memory is freed, so the
// backend never holds more weight memory than the budget. The last kRetiredKept evicted or
// dropped handles are remembered, to say which happened; older ones are known as this
// instance's only by their number.
#ifndef LOSSD_ENGINE_WEIGHT_CACHE_H_
#define LOSSD_ENGINE_WEIGHT_CACHE_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "engine/owner.h"
#include "engine/recent_keys.h"

namespace lossd {

struct WeightEntry {
  DType dtype = DType::kBF16;
  int64_t v = 0;
  int64_t h = 0;
  std::unique_ptr<BackendBuffer> w;     // (V, H) dtype, backend memory
  std::unique_ptr<BackendBuffer> bias;  // (V) dtype, or null
  std::string owner;  // the principal that uploaded it (owner.h); "" = anyone's
  // Set by Insert and every Get, for List and the idle TTL.
  mutable std::atomic<int64_t> last_used_ns{0};
  uint64_t bytes() const {
    return (w ? w->size() : 0) + (bias ? bias->size() : 0);
  }
};

class WeightCache {
 public:
  WeightCache(uint64_t budget_bytes, std::string instance, size_t max_entries = 1024);

  // How many evicted or dropped handles keep their reason (a long-running server retires
  // handles without end; this bounds what it remembers of them).
  static constexpr size_t kRetiredKept = 4096;

  // Makes room for an upload of `bytes` and holds it until Insert or Unreserve, evicting
  // least recently used first among the entries no running request holds (evicting one in
  // use frees nothing until the request ends). RESOURCE_EXHAUSTED, evicting nothing, when it
  // does not fit even once all of those are evicted: uploads in progress and memory that
  // running requests hold leave no room.
  absl::Status Reserve(uint64_t bytes);
  void Unreserve(uint64_t bytes);

  // Adds a complete upload made under a reservation of entry->bytes(); returns its handle.
  // The caller hands over its last reference: the entry's bytes are given back to the budget
  // when the cache and the requests that Get it have all let go.
  std::string Insert(std::shared_ptr<const WeightEntry> entry);

  // NOT_FOUND (saying whether it was evicted, dropped or is from another server instance).
  absl::StatusOr<std::shared_ptr<const WeightEntry>> Get(const std::string& handle);
  // Forgets the handle at once; the memory is freed, and its bytes come back to the budget,
  // when the last running request that holds it lets go. PERMISSION_DENIED, dropping
  // nothing, when `caller` does not own it (owner.h).
  absl::Status Drop(const std::string& handle, const std::string& caller = "");
  // The handles `caller` owns (all of them for "": no auth), for List.
  std::vector<StateInfo> List(const std::string& caller) const;
  // Drops every handle last used before `before_ns`, whoever owns it; returns a line for
  // each, for the log.
  std::vector<std::string> DropIdle(int64_t before_ns);

  uint64_t budget() const { return budget_; }
  // Bytes of weight memory held now, what --weight_cache_bytes limits besides uploads in
  // progress: every cached entry's, plus those of evicted or dropped entries that running
  // requests still hold.
  uint64_t bytes() const;
  // Handles served now (what --max_weight_handles limits; evicted or dropped ones not
  // included).
  size_t count() const;
  uint64_t hits() const;
  uint64_t misses() const;
  uint64_t evictions() const;

 private:
  struct Slot {
    std::shared_ptr<const WeightEntry> entry;
    std::list<std::string>::iterator lru;  // position in lru_, front = most recent
  };
  absl::Status EvictForLocked(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts the entry at `pos` in lru_ and returns the position after it; its handle is
  // remembered as evicted.
  std::list<std::string>::iterator EvictLocked(std::list<std::string>::iterator pos)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  enum class Retired : uint8_t { kEvicted, kDropped };
  // Whether this instance issued `handle` (by its number, whether still held or not).
  bool IssuedLocked(const std::string& handle) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint64_t budget_;
  const std::string instance_;
  const std::string prefix_;  // "w-<instance>-": every handle this cache issues starts so
  const size_t max_entries_;
  // Bytes of every entry alive, cached or evicted or dropped but still held: added by Insert
  // (under mu_, after the reservation that admitted it), subtracted by the entry's deleter
  // after its memory is freed. Shared with the deleters, since a request may let go after the
  // cache is gone.
  const std::shared_ptr<std::atomic<uint64_t>> held_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);
  // Why the last kRetiredKept handles that left did so.
  RecentKeys<Retired> retired_ ABSL_GUARDED_BY(mu_){kRetiredKept};
  uint64_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of the entries in slots_
  uint64_t reserved_ ABSL_GUARDED_BY(mu_) = 0;      // uploads in progress
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t misses_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_WEIGHT_CACHE_H_
