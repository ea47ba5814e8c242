// SPDX-License-Identifier: Apache-2.0
#include "engine/accumulators.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/status_macros.h"

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

void MarkNonFinite(Accumulator& acc, uint32_t bits) {
  if (!acc.nonfinite_by.empty()) return;
  const bool dw = (bits & kNonFiniteDw) != 0, db = (bits & kNonFiniteDb) != 0;
  acc.nonfinite_by = absl::StrCat(
      "micro-batch ", acc.micro_batches, " (a Compute at ",
      absl::FormatTime(absl::RFC3339_sec, absl::Now(), absl::UTCTimeZone()), ") left NaN or Inf in ",
      dw && db ? "dW and db" : (dw ? "dW" : "db"));
}

absl::Status NonFiniteSumStatus(const Accumulator& acc) {
  if (acc.nonfinite_by.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "accumulator '", acc.name, "' holds a non-finite sum: ", acc.nonfinite_by,
      " (an overflow: lower grad_scale or the loss scale); fetch it with reset or drop it, "
      "then redo the step"));
}

namespace {

// dW (V, H) and db (V), fp32.
uint64_t AccumulatorBytes(int64_t v, int64_t h, bool has_bias) {
  return static_cast<uint64_t>(v) * h * 4 + (has_bias ? static_cast<uint64_t>(v) * 4 : 0);
}

// Deletes an accumulator, then gives its bytes back: frees first, so that the store never
// admits a new one while this one's memory is still held.
struct AccumulatorDeleter {
  std::shared_ptr<std::atomic<uint64_t>> held_bytes;
  uint64_t bytes = 0;
  void operator()(Accumulator* a) const {
    delete a;
    held_bytes->fetch_sub(bytes);
  }
};

}  // namespace

AccumulatorStore::AccumulatorStore(Backend* backend, uint64_t budget_bytes, size_t max_count)
    : backend_(backend),
      budget_(budget_bytes),
      max_count_(max_count),
      held_bytes_(std::make_shared<std::atomic<uint64_t>>(0)) {}

absl::Status AccumulatorStore::CheckLocked(const std::string& name, int64_t v, int64_t h,
                                           bool has_bias, const std::string& caller) const {
  auto it = map_.find(name);
  if (it != map_.end()) {
    const Accumulator& a = *it->second;
    absl::Status mine = CheckOwner(a.owner, caller, absl::StrCat("accumulator '", name, "'"));
    if (!mine.ok()) return mine;
    if (a.v != v || a.h != h || a.has_bias != has_bias) {
      return absl::InvalidArgumentError(absl::StrCat(
          "accumulator '", name, "' holds dW of shape (V=", a.v, ", H=", a.h, ")",
          a.has_bias ? " with db" : " without db", " but this request has (V=", v, ", H=", h,
          ")", has_bias ? " with a bias" : " without a bias"));
    }
    return absl::OkStatus();
  }
  const uint64_t bytes = AccumulatorBytes(v, h, has_bias);
  if (map_.size() >= max_count_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot create accumulator '", name, "': ", map_.size(),
        " accumulators exist (--max_accumulators=", max_count_,
        "); fetch with reset or drop finished ones"));
  }
  // Only a creation (under mu_) adds to held_bytes_; a deleter running meanwhile only
  // lowers it, so this check errs on the side of refusing.
  const uint64_t held = held_bytes_->load();
  if (held + bytes > budget_) {
    // Every named accumulator is in `held` (the map keeps it alive); the rest are dropped.
    const uint64_t dropped = held > named_bytes_ ? held - named_bytes_ : 0;
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot create accumulator '", name, "' of ", bytes, " bytes: ", held, " of ", budget_,
        " bytes (--accumulator_bytes) are in use",
        dropped > 0 ? absl::StrCat(", ", dropped,
                                   " of them by dropped accumulators that running calls still "
                                   "hold (freed when those calls end)")
                    : std::string()));
  }
  return absl::OkStatus();
}

absl::Status AccumulatorStore::Check(const std::string& name, int64_t v, int64_t h,
                                     bool has_bias, const std::string& caller) const {
  absl::MutexLock lock(&mu_);
  return CheckLocked(name, v, h, has_bias, caller);
}

