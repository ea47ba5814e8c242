// SPDX-License-Identifier: Apache-2.0
// Engine's weight uploads: PutWeights (begin, parts in order, commit) and striped uploads
// (one upload over several streams, each a disjoint byte range of W). Every part is checked
// (whole elements, inside its tensor, finite) before it is copied to the backend; a
// reservation in the weight cache is held until the handle is committed or the upload ends.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine/finite_check.h"
#include "engine/message_bounds.h"
#include "engine/request_checks.h"

namespace lossd {
namespace {

// Length-prefixed, so no owner and id pair reads as another.
std::string UploadKey(const std::string& owner, const std::string& upload_id) {
  return absl::StrCat(owner.size(), ":", owner, upload_id);
}

// Every stripe's header must repeat the first one's: the byte counts of the upload are the
// first stripe's (validated when it began), never a later header's.
absl::Status CheckAgreesWithFirstStripe(const std::string& upload_id, uint32_t stripes,
                                        const TensorDesc& w, const TensorDesc& bias,
                                        uint32_t first_stripes, const TensorDesc& first_w,
                                        const TensorDesc& first_bias) {
  auto spec = [](const TensorDesc& t) {
    return t.present ? absl::StrCat(DTypeName(t.dtype), ShapeText(t.shape))
                     : std::string("absent");
  };
  auto disagree = [&](absl::string_view field, absl::string_view got, absl::string_view first) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a stripe of upload '", upload_id, "' disagrees with its first stripe: ", field, " is ",
        got, ", the first stripe's is ", first));
  };
  if (first_stripes != stripes) {
    return disagree("header.stripes", absl::StrCat(stripes), absl::StrCat(first_stripes));
  }
  if (first_w.dtype != w.dtype || first_w.shape != w.shape) {
    return disagree("header.w", spec(w), spec(first_w));
  }
  if (first_bias.present != bias.present ||
      (bias.present && (first_bias.dtype != bias.dtype || first_bias.shape != bias.shape))) {
    return disagree("header.bias", spec(bias), spec(first_bias));
  }
  return absl::OkStatus();
}

// A stripe's W byte range [begin, end): whole elements of `dtype`, inside w's `w_bytes`,
// clear of the `ranges` already joined, with room left for the stripes still to join.
absl::Status CheckStripeRange(const std::string& upload_id, DType dtype, uint64_t w_bytes,
                              uint64_t begin, uint64_t end,
                              const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                              uint32_t stripes, uint32_t joined) {
  const uint64_t es = DTypeSize(dtype);
  if (begin % es != 0 || end % es != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe range [", begin, ", ", end, ") must hold whole ", DTypeName(dtype),
        " elements (multiples of ", es, " bytes)"));
  }
  if (begin >= end || end > w_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stripe range [", begin, ", ", end, ") is not a non-empty range of w's ", w_bytes,
        " bytes"));
  }
  for (const auto& r : ranges) {
    if (begin < r.second && r.first < end) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stripe range [", begin, ", ", end, ") overlaps the range [", r.first, ", ",
          r.second, ") of another stripe of upload '", upload_id, "'"));
    }
  }
  if (joined >= stripes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "upload '", upload_id, "' already has its ", stripes, " stripes"));
  }
  // The ranges are disjoint (above), so they cover w exactly once the stripes still to come
  // can fill what is left, at least one element each: refused as soon as they cannot,
  // naming the ranges, rather than found out at the end (or never, by stripes that wait).
  uint64_t covered = end - begin;
  for (const auto& r : ranges) covered += r.second - r.first;
  const uint64_t still_to_join = stripes - joined - 1;
  const uint64_t left = w_bytes - covered;
  if (still_to_join == 0 ? left != 0 : left < still_to_join * es) {
    std::vector<std::string> named;
    for (const auto& r : ranges) named.push_back(absl::StrCat("[", r.first, ", ", r.second, ")"));
    named.push_back(absl::StrCat("[", begin, ", ", end, ")"));
    return absl::InvalidArgumentError(absl::StrCat(
        "the ranges of upload '", upload_id, "' cannot cover w's ", w_bytes, " bytes with its ",
        stripes, " stripes: ", absl::StrJoin(named, ", "), " cover ", covered, " bytes, ",
        still_to_join, " stripe(s) still to join"));
  }
  return absl::OkStatus();
}

}  // namespace

PendingWeights::~PendingWeights() {
  if (engine != nullptr && reserved > 0) engine->weights_.Unreserve(reserved);
}

