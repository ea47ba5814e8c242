// SPDX-License-Identifier: Apache-2.0
#include "engine/weight_cache.h"

#include <iterator>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/instance_id.h"

namespace lossd {

namespace {

// Frees an entry, then gives its bytes back: frees first, so that the cache never admits an
// upload while this entry's memory is still held. Holds the reference Insert was handed, the
// last one, so freeing it frees the memory.
struct EntryDeleter {
  std::shared_ptr<const WeightEntry> entry;
  std::shared_ptr<std::atomic<uint64_t>> held_bytes;
  uint64_t bytes = 0;
  void operator()(const WeightEntry*) {
    entry.reset();
    held_bytes->fetch_sub(bytes);
  }
};

}  // namespace

WeightCache::WeightCache(uint64_t budget_bytes, std::string instance, size_t max_entries)
    : budget_(budget_bytes),
      instance_(std::move(instance)),
      prefix_(absl::StrCat("w-", instance_, "-")),
      max_entries_(max_entries),
      held_bytes_(std::make_shared<std::atomic<uint64_t>>(0)) {}

std::list<std::string>::iterator WeightCache::EvictLocked(std::list<std::string>::iterator pos) {
  auto it = slots_.find(*pos);
  retired_.Remember(*pos, Retired::kEvicted);
  cached_bytes_ -= it->second.entry->bytes();
  // Frees the memory now unless a running request holds the entry; its bytes stay in
  // held_bytes_ until then.
  slots_.erase(it);
  ++evictions_;
  return lru_.erase(pos);
}

bool WeightCache::IssuedLocked(const std::string& handle) const {
  if (!absl::StartsWith(handle, prefix_)) return false;
  const absl::string_view number = absl::string_view(handle).substr(prefix_.size());
  uint64_t id = 0;
  // Only the number as Insert writes it ("w-inst-01" was never issued).
  return absl::SimpleAtoi(number, &id) && id >= 1 && id < next_id_ && absl::StrCat(id) == number;
}

absl::Status WeightCache::EvictForLocked(uint64_t bytes) {
  // Evicting an entry frees its memory only when the cache's reference is the last one, and
  // an evicted or dropped entry that a running request holds keeps its memory until that
  // request ends. Only Insert (under mu_) adds to held_bytes_, and a new reference is taken
  // only by Get (under mu_) copying the cache's: so under mu_ a use_count() of 1 stays 1, and
  // held_bytes_ and the other counts can only fall, which errs on the side of refusing.
  const uint64_t held = held_bytes_->load();
  uint64_t evictable = 0;  // of the cached entries no request holds
  for (const auto& [handle, slot] : slots_) {
    if (slot.entry.use_count() == 1) evictable += slot.entry->bytes();
  }
  // Memory that no eviction can free now: every entry alive is either cached (counted in
  // `held` since its Insert) or evicted or dropped and held by a request.
  const uint64_t in_use = held - evictable;
  // Neither uploads in progress nor memory in use can be evicted: when they leave no room,
  // evicting the cached entries would not make any, and the refused upload would take them
  // all down with it. An upload that fits only once running requests let go is refused now.
  if (reserved_ + in_use + bytes > budget_) {
    const uint64_t retired = held - cached_bytes_;  // evicted or dropped, still held
    return absl::ResourceExhaustedError(absl::StrCat(
        "weights of ", bytes, " bytes do not fit in the weight cache: ", reserved_,
        " of its ", budget_, " bytes (--weight_cache_bytes) are taken by uploads in progress",
        in_use == 0
            ? std::string()
            : absl::StrCat(
                  ", and ", in_use,
                  " by weights that running requests use (freed or evictable when those "
                  "requests end",
                  retired == 0 ? std::string()
                               : absl::StrCat("; ", retired,
                                              " of those bytes are of handles already evicted "
                                              "or dropped"),
                  ")")));
  }
  // Least recently used first, passing over entries in use: evicting one would free nothing
  // until its request ends and only cost its clients a new upload. By the check above, the
  // entries no request holds make room enough.
  auto pos = lru_.end();
  while (held_bytes_->load() + reserved_ + bytes > budget_ && pos != lru_.begin()) {
    --pos;
    if (slots_.find(*pos)->second.entry.use_count() > 1) continue;
    pos = EvictLocked(pos);  // the position after it, already passed over
  }
  return absl::OkStatus();
}

absl::Status WeightCache::Reserve(uint64_t bytes) {
  if (bytes > budget_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("weights of ", bytes, " bytes exceed the weight cache budget of ",
                     budget_, " bytes (--weight_cache_bytes); send W inline instead"));
  }
  absl::MutexLock lock(&mu_);
  LOSSD_RETURN_IF_ERROR(EvictForLocked(bytes));
  reserved_ += bytes;
  return absl::OkStatus();
}

void WeightCache::Unreserve(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  reserved_ = bytes > reserved_ ? 0 : reserved_ - bytes;
}

