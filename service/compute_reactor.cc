// SPDX-License-Identifier: Apache-2.0
#include "service/compute_reactor.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/message_bounds.h"
#include "engine/response_parts.h"
#include "service/tsan_annotations.h"
#include "service/wire_convert.h"
#include "wire/unknown_fields.h"

namespace lossd {
namespace {

// The name of a tensor id for messages, also for ids the enum does not know.
std::string TensorIdName(int32_t id) {
  return v1::TensorId_IsValid(id) ? v1::TensorId_Name(static_cast<v1::TensorId>(id))
                                  : absl::StrCat(id);
}

}  // namespace

absl::Status ComputeReactor::ParseComputeFrame(const grpc::ByteBuffer& message,
                                              wire::StreamFrame* frame) {
  if (absl::Status s = frame->Parse(message); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a Compute message is not a ComputeRequest: ", s.message()));
  }
  if (frame->unknown_field() == 0) return absl::OkStatus();
  return frame->unknown_in_part()
             ? UnknownFieldError("part", "lossd.v1.TensorPart", frame->unknown_field())
             : UnknownFieldError("ComputeRequest", "lossd.v1.ComputeRequest",
                                 frame->unknown_field());
}

ComputeReactor::ComputeReactor(LossService* service, grpc::CallbackServerContext* ctx)
    : service_(service),
      ctx_(ctx),
      engine_(service->engine()),
      started_(absl::Now()),
      request_id_(BeginRequestId(ctx)),
      idle_(service->idle_watch().Watch([ctx] { ctx->TryCancel(); })),
      admission_(&engine_->budget()),
      contribution_(engine_) {
  absl::Status s = service_->Enter(ctx, "Compute", &client_);
  if (!s.ok()) {
    entered_ = false;
    FinishOnce(s);
    return;
  }
  idle_->Arm();  // waiting for the header
  StartRead(&request_);
}

bool ComputeReactor::LegalTransition(State from, State to) {
  if (to == State::kFinished) return from != State::kFinished;
  switch (from) {
    case State::kHeader:
      return to == State::kAdmitting;
    case State::kAdmitting:
      return to == State::kReceiving || to == State::kStreaming;
    case State::kReceiving:
      return to == State::kComputing;
    case State::kComputing:
      return to == State::kSending;
    case State::kStreaming:
      return to == State::kFinishing;
    case State::kSending:
    case State::kFinishing:
    case State::kFinished:
      return false;
  }
  return false;
}

void ComputeReactor::SetStateLocked(State next) {
  // A debug assert only: a wrong transition is this file's bug, never the client's, and a
  // release build keeps the state it had rather than end the process.
  assert(LegalTransition(state_, next) && "illegal Compute state transition");
  if (LegalTransition(state_, next)) state_ = next;
}

void ComputeReactor::OnReadDone(bool ok) {
  if (ok) idle_->Touch();
  if (overlap_) {
    OnOverlapReadDone(ok);
    return;
  }
  absl::Status s;
  if (!ok) {
    s = EndOfStream();
  } else if (absl::Status parsed = ParseComputeFrame(request_, &frame_); !parsed.ok()) {
    s = parsed;
  } else if (state() == State::kHeader) {
    s = OnHeader();
  } else {
    s = OnPart();
    if (s.ok()) StartRead(&request_);
  }
  if (!s.ok()) FinishOnce(s);
}

void ComputeReactor::OnWriteDone(bool ok) {
  idle_->WriteDone();
  if (overlap_) {
    {
      absl::MutexLock lock(&mu_);
      sends_->WriteDone();
      if (!ok) sends_->Fail(WriteFailed());
    }
    if (!ok) FailRows();
    Progress();
    return;
  }
  if (!ok) {
    FinishOnce(WriteFailed());
    return;
  }
  SendNext();
}

void ComputeReactor::OnCancel() {
  // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
  // Released when OnCancel returns, after the hook's read of service_ too: released at the
  // end of HandleCancel, that read looked to TSan like a race with OnDone's delete.
  LOSSD_TSAN_RELEASE_ON_EXIT(this);
  HandleCancel();
  if (service_->options().compute_cancel_hook) service_->options().compute_cancel_hook();
}

void ComputeReactor::HandleCancel() {
  std::shared_ptr<StreamedRows> rows;
  {
    absl::MutexLock lock(&mu_);
    rows = rows_;
  }
  // Still waiting for memory: withdrawn, and its callback fails the call with CANCELLED.
  // Before the header asked (no read is pending while it is handled, so nothing else would
  // end the call then), OnHeader finds it withdrawn; once granted, a no-op.
  admission_.Withdraw();
  // Pending reads/writes or the job finish us; an overlapped compute waiting for rows of X
  // that will never come is let go at once.
  if (rows != nullptr) rows->Fail(Cancelled());
}

void ComputeReactor::OnDone() {
  LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
  service_->idle_watch().Unwatch(idle_);
  // Finished OK, but did the status reach the client (it may give up at the last moment)?
  contribution_.Delivered(!ctx_->IsCancelled());
  LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
  delete this;
}

// Why a cancelled call ended: the client cancelled it, or the idle watch did.
absl::Status ComputeReactor::Cancelled() const {
  if (idle_->expired()) {
    return absl::DeadlineExceededError(
        absl::StrCat("the Compute was cancelled by the server: ", idle_->Reason()));
  }
  return absl::CancelledError("the client cancelled the Compute");
}

// Why a write failed: the idle watch found the client not reading, or it went away.
absl::Status ComputeReactor::WriteFailed() const {
  if (idle_->expired()) return Cancelled();
  return absl::CancelledError("the client went away while results were being sent");
}

// Every response message goes out here: the client has --stream_idle_timeout to take it.
void ComputeReactor::Write() {
  idle_->WriteStarted();
  StartWrite(&response_);
}

absl::Status ComputeReactor::OnHeader() {
  if (service_->options().compute_header_hook) service_->options().compute_header_hook();
  if (frame_.kind() != wire::StreamFrame::Kind::kHeader) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the first message of a Compute stream must be a header, got ",
        frame_.kind() == wire::StreamFrame::Kind::kPart
            ? absl::StrCat("a part of ", TensorIdName(frame_.tensor()))
            : std::string("a message with neither header nor part")));
  }
  absl::Status size = CheckHeaderBytes(frame_.header_bytes().size(), "the Compute header");
  if (!size.ok()) return size;
  v1::ComputeHeader header;
  if (!header.ParseFromString(frame_.header_bytes())) {
    return absl::InvalidArgumentError("the Compute header is not a valid ComputeHeader");
  }
  if (absl::Status s = RefuseUnknownFields(header, "header"); !s.ok()) return s;
  auto spec = ComputeSpecFromWire(header);
  if (!spec.ok()) return spec.status();
  spec->owner = service_->Principal(ctx_);
  auto plan = engine_->Plan(*spec);
  if (!plan.ok()) return plan.status();
  const ServiceOptions& o = service_->options();
  auto part_bytes = ResponsePartBytes(header.response_part_bytes(),
                                      o.default_response_part_bytes, o.max_part_bytes,
                                      "header.response_part_bytes");
  if (!part_bytes.ok()) return part_bytes.status();
  plan_ = std::make_shared<const ComputePlan>(std::move(*plan));
  response_part_bytes_ = *part_bytes;
  overlap_ = header.overlap();
  {
    absl::MutexLock lock(&mu_);
    if (admission_.withdrawn()) return Cancelled();  // cancelled while parsed: never queued
    SetStateLocked(State::kAdmitting);
  }
  idle_->Disarm();  // waiting for memory, not for the client
  const std::string what = absl::StrCat("Compute of (BT=", plan_->bt, ", H=", plan_->h,
                                        ", V=", plan_->v, ")");
  // The callback may run before Request returns (memory free now) or later, on the thread
  // that releases memory; either way it resumes reading. A cancel that lands after the
  // check above is not lost: the admission withdraws itself once it has its ticket, and a
  // granted call ends on its next read, which fails on a cancelled stream.
  return admission_.Request(plan_->admission_bytes(), what,
                            [this](absl::Status st) { OnAdmitted(std::move(st)); });
}