absl::StatusOr<std::unique_ptr<PendingWeights>> Engine::BeginPutWeights(
    const TensorDesc& w, const TensorDesc& bias, const std::string& owner) {
  if (draining_.load()) return absl::UnavailableError("server is draining");
  if (!w.present) return absl::InvalidArgumentError("weights header.w is missing");
  LOSSD_RETURN_IF_ERROR(CheckShape(w, "w", 2));
  LOSSD_RETURN_IF_ERROR(CheckFloatDType(w, "w"));
  if (w.shape[0] > options_.max_v || w.shape[1] > options_.max_h) {
    return absl::InvalidArgumentError(absl::StrCat(
        "w.shape ", ShapeString(w.shape), " exceeds the limits (V <= ", options_.max_v,
        ", H <= ", options_.max_h, ")"));
  }
  if (bias.present) {
    LOSSD_RETURN_IF_ERROR(CheckShape(bias, "bias", 1));
    if (bias.shape[0] != w.shape[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias.shape ", ShapeString(bias.shape), " must be (V) = [", w.shape[0], "]"));
    }
    if (bias.dtype != w.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bias.dtype ", DTypeName(bias.dtype), " differs from w.dtype ", DTypeName(w.dtype)));
    }
  }
  auto p = std::make_unique<PendingWeights>();
  auto e = std::make_shared<WeightEntry>();
  e->owner = owner;
  e->dtype = w.dtype;
  e->v = w.shape[0];
  e->h = w.shape[1];
  const uint64_t wb = static_cast<uint64_t>(e->v) * e->h * DTypeSize(w.dtype);
  const uint64_t bb = bias.present ? e->v * DTypeSize(w.dtype) : 0;
  LOSSD_RETURN_IF_ERROR(weights_.Reserve(wb + bb));
  p->engine = this;
  p->reserved = wb + bb;
  LOSSD_ASSIGN_OR_RETURN(e->w, backend_->Allocate(wb));
  if (bias.present) {
    LOSSD_ASSIGN_OR_RETURN(e->bias, backend_->Allocate(bb));
  }
  p->entry = std::move(e);
  return p;
}

absl::Status Engine::CopyWeightPart(const WeightEntry& e, bool bias, uint64_t offset,
                                    const void* data, uint64_t bytes) {
  BackendBuffer* dst = bias ? e.bias.get() : e.w.get();
  const char* name = bias ? "bias" : "w";
  if (dst == nullptr) {
    return absl::InvalidArgumentError("a bias part arrived but the weights header has no bias");
  }
  const uint64_t es = DTypeSize(e.dtype);
  if (offset % es != 0 || bytes % es != 0) {
    // Whole elements only: the finiteness check reads each part as elements.
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", name, " at offset ", offset, " with ", bytes, " bytes does not hold whole ",
        DTypeName(e.dtype), " elements (offset and size must be multiples of ", es, ")"));
  }
  if (offset > dst->size() || bytes > dst->size() - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "part of ", name, " at offset ", offset, " with ", bytes, " bytes runs past its ",
        dst->size(), " bytes (shape x dtype)"));
  }
  if (options_.check_finite) {
    absl::Status s =
        CheckFiniteElements(static_cast<const uint8_t*>(data), e.dtype, 0, bytes / es, name, 0);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          s.message(), " (relative to the part at byte offset ", offset, ")"));
    }
  }
  return backend_->CopyToBackend(*dst, offset, data, bytes);
}

absl::Status Engine::WriteWeights(PendingWeights& p, bool bias, uint64_t offset,
                                  const void* data, uint64_t bytes) {
  uint64_t& got = p.received[bias ? 1 : 0];
  if (offset != got) {
    return absl::InvalidArgumentError(absl::StrCat(
        "part of ", bias ? "bias" : "w", " at offset ", offset, " but ", got,
        " bytes were received so far: parts must arrive in order without gaps or overlaps"));
  }
  LOSSD_RETURN_IF_ERROR(CopyWeightPart(*p.entry, bias, offset, data, bytes));
  got += bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::string> Engine::CommitWeights(std::unique_ptr<PendingWeights> p) {
  const WeightEntry& e = *p->entry;
  if (p->received[0] != e.w->size() || (e.bias && p->received[1] != e.bias->size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights stream closed early: w has ", p->received[0], " of ", e.w->size(), " bytes",
        e.bias ? absl::StrCat(", bias ", p->received[1], " of ", e.bias->size()) : ""));
  }
  p->reserved = 0;  // the cache takes the reservation over
  return weights_.Insert(std::move(p->entry));
}

absl::Status Engine::DropWeights(const std::string& handle, const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(CheckIdLength(handle, "handle"));
  return weights_.Drop(handle, caller);
}