std::string WeightCache::Insert(std::shared_ptr<const WeightEntry> entry) {
  absl::MutexLock lock(&mu_);
  const uint64_t bytes = entry->bytes();
  reserved_ = bytes > reserved_ ? 0 : reserved_ - bytes;
  // Over the handle count (--max_weight_handles), the least recently used goes too.
  // Evicting by count frees no room in bytes, so the least recently used goes even when in
  // use; its bytes stay charged until the requests that hold it end.
  while (slots_.size() >= max_entries_ && !lru_.empty()) EvictLocked(std::prev(lru_.end()));
  std::string handle = absl::StrCat(prefix_, next_id_++);
  entry->last_used_ns.store(NowNs());
  lru_.push_front(handle);
  held_bytes_->fetch_add(bytes);
  cached_bytes_ += bytes;
  const WeightEntry* raw = entry.get();
  slots_[handle] = Slot{std::shared_ptr<const WeightEntry>(
                            raw, EntryDeleter{std::move(entry), held_bytes_, bytes}),
                        lru_.begin()};
  return handle;
}

absl::StatusOr<std::shared_ptr<const WeightEntry>> WeightCache::Get(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(handle);
  if (it != slots_.end()) {
    ++hits_;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    it->second.entry->last_used_ns.store(NowNs());
    return it->second.entry;
  }
  ++misses_;
  const Retired* retired = retired_.Find(handle);
  if (retired != nullptr && *retired == Retired::kEvicted) {
    return absl::NotFoundError(absl::StrCat(
        "weight handle '", handle, "' was evicted (least recently used) to make room in the ",
        "weight cache (", budget_, " bytes, --weight_cache_bytes; ", max_entries_,
        " handles, --max_weight_handles); upload the weights again with PutWeights"));
  }
  if (retired != nullptr) {
    return absl::NotFoundError(absl::StrCat("weight handle '", handle, "' was dropped"));
  }
  if (IssuedLocked(handle)) {
    return absl::NotFoundError(absl::StrCat(
        "weight handle '", handle, "' is no longer held (evicted or dropped, longer ago than the ",
        kRetiredKept, " handles whose fate is kept); upload the weights again with PutWeights"));
  }
  // Another instance only when the handle is one another lossd could have issued: a
  // made-up one that merely starts with "w-" is unknown, not a sign of a restart.
  const absl::string_view other = HandleInstance(handle);
  if (!other.empty() && other != instance_) {
    return absl::NotFoundError(absl::StrCat(
        "weight handle '", handle, "' belongs to another server instance (this one is '",
        instance_, "'; the server restarted or the call reached another replica); upload the "
        "weights again"));
  }
  return absl::NotFoundError(absl::StrCat(
      "weight handle '", handle, "' not found: this server never issued it (its handles are '",
      prefix_, "<n>', returned by PutWeights)"));
}

absl::Status WeightCache::Drop(const std::string& handle, const std::string& caller) {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(handle);
  if (it == slots_.end()) {
    const Retired* retired = retired_.Find(handle);
    const bool evicted = retired != nullptr && *retired == Retired::kEvicted;
    return absl::NotFoundError(
        absl::StrCat("weight handle '", handle, "' not found", evicted ? " (evicted)" : ""));
  }
  absl::Status mine = CheckOwner(it->second.entry->owner, caller,
                                 absl::StrCat("weight handle '", handle, "'"));
  if (!mine.ok()) return mine;
  cached_bytes_ -= it->second.entry->bytes();
  lru_.erase(it->second.lru);
  // Frees the memory now unless a running request holds the entry; its bytes stay in
  // held_bytes_ until then.
  slots_.erase(it);
  retired_.Remember(handle, Retired::kDropped);
  return absl::OkStatus();
}

std::vector<StateInfo> WeightCache::List(const std::string& caller) const {
  absl::MutexLock lock(&mu_);
  std::vector<StateInfo> mine;
  for (const auto& [handle, slot] : slots_) {
    if (slot.entry->owner != caller) continue;
    StateInfo s;
    s.kind = StateInfo::Kind::kWeights;
    s.name = handle;
    s.bytes = slot.entry->bytes();
    s.last_used_ns = slot.entry->last_used_ns.load();
    mine.push_back(std::move(s));
  }
  return mine;
}

std::vector<std::string> WeightCache::DropIdle(int64_t before_ns) {
  std::vector<std::string> dropped;
  absl::MutexLock lock(&mu_);
  for (auto it = slots_.begin(); it != slots_.end();) {
    const WeightEntry& e = *it->second.entry;
    const int64_t last = e.last_used_ns.load();
    if (last >= before_ns) {
      ++it;
      continue;
    }
    dropped.push_back(absl::StrCat("weight handle ", it->first, " (", e.bytes(),
                                   " bytes, idle ", (NowNs() - last) / 1000000000, " s)"));
    cached_bytes_ -= e.bytes();
    lru_.erase(it->second.lru);
    retired_.Remember(it->first, Retired::kDropped);
    slots_.erase(it++);
  }
  return dropped;
}

uint64_t WeightCache::bytes() const { return held_bytes_->load(); }
size_t WeightCache::count() const {
  absl::MutexLock lock(&mu_);
  return slots_.size();
}
uint64_t WeightCache::hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}
uint64_t WeightCache::misses() const {
  absl::MutexLock lock(&mu_);
  return misses_;
}
uint64_t WeightCache::evictions() const {
  absl::MutexLock lock(&mu_);
  return evictions_;
}

}  // namespace lossd