void ComputeReactor::OnAdmitted(absl::Status s) {
  if (!s.ok()) {
    FinishOnce(s);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    SetStateLocked(overlap_ ? State::kStreaming : State::kReceiving);
  }
  queue_seconds_ = SecondsSince(started_);
  receive_started_ = absl::Now();
  // The NaN/Inf test runs on each part as it arrives (while the next one is on the wire)
  // instead of in one pass over X after the last.
  assembler_ = std::make_unique<ComputeAssembler>(plan_, service_->options().max_part_bytes,
                                                  service_->options().max_parts_per_request,
                                                  engine_->options().check_finite);
  idle_->Arm();  // waiting for the parts
  if (overlap_) {
    StartOverlap();
    return;
  }
  StartRead(&request_);
}

absl::Status ComputeReactor::OnPart() {
  if (frame_.kind() == wire::StreamFrame::Kind::kHeader) {
    return absl::InvalidArgumentError("the Compute stream carries a second header");
  }
  if (frame_.kind() != wire::StreamFrame::Kind::kPart) {
    return absl::InvalidArgumentError("a Compute message carries neither header nor part");
  }
  return assembler_->Accept(frame_.tensor(), frame_.offset(), frame_.data_pieces(),
                            frame_.data_size());
}

absl::Status ComputeReactor::EndOfStream() {
  idle_->Disarm();
  if (ctx_->IsCancelled()) return Cancelled();
  if (state() == State::kHeader) {
    return absl::InvalidArgumentError("the Compute stream closed before its header");
  }
  absl::Status complete = ReceiveComplete();
  if (!complete.ok()) return complete;
  if (ctx_->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the deadline passed before the compute started");
  }
  {
    absl::MutexLock lock(&mu_);
    SetStateLocked(State::kComputing);
  }
  inputs_ = assembler_->buffers();
  const bool checked = assembler_->finite_checked();
  assembler_.reset();
  frame_ = wire::StreamFrame();  // drops the last received message
  engine_->Run(
      plan_, inputs_, [this](ComputeOutcome outcome) { OnComputed(std::move(outcome)); },
      absl::FromChrono(ctx_->deadline()), checked, OverlapIo{},
      [this] { return ctx_->IsCancelled(); });
  return absl::OkStatus();
}

