// SPDX-License-Identifier: Apache-2.0
// The Compute call: header -> admission -> parts -> compute (on the engine's executor) ->
// summary + output parts, or, overlapped (ComputeHeader.overlap), parts, compute and dX parts
// at once. A state machine with one State; it reads, calls the engine (plan, admission,
// run, the accumulator contribution) and writes. It never blocks a gRPC thread and holds no
// policy of its own: what is admitted, when an overlapped compute starts and what becomes of
// an accumulator's sum on failure are the engine's.
// Served as a raw method: request parts are parsed in place (wire::StreamFrame) and copied
// once, straight into the request's host buffer; response parts are slices of the output
// buffers, so lossd copies no returned byte (see bench/service/README.md, copy counts).
#ifndef LOSSD_SERVICE_COMPUTE_REACTOR_H_
#define LOSSD_SERVICE_COMPUTE_REACTOR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "engine/accumulator_contribution.h"
#include "engine/admission.h"
#include "engine/engine.h"
#include "engine/streamed_rows.h"
#include "lossd/v1/lossd.pb.h"
#include "service/compute_assembler.h"
#include "service/idle_watch.h"
#include "service/loss_service.h"
#include "service/overlap_sends.h"
#include "service/reactor_common.h"
#include "wire/part_codec.h"

namespace lossd {

// Lifetime: the reactor deletes itself in OnDone, which gRPC calls only after Finish; Finish
// is never called while a compute job holds `this`, so the job never sees a dead reactor.
class ComputeReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ComputeReactor(LossService* service, grpc::CallbackServerContext* ctx);

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // The call's life. Plain: kHeader -> kAdmitting -> kReceiving -> kComputing -> kSending ->
  // kFinished. Overlapped: kHeader -> kAdmitting -> kStreaming (reads, the compute and
  // writes at once) -> kFinishing (one Progress has decided to finish) -> kFinished. Any
  // state but kFinished may go to kFinished (a failure). SetStateLocked refuses the rest.
  enum class State {
    kHeader,
    kAdmitting,
    kReceiving,
    kComputing,
    kSending,
    kStreaming,
    kFinishing,
    kFinished,
  };
  static bool LegalTransition(State from, State to);
  // Moves to `next`; an illegal transition is a debug assert, and a release build stays put.
  void SetStateLocked(State next) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  State state() {
    absl::MutexLock lock(&mu_);
    return state_;
  }

  // Parses one Compute stream message into `frame`, refusing fields this server does not
  // know.
  static absl::Status ParseComputeFrame(const grpc::ByteBuffer& message,
                                        wire::StreamFrame* frame);
  void HandleCancel();
  absl::Status Cancelled() const;
  absl::Status WriteFailed() const;
  void Write();

  // Plain Compute.
  absl::Status OnHeader();
  void OnAdmitted(absl::Status s);
  absl::Status OnPart();
  absl::Status EndOfStream();
  absl::Status ReceiveComplete();
  void OnComputed(ComputeOutcome outcome);
  void NoteAdded(const ComputeOutcome& outcome);
  void ObserveCompute(const ComputeOutcome& outcome);
  v1::ComputeResponse Summary(const ComputeOutcome* outcome);
  void SendNext();
  uint64_t EncodeOutputPart(size_t i, uint64_t offset, uint64_t end);

  // Overlapped Compute (compute_reactor_overlap.cc).
  void StartOverlap();
  void OnOverlapReadDone(bool ok);
  absl::Status MaybeStartCompute();
  absl::Status OverlapEndOfStream();
  void EndHandlingRead();
  bool Failed();
  void FailOverlap(const absl::Status& s);
  void FailRows();
  void OnOverlapComputed(ComputeOutcome outcome);
  void Progress(absl::FunctionRef<void()> update = [] {});

  void FinishOnce(absl::Status s);

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  Engine* const engine_;
  const absl::Time started_;
  const std::string request_id_;  // sent back at once, named in the call's log lines
  const std::shared_ptr<IdleWatch::Entry> idle_;  // armed while waiting for the client
  bool entered_ = true;
  std::string client_;  // for the per-client in-flight count
  Admission admission_;  // the plan's bytes in the memory budget, until the call finishes
  AccumulatorContribution contribution_;  // what the compute added into an accumulator

  // ComputeHeader.overlap: the request's mode, not a state. Set with the plan, on the
  // reactor's thread, before anything that reads it can run.
  bool overlap_ = false;

  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kHeader;
  // Overlapped: what is in flight, the order of the parts and when the call may finish.
  std::unique_ptr<OverlapSends> sends_ ABSL_GUARDED_BY(mu_);  // made as streaming starts
  v1::ComputeResponse final_summary_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<StreamedRows> rows_;  // set once, on the reactor's thread, under mu_

  grpc::ByteBuffer request_;
  wire::StreamFrame frame_;  // request_ parsed in place
  grpc::ByteBuffer response_;
  std::shared_ptr<const ComputePlan> plan_;
  std::shared_ptr<Engine::InputBuffers> inputs_;
  std::unique_ptr<ComputeAssembler> assembler_;
  SharedOutputs outputs_;  // one per plan_->outputs, same order
  uint32_t response_part_bytes_ = 4u << 20;
  size_t output_ = 0;  // plain: the output being sent, and how far (SendNext)
  uint64_t offset_ = 0;
  uint64_t bytes_out_ = 0;
  double queue_seconds_ = 0;
  absl::Time receive_started_;
  absl::Time send_started_;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_COMPUTE_REACTOR_H_
