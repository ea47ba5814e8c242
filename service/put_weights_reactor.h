// SPDX-License-Identifier: Apache-2.0
// The PutWeights call: a header, then W (and bias) parts copied straight into backend
// memory. A striped upload (header.upload_id set) is one of several streams; the engine's
// WeightsUpload joins them and checks each stripe's part order, and this reactor waits,
// without blocking, for the last stripe to make the handle. A state machine with one State:
// it reads, calls the engine and writes the response; the upload's rules are the engine's.
#ifndef LOSSD_SERVICE_PUT_WEIGHTS_REACTOR_H_
#define LOSSD_SERVICE_PUT_WEIGHTS_REACTOR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "engine/weights_upload.h"
#include "lossd/v1/lossd.pb.h"
#include "service/call_edge.h"
#include "service/loss_service.h"

namespace lossd {

class PutWeightsReactor final : public grpc::ServerReadReactor<v1::PutWeightsRequest> {
 public:
  PutWeightsReactor(LossService* service, grpc::CallbackServerContext* ctx,
                    v1::PutWeightsResponse* response);

  void OnReadDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // kHeader -> kParts -> (a stripe: kWaitingForStripes ->) kFinished; any state but
  // kFinished may go to kFinished.
  enum class State { kHeader, kParts, kWaitingForStripes, kFinished };
  static bool LegalTransition(State from, State to);

  absl::Status OnMessage();
  absl::Status OnHeader(const v1::WeightsHeader& h);
  absl::Status OnPart(const v1::TensorPart& part);
  absl::Status Cancelled() const;
  absl::Status OnEnd();
  void FinishOnce(const absl::Status& s);

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::PutWeightsResponse* const response_;
  CallEdge edge_;  // its idle watch armed while waiting for the client
  CallState<State> state_{State::kHeader, State::kFinished, &LegalTransition};
  v1::PutWeightsRequest request_;
  // Set with the header, on the reactor's thread, before any other thread may read it.
  std::unique_ptr<WeightsUpload> upload_;
  uint64_t bytes_in_ = 0;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_PUT_WEIGHTS_REACTOR_H_