absl::StatusOr<std::shared_ptr<StripedUpload>> Engine::JoinStripedUpload(
    const std::string& owner, const std::string& upload_id, uint32_t stripes,
    const TensorDesc& w, const TensorDesc& bias, uint64_t begin, uint64_t end,
    bool carries_bias, const std::string& principal) {
  if (upload_id.size() > 128) {
    return absl::InvalidArgumentError("header.upload_id is longer than 128 characters");
  }
  if (stripes < 1 || stripes > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("header.stripes must be in [1, 64], got ", stripes));
  }
  std::shared_ptr<StripedUpload> u;
  {
    const std::string key = UploadKey(owner, upload_id);
    absl::MutexLock lock(&uploads_mu_);
    auto it = uploads_.find(key);
    if (it != uploads_.end()) {
      u = it->second;
    } else if (ended_.Find(key) != nullptr) {
      return absl::AbortedError(absl::StrCat(
          "striped upload '", upload_id,
          "' has already ended (completed or aborted); send it again under a new upload_id"));
    } else {
      LOSSD_ASSIGN_OR_RETURN(std::unique_ptr<PendingWeights> pending,
                             BeginPutWeights(w, bias, principal));
      u = std::make_shared<StripedUpload>();
      u->id_ = upload_id;
      u->key_ = key;
      u->stripes_ = stripes;
      u->w_ = w;
      u->bias_ = bias;
      absl::MutexLock ulock(&u->mu_);
      u->pending_ = std::move(pending);
      uploads_[key] = u;
    }
  }
  absl::MutexLock lock(&u->mu_);
  if (u->done_) {
    return absl::AbortedError(absl::StrCat("striped upload '", upload_id, "' has already ended"));
  }
  LOSSD_RETURN_IF_ERROR(
      CheckAgreesWithFirstStripe(upload_id, stripes, w, bias, u->stripes_, u->w_, u->bias_));
  LOSSD_RETURN_IF_ERROR(CheckStripeRange(upload_id, w.dtype, u->pending_->entry->w->size(),
                                         begin, end, u->ranges_, u->stripes_, u->joined_));
  if (carries_bias) {
    if (u->bias_claimed_) {
      return absl::InvalidArgumentError("two stripes of one upload both send the bias");
    }
    u->bias_claimed_ = true;
  }
  u->ranges_.emplace_back(begin, end);
  ++u->joined_;
  return u;
}

absl::Status Engine::WriteStripe(StripedUpload& u, bool bias, uint64_t offset,
                                 const void* data, uint64_t bytes) {
  // A sibling stripe may abort the upload (and free its pending state) while this one copies:
  // the copy holds its own reference to the buffers, and the count is kept only if the
  // upload is still alive afterwards.
  std::shared_ptr<WeightEntry> entry;
  {
    absl::MutexLock lock(&u.mu_);
    if (u.done_) return absl::AbortedError(absl::StrCat("striped upload '", u.id_, "' was aborted"));
    entry = u.pending_->entry;
  }
  // Stripes write disjoint ranges of the same buffer, so no lock is held for the copy.
  LOSSD_RETURN_IF_ERROR(CopyWeightPart(*entry, bias, offset, data, bytes));
  absl::MutexLock lock(&u.mu_);
  if (u.done_) return absl::AbortedError(absl::StrCat("striped upload '", u.id_, "' was aborted"));
  if (bias) {
    u.pending_->received[1] += bytes;
  } else {
    u.w_received_ += bytes;
  }
  return absl::OkStatus();
}

void Engine::FinishStripe(const std::shared_ptr<StripedUpload>& u, StripedUpload::Waiter done) {
  std::vector<StripedUpload::Waiter> waiters;
  absl::StatusOr<std::string> result =
      absl::AbortedError(absl::StrCat("striped upload '", u->id_, "' was aborted"));
  bool completes = false;
  {
    absl::MutexLock lock(&u->mu_);
    if (u->done_) {
      waiters.push_back(std::move(done));  // aborted meanwhile
    } else {
      u->waiters_.push_back(std::move(done));
      if (++u->finished_ < u->stripes_) return;  // the last stripe completes the upload
      u->done_ = true;
      completes = true;
      u->pending_->received[0] = u->w_received_;
      result = CommitWeights(std::move(u->pending_));
      waiters.swap(u->waiters_);
    }
  }
  if (completes) {
    absl::MutexLock lock(&uploads_mu_);
    uploads_.erase(u->key_);
    ended_.Remember(u->key_, true);
  }
  for (auto& w : waiters) w(result);
}

void Engine::FailStripedUpload(const std::string& owner, const std::string& upload_id,
                               const absl::Status& why) {
  std::shared_ptr<StripedUpload> u;
  {
    absl::MutexLock lock(&uploads_mu_);
    auto it = uploads_.find(UploadKey(owner, upload_id));
    if (it == uploads_.end()) return;
    u = it->second;
  }
  FailStripedUpload(u, why);
}

void Engine::FailStripedUpload(const std::shared_ptr<StripedUpload>& u, const absl::Status& why) {
  std::vector<StripedUpload::Waiter> waiters;
  {
    absl::MutexLock lock(&u->mu_);
    if (u->done_) return;
    u->done_ = true;
    u->pending_.reset();  // frees the memory and the cache reservation
    waiters.swap(u->waiters_);
  }
  {
    absl::MutexLock lock(&uploads_mu_);
    uploads_.erase(u->key_);
    ended_.Remember(u->key_, true);
  }
  const absl::Status aborted = absl::AbortedError(absl::StrCat(
      "striped upload '", u->id_, "' was aborted because a stripe failed: ", why.message()));
  for (auto& w : waiters) w(aborted);
}

}  // namespace lossd