absl::StatusOr<std::shared_ptr<Accumulator>> AccumulatorStore::GetOrCreate(
    const std::string& name, int64_t v, int64_t h, bool has_bias, const std::string& caller) {
  absl::MutexLock lock(&mu_);
  absl::Status checked = CheckLocked(name, v, h, has_bias, caller);
  if (!checked.ok()) return checked;
  auto it = map_.find(name);
  if (it != map_.end()) {
    it->second->last_used_ns.store(NowNs());
    return it->second;
  }
  const uint64_t bytes = AccumulatorBytes(v, h, has_bias);
  auto acc = std::make_unique<Accumulator>();
  acc->name = name;
  acc->v = v;
  acc->h = h;
  acc->has_bias = has_bias;
  acc->owner = caller;
  acc->last_used_ns.store(NowNs());
  LOSSD_ASSIGN_OR_RETURN(acc->dw, backend_->Allocate(static_cast<uint64_t>(v) * h * 4));
  LOSSD_RETURN_IF_ERROR(backend_->Zero(*acc->dw));
  if (has_bias) {
    LOSSD_ASSIGN_OR_RETURN(acc->db, backend_->Allocate(static_cast<uint64_t>(v) * 4));
    LOSSD_RETURN_IF_ERROR(backend_->Zero(*acc->db));
  }
  held_bytes_->fetch_add(bytes);
  named_bytes_ += bytes;
  std::shared_ptr<Accumulator> shared(acc.release(), AccumulatorDeleter{held_bytes_, bytes});
  map_[name] = shared;
  return shared;
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

absl::Status AccumulatorStore::Drop(const std::string& name, const std::string& caller) {
  std::shared_ptr<Accumulator> dropped;
  {
    absl::MutexLock lock(&mu_);
    auto it = map_.find(name);
    if (it == map_.end()) {
      return absl::NotFoundError(absl::StrCat("accumulator '", name, "' not found"));
    }
    const Accumulator& a = *it->second;
    absl::Status mine = CheckOwner(a.owner, caller, absl::StrCat("accumulator '", name, "'"));
    if (!mine.ok()) return mine;
    named_bytes_ -= AccumulatorBytes(a.v, a.h, a.has_bias);
    dropped = std::move(it->second);
    map_.erase(it);
  }
  // Unless a running call still holds it, its memory (GiBs of device or host memory) is given
  // back here, outside the lock, so that other clients' lookups do not wait for the free.
  dropped.reset();
  return absl::OkStatus();
}

std::vector<StateInfo> AccumulatorStore::List(const std::string& caller) const {
  absl::MutexLock lock(&mu_);
  std::vector<StateInfo> out;
  for (const auto& [name, acc] : map_) {
    if (acc->owner != caller) continue;
    StateInfo s;
    s.kind = StateInfo::Kind::kAccumulator;
    s.name = acc->name;
    s.bytes = AccumulatorBytes(acc->v, acc->h, acc->has_bias);
    s.last_used_ns = acc->last_used_ns.load();
    s.micro_batches = acc->listed_micro_batches.load();
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<std::string> AccumulatorStore::DropIdle(int64_t before_ns) {
  std::vector<std::string> lines;
  std::vector<std::shared_ptr<Accumulator>> dropped;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = map_.begin(); it != map_.end();) {
      const Accumulator& a = *it->second;
      const int64_t last = a.last_used_ns.load();
      if (last >= before_ns) {
        ++it;
        continue;
      }
      const uint64_t bytes = AccumulatorBytes(a.v, a.h, a.has_bias);
      lines.push_back(absl::StrCat("accumulator ", a.name, " (", bytes, " bytes, idle ",
                                   (NowNs() - last) / 1000000000, " s)"));
      named_bytes_ -= bytes;
      dropped.push_back(std::move(it->second));
      map_.erase(it++);
    }
  }
  dropped.clear();  // freed outside the lock, as Drop does
  return lines;
}

size_t AccumulatorStore::count() const {
  absl::MutexLock lock(&mu_);
  return map_.size();
}

uint64_t AccumulatorStore::bytes() const { return held_bytes_->load(); }

}  // namespace lossd