// The client closed its side: every input must be complete; records the receive phase.
absl::Status ComputeReactor::ReceiveComplete() {
  absl::Status complete = assembler_->CheckComplete();
  if (!complete.ok()) return complete;
  ServerMetrics* m = service_->metrics();
  m->ObservePhase("Compute", "receive", SecondsSince(receive_started_));
  m->AddBytesIn(static_cast<double>(assembler_->bytes_received()));
  return absl::OkStatus();
}

// Runs on the executor thread.
void ComputeReactor::OnComputed(ComputeOutcome outcome) {
  inputs_.reset();  // inputs are no longer needed; free them before sending
  ObserveCompute(outcome);
  NoteAdded(outcome);
  if (!outcome.status.ok()) {
    FinishOnce(outcome.status);
    return;
  }
  if (ctx_->IsCancelled()) {
    FinishOnce(Cancelled());
    return;
  }
  outputs_ = std::make_shared<std::vector<HostBuffer>>(std::move(outcome.outputs));
  v1::ComputeResponse response = Summary(&outcome);
  {
    absl::MutexLock lock(&mu_);
    SetStateLocked(State::kSending);
  }
  send_started_ = absl::Now();
  response_ = wire::EncodeMessage(response);
  Write();
}

// From here a failure of the call leaves the accumulator's sum in doubt (FinishOnce).
void ComputeReactor::NoteAdded(const ComputeOutcome& outcome) {
  contribution_.Added(outcome.added_to, outcome.added_resets);
}

// The queue and compute metrics of a finished compute job (the compute ones if it worked).
void ComputeReactor::ObserveCompute(const ComputeOutcome& outcome) {
  ServerMetrics* m = service_->metrics();
  m->ObservePhase("Compute", "queue", outcome.queue_seconds + queue_seconds_);
  if (!outcome.status.ok()) return;
  m->ObservePhase("Compute", "compute", outcome.stats.compute_seconds);
  m->AddTokens(static_cast<double>(outcome.tokens));
  m->AddFlops(plan_->flops());
  m->AddGemmTunings(static_cast<double>(outcome.stats.gemm_tunings));
  if (outcome.stats.compute_seconds > 0) {
    m->SetLastTflops(plan_->flops() / outcome.stats.compute_seconds * 1e-12);
  }
}

