// SPDX-License-Identifier: Apache-2.0
#include "engine/weights_upload.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace lossd {

absl::StatusOr<std::unique_ptr<WeightsUpload>> WeightsUpload::Begin(
    Engine* engine, const UploadHeader& h, const std::string& client,
    const std::string& principal) {
  std::unique_ptr<WeightsUpload> u(new WeightsUpload(engine));
  if (!h.upload_id.empty()) {
    u->carries_bias_ = h.bias.present && h.w_begin == 0;
    auto stripe = engine->JoinStripedUpload(client, h.upload_id, h.stripes, h.w, h.bias,
                                            h.w_begin, h.w_end, u->carries_bias_, principal);
    if (!stripe.ok()) {
      engine->FailStripedUpload(client, h.upload_id, stripe.status());
      return stripe.status();
    }
    u->stripe_ = std::move(*stripe);
    u->next_w_ = h.w_begin;
    u->w_end_ = h.w_end;
    u->bias_bytes_ = u->carries_bias_ ? u->stripe_->bias_bytes() : 0;
    u->bytes_ = u->stripe_->w_bytes() + u->stripe_->bias_bytes();
    return u;
  }
  if (h.stripes != 0 || h.w_begin != 0 || h.w_end != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.stripes (", h.stripes, "), header.w_begin (", h.w_begin,
        ") and header.w_end (", h.w_end, ") describe one stripe of a striped upload "
        "and need header.upload_id, which is empty"));
  }
  auto p = engine->BeginPutWeights(h.w, h.bias, principal);
  if (!p.ok()) return p.status();
  u->pending_ = std::move(*p);
  u->bytes_ = u->pending_->entry->bytes();
  return u;
}

absl::Status WeightsUpload::Write(bool bias, uint64_t offset, const void* data,
                                  uint64_t size) {
  if (stripe_) return WriteStripePart(bias, offset, data, size);
  return engine_->WriteWeights(*pending_, bias, offset, data, size);
}

absl::Status WeightsUpload::WriteStripePart(bool bias, uint64_t offset, const void* data,
                                            uint64_t size) {
  uint64_t& next = bias ? next_bias_ : next_w_;
  const uint64_t limit = bias ? bias_bytes_ : w_end_;
  if (bias && !carries_bias_) {
    return absl::InvalidArgumentError(
        "a bias part arrived on a stripe that does not carry the bias (the stripe with "
        "w_begin 0 does)");
  }
  if (offset != next) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", bias ? "bias" : "w", " starts at byte offset ", offset,
        " but this stripe expects offset ", next,
        ": parts must arrive in order, without gaps or overlaps"));
  }
  if (size > limit - next) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a part of ", bias ? "bias" : "w", " at offset ", offset, " with ", size,
        " bytes runs past the stripe's end at ", limit));
  }
  absl::Status s = engine_->WriteStripe(*stripe_, bias, offset, data, size);
  if (s.ok()) next += size;
  return s;
}

absl::Status WeightsUpload::CheckComplete() const {
  if (!stripe_ || (next_w_ == w_end_ && next_bias_ == bias_bytes_)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "the stripe closed early: w has ", next_w_, " of the bytes up to ", w_end_,
      carries_bias_ ? absl::StrCat(", bias ", next_bias_, " of ", bias_bytes_) : ""));
}

absl::StatusOr<std::string> WeightsUpload::Commit() {
  return engine_->CommitWeights(std::move(pending_));
}

void WeightsUpload::FinishStripe(StripedUpload::Waiter done) {
  engine_->FinishStripe(stripe_, std::move(done));
}

void WeightsUpload::Fail(const absl::Status& why) {
  if (stripe_) engine_->FailStripedUpload(stripe_, why);
}

}  // namespace lossd
