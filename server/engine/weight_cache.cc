#include "server/engine/weight_cache.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace lossd {

WeightCache::WeightCache(uint64_t budget_bytes, std::string instance, size_t max_entries)
    : budget_(budget_bytes),
      instance_(std::move(instance)),
      prefix_(absl::StrCat("w-", instance_, "-")),
      max_entries_(max_entries) {}

void WeightCache::EvictOldestLocked() {
  const std::string victim = lru_.back();
  lru_.pop_back();
  auto it = slots_.find(victim);
  bytes_ -= it->second.entry->bytes();
  slots_.erase(it);
  retired_.Remember(victim, Retired::kEvicted);
  ++evictions_;
}

bool WeightCache::IssuedLocked(const std::string& handle) const {
  if (!absl::StartsWith(handle, prefix_)) return false;
  const absl::string_view number = absl::string_view(handle).substr(prefix_.size());
  uint64_t id = 0;
  // Only the number as Insert writes it ("w-inst-01" was never issued).
  return absl::SimpleAtoi(number, &id) && id >= 1 && id < next_id_ && absl::StrCat(id) == number;
}

absl::Status WeightCache::EvictForLocked(uint64_t bytes) {
  // Uploads in progress cannot be evicted: when they leave no room, evicting the cached
  // entries would not make any, and the refused upload would take them all down with it.
  if (reserved_ + bytes > budget_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "weights of ", bytes, " bytes do not fit in the weight cache: ", reserved_,
        " of its ", budget_, " bytes (--weight_cache_bytes) are taken by uploads in progress"));
  }
  while (bytes_ + reserved_ + bytes > budget_ && !lru_.empty()) EvictOldestLocked();
  return absl::OkStatus();
}

absl::Status WeightCache::Reserve(uint64_t bytes) {
  if (bytes > budget_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("weights of ", bytes, " bytes exceed the weight cache budget of ",
                     budget_, " bytes (--weight_cache_bytes); send W inline instead"));
  }
  absl::MutexLock lock(&mu_);
  absl::Status s = EvictForLocked(bytes);
  if (!s.ok()) return s;
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
  while (slots_.size() >= max_entries_ && !lru_.empty()) EvictOldestLocked();
  std::string handle = absl::StrCat(prefix_, next_id_++);
  lru_.push_front(handle);
  bytes_ += bytes;
  slots_[handle] = Slot{std::move(entry), lru_.begin()};
  return handle;
}

absl::StatusOr<std::shared_ptr<const WeightEntry>> WeightCache::Get(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(handle);
  if (it != slots_.end()) {
    ++hits_;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
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
  if (absl::StartsWith(handle, "w-") && !absl::StartsWith(handle, prefix_)) {
    return absl::NotFoundError(absl::StrCat(
        "weight handle '", handle, "' belongs to another server instance (this one is '",
        instance_, "'; the server restarted or the call reached another replica); upload the "
        "weights again"));
  }
  return absl::NotFoundError(absl::StrCat("weight handle '", handle, "' not found"));
}

absl::Status WeightCache::Drop(const std::string& handle) {
  absl::MutexLock lock(&mu_);
  auto it = slots_.find(handle);
  if (it == slots_.end()) {
    const Retired* retired = retired_.Find(handle);
    const bool evicted = retired != nullptr && *retired == Retired::kEvicted;
    return absl::NotFoundError(
        absl::StrCat("weight handle '", handle, "' not found", evicted ? " (evicted)" : ""));
  }
  bytes_ -= it->second.entry->bytes();
  lru_.erase(it->second.lru);
  slots_.erase(it);
  retired_.Remember(handle, Retired::kDropped);
  return absl::OkStatus();
}

uint64_t WeightCache::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}
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
