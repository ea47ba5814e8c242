#include "server/engine/accumulators.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {

absl::Status ValidateAccumulatorName(const std::string& name, absl::string_view field) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be 1 to 128 characters long, got ", name.size()));
  }
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-' || c == ':' || c == '/';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " '", name, "' has a character outside [A-Za-z0-9._:/-]"));
    }
  }
  return absl::OkStatus();
}

AccumulatorStore::AccumulatorStore(Backend* backend, uint64_t budget_bytes, size_t max_count)
    : backend_(backend), budget_(budget_bytes), max_count_(max_count) {}

absl::Status AccumulatorStore::CheckLocked(const std::string& name, int64_t v, int64_t h,
                                           bool has_bias) const {
  auto it = map_.find(name);
  if (it != map_.end()) {
    const Accumulator& a = *it->second;
    if (a.v != v || a.h != h || a.has_bias != has_bias) {
      return absl::InvalidArgumentError(absl::StrCat(
          "accumulator '", name, "' holds dW of shape (V=", a.v, ", H=", a.h, ")",
          a.has_bias ? " with db" : " without db", " but this request has (V=", v, ", H=", h,
          ")", has_bias ? " with a bias" : " without a bias"));
    }
    return absl::OkStatus();
  }
  const uint64_t bytes = static_cast<uint64_t>(v) * h * 4 + (has_bias ? v * 4 : 0);
  if (map_.size() >= max_count_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot create accumulator '", name, "': ", map_.size(),
        " accumulators exist (--max_accumulators=", max_count_,
        "); fetch with reset or drop finished ones"));
  }
  if (bytes_ + bytes > budget_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot create accumulator '", name, "' of ", bytes, " bytes: ", bytes_, " of ",
        budget_, " bytes (--accumulator_bytes) are in use"));
  }
  return absl::OkStatus();
}

absl::Status AccumulatorStore::Check(const std::string& name, int64_t v, int64_t h,
                                     bool has_bias) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(name, v, h, has_bias);
}

absl::StatusOr<std::shared_ptr<Accumulator>> AccumulatorStore::GetOrCreate(
    const std::string& name, int64_t v, int64_t h, bool has_bias) {
  absl::MutexLock lock(&mu_);
  absl::Status checked = CheckLocked(name, v, h, has_bias);
  if (!checked.ok()) return checked;
  auto it = map_.find(name);
  if (it != map_.end()) return it->second;
  const uint64_t bytes = static_cast<uint64_t>(v) * h * 4 + (has_bias ? v * 4 : 0);
  auto acc = std::make_shared<Accumulator>();
  acc->name = name;
  acc->v = v;
  acc->h = h;
  acc->has_bias = has_bias;
  auto dw = backend_->Allocate(static_cast<uint64_t>(v) * h * 4);
  if (!dw.ok()) return dw.status();
  acc->dw = std::move(*dw);
  absl::Status s = backend_->Zero(*acc->dw);
  if (!s.ok()) return s;
  if (has_bias) {
    auto db = backend_->Allocate(static_cast<uint64_t>(v) * 4);
    if (!db.ok()) return db.status();
    acc->db = std::move(*db);
    s = backend_->Zero(*acc->db);
    if (!s.ok()) return s;
  }
  bytes_ += bytes;
  map_[name] = acc;
  return acc;
}

absl::StatusOr<std::shared_ptr<Accumulator>> AccumulatorStore::Get(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = map_.find(name);
  if (it == map_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "accumulator '", name, "' not found: no Compute has added to it on this server "
        "instance, or it was dropped"));
  }
  return it->second;
}

absl::Status AccumulatorStore::Drop(const std::string& name) {
  std::shared_ptr<Accumulator> dropped;
  {
    absl::MutexLock lock(&mu_);
    auto it = map_.find(name);
    if (it == map_.end()) {
      return absl::NotFoundError(absl::StrCat("accumulator '", name, "' not found"));
    }
    const Accumulator& a = *it->second;
    bytes_ -= static_cast<uint64_t>(a.v) * a.h * 4 + (a.has_bias ? a.v * 4 : 0);
    dropped = std::move(it->second);
    map_.erase(it);
  }
  // Its memory (GiBs of device or host memory) is given back here, outside the lock, so that
  // other clients' lookups do not wait for the free.
  dropped.reset();
  return absl::OkStatus();
}

size_t AccumulatorStore::count() const {
  absl::MutexLock lock(&mu_);
  return map_.size();
}

uint64_t AccumulatorStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

}  // namespace lossd