// The summary of a compute (results, and the outputs that follow with their specs); with
// `outcome` null, the preliminary one of an overlapped Compute (the outputs alone).
v1::ComputeResponse ComputeReactor::Summary(const ComputeOutcome* outcome) {
  v1::ComputeResponse response;
  v1::ComputeSummary* s = response.mutable_summary();
  if (outcome != nullptr) {
    s->set_loss(outcome->loss);
    s->set_z_loss(outcome->z_loss);
    s->set_accuracy(outcome->accuracy);
    s->set_tokens(outcome->tokens);
    s->set_compute_seconds(outcome->stats.compute_seconds);
    s->set_accumulated_micro_batches(outcome->accumulated_micro_batches);
    if (plan_->kind == LossKind::kPolicy) {
      s->set_kl(outcome->kl);
      s->set_clip_fraction(outcome->clip_fraction);
    }
    if (plan_->head != nullptr) {
      s->set_head_version(outcome->head_version);
      s->set_head_added(outcome->head_added);
    }
    if (!outcome->ticket.empty()) {
      s->set_ticket(outcome->ticket);
      s->set_ticket_expires_unix_ms(outcome->ticket_expires_unix_ms);
    }
    for (v1::TensorId t : NonFiniteToWire(outcome->stats.nonfinite)) s->add_nonfinite(t);
  } else {
    s->set_preliminary(true);
  }
  s->set_backend(engine_->backend_info().name);
  s->set_instance(service_->options().instance);
  for (const OutputDesc& d : plan_->outputs) {
    s->add_tensors(OutputSlotToWire(d.slot));
    *s->add_specs() = TensorSpecToWire(d.dtype, d.shape);
  }
  return response;
}

// Sends the next part of the current output, or finishes when all are sent.
void ComputeReactor::SendNext() {
  while (output_ < plan_->outputs.size() && offset_ >= plan_->outputs[output_].bytes) {
    ++output_;
    offset_ = 0;
  }
  if (output_ == plan_->outputs.size()) {
    service_->metrics()->ObservePhase("Compute", "send", SecondsSince(send_started_));
    service_->metrics()->AddBytesOut(static_cast<double>(bytes_out_));
    FinishOnce(absl::OkStatus());
    return;
  }
  offset_ += EncodeOutputPart(output_, offset_, plan_->outputs[output_].bytes);
  Write();
}

// Sets response_ to the part of output `i` that starts at `offset`, at most
// response_part_bytes_ and not past `end`; returns its size.
uint64_t ComputeReactor::EncodeOutputPart(size_t i, uint64_t offset, uint64_t end) {
  const uint64_t n = std::min<uint64_t>(response_part_bytes_, end - offset);
  response_ = wire::EncodePartSlice(OutputSlotToWire(plan_->outputs[i].slot), offset,
                                      OutputSlice(outputs_, (*outputs_)[i].get() + offset, n));
  bytes_out_ += n;
  return n;
}

void ComputeReactor::FinishOnce(absl::Status s) {
  uint64_t bytes_out = 0;
  {
    absl::MutexLock lock(&mu_);
    if (state_ == State::kFinished) return;
    SetStateLocked(State::kFinished);
    bytes_out = bytes_out_;
  }
  // A micro-batch added into an accumulator decides what the client may be told (and marks
  // the sum partial where it cannot be trusted); an OK is held until OnDone.
  s = contribution_.Settle(std::move(s), ctx_->IsCancelled());
  const uint64_t bytes_in = assembler_ != nullptr ? assembler_->bytes_received() : 0;
  inputs_.reset();
  assembler_.reset();
  outputs_.reset();  // the buffers go back once gRPC has released every slice of them
  admission_.Release();
  grpc::Status g =
      RecordCall(service_, *ctx_, "Compute", request_id_, started_, s, bytes_in, bytes_out);
  if (entered_) service_->Leave(client_);
  Finish(g);
}

}  // namespace lossd
