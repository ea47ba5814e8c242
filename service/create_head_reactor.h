// SPDX-License-Identifier: Apache-2.0
// The CreateHead call: a HeadHeader, then the head's tensors as TENSOR_HEAD_* parts (each
// tensor in byte order) copied straight into the memory the engine's HeadStore allocated;
// at the end of the stream the store names the head. Creating a head that is already here at
// the same version (an import repeated) reads the parts, drops them and answers
// created = false. A state machine with one State: it reads, calls the store and writes the
// response; what a head may be, and what each part must hold, are the store's.
#ifndef LOSSD_SERVICE_CREATE_HEAD_REACTOR_H_
#define LOSSD_SERVICE_CREATE_HEAD_REACTOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "engine/heads.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.pb.h"
#include "service/call_edge.h"
#include "service/loss_service.h"

namespace lossd {

class CreateHeadReactor final : public grpc::ServerReadReactor<v1::CreateHeadRequest> {
 public:
  CreateHeadReactor(LossService* service, grpc::CallbackServerContext* ctx,
                    v1::CreateHeadResponse* response);

  void OnReadDone(bool ok) override;
  void OnDone() override;

 private:
  // kHeader -> kParts (a new head) or kDropping (the same head already here) -> kFinished;
  // any state but kFinished may go to kFinished.
  enum class State { kHeader, kParts, kDropping, kFinished };
  static bool LegalTransition(State from, State to);

  absl::Status OnMessage();
  absl::Status OnHeader(const v1::HeadHeader& h);
  absl::Status OnPart(const v1::TensorPart& part);
  absl::Status OnEnd();
  // Names the head (CommitCreate) and finishes the call; a group's runs on its own thread.
  void Commit();
  absl::Status Cancelled() const;
  void FinishOnce(const absl::Status& s);

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::CreateHeadResponse* const response_;
  CallEdge edge_;  // its idle watch armed while waiting for the client
  CallState<State> state_{State::kHeader, State::kFinished, &LegalTransition};
  v1::CreateHeadRequest request_;
  // Set with the header, on the reactor's thread (reads run one at a time).
  std::unique_ptr<PendingHead> pending_;
  std::optional<HeadSummary> existing_;
  uint64_t bytes_in_ = 0;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_CREATE_HEAD_REACTOR_H_
