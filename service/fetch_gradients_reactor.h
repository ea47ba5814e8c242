// SPDX-License-Identifier: Apache-2.0
// The FetchGradients call: the request is checked and admitted by the engine's FetchLease,
// the snapshot is taken on the executor (after every Compute queued before it), then
// streamed as a header and DW / DB parts. A state machine with one State: it reads the
// request, calls the lease and writes; what is admitted, reset and undone is the lease's.
// A raw method: the parts are slices of the snapshot buffer, so lossd copies no byte of it
// on the way out.
#ifndef LOSSD_SERVICE_FETCH_GRADIENTS_REACTOR_H_
#define LOSSD_SERVICE_FETCH_GRADIENTS_REACTOR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"
#include "engine/fetch_lease.h"
#include "service/call_edge.h"
#include "service/loss_service.h"

namespace lossd {

class FetchGradientsReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchGradientsReactor(LossService* service, grpc::CallbackServerContext* ctx,
                        const grpc::ByteBuffer* raw_request);

  void OnCancel() override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // kChecking -> kAdmitting (waiting for memory) -> kQueued (the snapshot job waits on the
  // executor) -> kSending -> kFinished; any state but kFinished may go to kFinished.
  enum class State { kChecking, kAdmitting, kQueued, kSending, kFinished };
  static bool LegalTransition(State from, State to);

  absl::Status Start(const grpc::ByteBuffer& raw_request);
  void OnAdmitted(absl::Status s);
  void TakeSnapshot();
  void SendNext();
  void Write();
  void FinishOnce(absl::Status s);
  void FinishNow(const absl::Status& s);

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  // Its idle watch is never armed (the call reads nothing after its request): it times the
  // writes alone.
  CallEdge edge_;
  CallState<State> state_{State::kChecking, State::kFinished, &LegalTransition};
  // Set in the constructor, before any other reaction may run; the lease outlives the call.
  std::unique_ptr<FetchLease> lease_;
  uint32_t part_bytes_ = 4u << 20;
  grpc::ByteBuffer response_;
  uint64_t offset_ = 0;  // the next byte of dW | db to send
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_FETCH_GRADIENTS_REACTOR_H_
