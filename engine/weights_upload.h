// SPDX-License-Identifier: Apache-2.0
// One PutWeights stream's side of a weight upload: a plain upload (the parts of W and of the
// bias each in order; Engine::WriteWeights checks them) or one stripe of a striped upload (its
// parts in order, without gaps or overlaps, inside its own range of W; the bias only on the
// stripe that starts at 0). Checks the order, copies through the engine, then commits or
// waits for the sibling stripes. Never touches gRPC, and never reads the wire: the service
// hands it the header's fields and each part's bytes.
#ifndef LOSSD_ENGINE_WEIGHTS_UPLOAD_H_
#define LOSSD_ENGINE_WEIGHTS_UPLOAD_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine.h"

namespace lossd {

// A PutWeights header's fields (the proto's WeightsHeader, converted by the service).
struct UploadHeader {
  TensorDesc w, bias;
  std::string upload_id;  // empty: a plain upload
  uint32_t stripes = 0;
  uint64_t w_begin = 0, w_end = 0;  // this stripe's bytes of W
};

class WeightsUpload {
 public:
  // Begins a plain upload or joins a striped one (Engine::BeginPutWeights, JoinStripedUpload)
  // with their errors; INVALID_ARGUMENT for stripe fields without an upload_id. A stripe
  // refused here aborts its upload for every sibling. `client`: whose uploads the upload_id
  // names (the service's client key); `principal`: who will own the handle (owner.h).
  static absl::StatusOr<std::unique_ptr<WeightsUpload>> Begin(Engine* engine,
                                                              const UploadHeader& header,
                                                              const std::string& client,
                                                              const std::string& principal);
  WeightsUpload(const WeightsUpload&) = delete;
  WeightsUpload& operator=(const WeightsUpload&) = delete;

  bool striped() const { return stripe_ != nullptr; }
  // When any stripe of the upload last received a message (null for a plain upload): the
  // service keeps it, so a stripe waiting for its siblings is not idle while they send.
  std::atomic<int64_t>* activity() { return stripe_ ? &stripe_->activity_ns : nullptr; }
  // W and bias of the whole upload.
  uint64_t bytes() const { return bytes_; }

  // Copies one part (`bias`: of the bias, else of W) at byte `offset` of its tensor.
  absl::Status Write(bool bias, uint64_t offset, const void* data, uint64_t size);

  // The stream closed: a stripe must have received all its range (INVALID_ARGUMENT saying
  // how far it got). Always OK for a plain upload.
  absl::Status CheckComplete() const;
  // A plain upload: commits the weights and returns the handle (Engine::CommitWeights).
  absl::StatusOr<std::string> Commit();
  // A stripe: records it complete; `done` runs once, with the handle when every stripe is in
  // or with the reason the upload failed (possibly on a sibling's thread).
  void FinishStripe(StripedUpload::Waiter done);

  // The stream failed: a stripe aborts the whole upload (every sibling fails with `why`).
  void Fail(const absl::Status& why);
  // The stream ended: a plain upload never committed leaves no handle and frees its memory
  // now. A stripe is left to its upload.
  void Abandon() { pending_.reset(); }

 private:
  WeightsUpload(Engine* engine) : engine_(engine) {}
  absl::Status WriteStripePart(bool bias, uint64_t offset, const void* data, uint64_t size);

  Engine* const engine_;
  uint64_t bytes_ = 0;
  std::unique_ptr<PendingWeights> pending_;  // a plain upload until committed
  std::shared_ptr<StripedUpload> stripe_;    // a stripe
  bool carries_bias_ = false;
  uint64_t next_w_ = 0, w_end_ = 0, next_bias_ = 0, bias_bytes_ = 0;
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_WEIGHTS_UPLOAD_H_
