#include "service/loss_service.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "wire/part_codec.h"
#include "service/compute_assembler.h"
#include "engine/features.h"
#include "engine/message_bounds.h"
#include "engine/response_parts.h"
#include "engine/streamed_rows.h"
#include "service/log.h"
#include "service/principal.h"
#include "service/status_util.h"
#include "service/tsan_annotations.h"
#include "wire/unknown_fields.h"
#include "service/wire_convert.h"

namespace lossd {
namespace {

double SecondsSince(absl::Time t) { return absl::ToDoubleSeconds(absl::Now() - t); }

// The name of a tensor id for messages, also for ids the enum does not know.
std::string TensorIdName(int32_t id) {
  return v1::TensorId_IsValid(id) ? v1::TensorId_Name(static_cast<v1::TensorId>(id))
                                  : absl::StrCat(id);
}

// Parses one Compute stream message into `frame`, refusing fields this server does not know.
absl::Status ParseComputeFrame(const grpc::ByteBuffer& message, client::StreamFrame* frame) {
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

// Output buffers shared by the reactor and the response slices that point into them: gRPC
// may hold a sent slice a little after its write completes, so the buffers go back to the
// pool when the last of them is released, never while the transport can still read them.
using SharedOutputs = std::shared_ptr<std::vector<HostBuffer>>;

void ReleaseOutputs(void* hold) { delete static_cast<SharedOutputs*>(hold); }

// A slice over bytes [data, data + n) of one of `outputs`' buffers, no copy.
grpc::Slice OutputSlice(const SharedOutputs& outputs, const uint8_t* data, size_t n) {
  // gRPC never writes through a send slice; the cast only satisfies grpc_slice's type.
  return grpc::Slice(const_cast<uint8_t*>(data), n, &ReleaseOutputs,
                     new SharedOutputs(outputs));
}

// ---------------------------------------------------------------------------------------
// Compute: header -> admission -> parts -> compute (executor) -> summary + output parts.
// Served as a raw method: request parts are parsed in place (client::StreamFrame) and copied
// once, straight into the request's host buffer; response parts are slices of the output
// buffers, so lossd copies no returned byte (see bench/service/README.md, copy counts).
// Lifetime: the reactor deletes itself in OnDone, which gRPC calls only after Finish; Finish is
// never called while a compute job holds `this`, so the job never sees a dead reactor.
class ComputeReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ComputeReactor(LossService* service, grpc::CallbackServerContext* ctx)
      : service_(service),
        ctx_(ctx),
        engine_(service->engine()),
        started_(absl::Now()),
        idle_(service->idle_watch().Watch([ctx] { ctx->TryCancel(); })) {
    absl::Status s = service_->Enter(ctx, "Compute", &client_);
    if (!s.ok()) {
      entered_ = false;
      FinishOnce(s);
      return;
    }
    idle_->Arm();  // waiting for the header
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
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
    } else if (state_ == State::kHeader) {
      s = OnHeader();
    } else {
      s = OnPart();
      if (s.ok()) StartRead(&request_);
    }
    if (!s.ok()) FinishOnce(s);
  }

  void OnWriteDone(bool ok) override {
    idle_->WriteDone();
    if (overlap_) {
      {
        absl::MutexLock lock(&mu_);
        writing_ = false;
        if (!ok && error_.ok()) error_ = WriteFailed();
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

  void OnCancel() override {
    // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
    // Released when OnCancel returns, after the hook's read of service_ too: released at the
    // end of HandleCancel, that read looked to TSan like a race with OnDone's delete.
    LOSSD_TSAN_RELEASE_ON_EXIT(this);
    HandleCancel();
    if (service_->options().compute_cancel_hook) service_->options().compute_cancel_hook();
  }

  void HandleCancel() {
    uint64_t ticket = 0;
    std::shared_ptr<StreamedRows> rows;
    {
      absl::MutexLock lock(&mu_);
      // No read is pending while the header is handled, so nothing else would end the call
      // then: OnHeader checks this before it reserves memory and after it has the ticket.
      cancel_seen_ = true;
      rows = rows_;
      if (state_ != State::kAdmitting) {
        // Pending reads/writes or the job finish us; an overlapped compute waiting for rows
        // of X that will never come is let go at once.
        if (rows != nullptr) rows->Fail(Cancelled());
        return;
      }
      // Reserve has not returned the ticket yet: OnHeader withdraws it when it does.
      if (ticket_ == 0) return;
      ticket = ticket_;
    }
    engine_->budget().Cancel(ticket);  // its callback fails the call with CANCELLED
  }

  void OnDone() override {
    LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
    service_->idle_watch().Unwatch(idle_);
    if (ok_added_ != nullptr && ctx_->IsCancelled()) {
      // Finished OK, but the status never reached the client (it gave up at the last
      // moment): it sees a failure, so the added micro-batch is one. On the executor, which
      // the accumulator's lock may keep busy for a whole compute.
      engine_->Submit([acc = std::move(ok_added_), resets = ok_added_resets_] {
        Engine::MarkPartial(*acc, resets);
      });
    }
    LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
    delete this;
  }

 private:
  enum class State { kHeader, kAdmitting, kReceiving, kComputing, kSending, kFinished };

  // Why a cancelled call ended: the client cancelled it, or the idle watch did.
  absl::Status Cancelled() const {
    if (idle_->expired()) {
      return absl::DeadlineExceededError(
          absl::StrCat("the Compute was cancelled by the server: ", idle_->Reason()));
    }
    return absl::CancelledError("the client cancelled the Compute");
  }

  // Why a write failed: the idle watch found the client not reading, or it went away.
  absl::Status WriteFailed() const {
    if (idle_->expired()) return Cancelled();
    return absl::CancelledError("the client went away while results were being sent");
  }

  // Every response message goes out here: the client has --stream_idle_timeout to take it.
  void Write() {
    idle_->WriteStarted();
    StartWrite(&response_);
  }

  absl::Status OnHeader() {
    if (service_->options().compute_header_hook) service_->options().compute_header_hook();
    if (frame_.kind() != client::StreamFrame::Kind::kHeader) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the first message of a Compute stream must be a header, got ",
          frame_.kind() == client::StreamFrame::Kind::kPart
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
      if (cancel_seen_) return Cancelled();  // cancelled while parsed: never queued
      state_ = State::kAdmitting;
    }
    idle_->Disarm();  // waiting for memory, not for the client
    const std::string what = absl::StrCat("Compute of (BT=", plan_->bt, ", H=", plan_->h,
                                          ", V=", plan_->v, ")");
    uint64_t ticket = 0;
    // The callback may run before Reserve returns (memory free now) or later, on the thread
    // that releases memory; either way it resumes reading.
    absl::Status s = engine_->budget().Reserve(
        plan_->admission_bytes(), what, [this](absl::Status st) { OnAdmitted(st); }, &ticket);
    if (!s.ok()) return s;
    bool withdraw = false;
    {
      absl::MutexLock lock(&mu_);
      ticket_ = ticket;
      withdraw = cancel_seen_;
    }
    // OnCancel ran after the check above but before the ticket was stored, so it left the
    // withdrawal to us. Cancel is a no-op once granted (the callback runs exactly once either
    // way); a granted call ends on its next read, which fails on a cancelled stream.
    if (withdraw) engine_->budget().Cancel(ticket);
    return absl::OkStatus();
  }

  void OnAdmitted(absl::Status s) {
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      admitted_bytes_ = plan_->admission_bytes();
      state_ = State::kReceiving;
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

  absl::Status OnPart() {
    if (frame_.kind() == client::StreamFrame::Kind::kHeader) {
      return absl::InvalidArgumentError("the Compute stream carries a second header");
    }
    if (frame_.kind() != client::StreamFrame::Kind::kPart) {
      return absl::InvalidArgumentError("a Compute message carries neither header nor part");
    }
    return assembler_->Accept(frame_.tensor(), frame_.offset(), frame_.data_pieces(),
                              frame_.data_size());
  }

  absl::Status EndOfStream() {
    idle_->Disarm();
    if (ctx_->IsCancelled()) return Cancelled();
    if (state_ == State::kHeader) {
      return absl::InvalidArgumentError("the Compute stream closed before its header");
    }
    absl::Status complete = ReceiveComplete();
    if (!complete.ok()) return complete;
    if (ctx_->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("the deadline passed before the compute started");
    }
    {
      absl::MutexLock lock(&mu_);
      state_ = State::kComputing;
    }
    inputs_ = assembler_->buffers();
    const bool checked = assembler_->finite_checked();
    assembler_.reset();
    frame_ = client::StreamFrame();  // drops the last received message
    engine_->Run(
        plan_, inputs_, [this](ComputeOutcome outcome) { OnComputed(std::move(outcome)); },
        absl::FromChrono(ctx_->deadline()), checked, OverlapIo{},
        [this] { return ctx_->IsCancelled(); });
    return absl::OkStatus();
  }

  // The client closed its side: every input must be complete; records the receive phase.
  absl::Status ReceiveComplete() {
    absl::Status complete = assembler_->CheckComplete();
    if (!complete.ok()) return complete;
    ServerMetrics* m = service_->metrics();
    m->ObservePhase("Compute", "receive", SecondsSince(receive_started_));
    m->AddBytesIn(static_cast<double>(assembler_->bytes_received()));
    return absl::OkStatus();
  }

  // Runs on the executor thread.
  void OnComputed(ComputeOutcome outcome) {
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
    v1::ComputeResponse response = Summary(outcome);
    {
      absl::MutexLock lock(&mu_);
      state_ = State::kSending;
    }
    send_started_ = absl::Now();
    response_ = client::EncodeMessage(response);
    Write();
  }

  // From here a failure of the call leaves the accumulator's sum in doubt (FinishOnce).
  void NoteAdded(const ComputeOutcome& outcome) {
    if (outcome.added_to == nullptr) return;
    absl::MutexLock lock(&mu_);
    added_to_ = outcome.added_to;
    added_resets_ = outcome.added_resets;
  }

  // The queue and compute metrics of a finished compute job (the compute ones if it worked).
  void ObserveCompute(const ComputeOutcome& outcome) {
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
  v1::ComputeResponse Summary(const ComputeOutcome* outcome) {
    v1::ComputeResponse response;
    v1::ComputeSummary* s = response.mutable_summary();
    if (outcome != nullptr) {
      s->set_loss(outcome->loss);
      s->set_z_loss(outcome->z_loss);
      s->set_accuracy(outcome->accuracy);
      s->set_tokens(outcome->tokens);
      s->set_compute_seconds(outcome->stats.compute_seconds);
      s->set_accumulated_micro_batches(outcome->accumulated_micro_batches);
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
  v1::ComputeResponse Summary(const ComputeOutcome& outcome) { return Summary(&outcome); }

  // Sends the next part of the current output, or finishes when all are sent.
  void SendNext() {
    while (output_ < plan_->outputs.size() &&
           offset_ >= plan_->outputs[output_].bytes) {
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
  uint64_t EncodeOutputPart(size_t i, uint64_t offset, uint64_t end) {
    const uint64_t n = std::min<uint64_t>(response_part_bytes_, end - offset);
    response_ = client::EncodePartSlice(OutputSlotToWire(plan_->outputs[i].slot), offset,
                                        OutputSlice(outputs_, (*outputs_)[i].get() + offset, n));
    bytes_out_ += n;
    return n;
  }

  // --- Overlapped Compute (ComputeHeader.overlap) ---------------------------------------
  // Reads, the compute and writes run at once: the compute starts once every input but X is
  // in and takes X's rows as they arrive (StreamedRows); dX parts go out as the backend
  // reports rows final; the final summary goes last. Every event (a read, a write done, dX
  // rows, the compute's end) ends in Progress(), which under mu_ picks the one next write or
  // the finish. The call finishes only when no compute job holds `this`, no write is in
  // flight and no read is being handled (a read still pending is fine: Finish ends it).

  // After admission: the preliminary summary (outputs and specs) goes out while X comes in.
  void StartOverlap() {
    outputs_ = std::make_shared<std::vector<HostBuffer>>(Engine::NewOutputs(*plan_));
    for (size_t i = 0; i < plan_->outputs.size(); ++i) {
      if (plan_->outputs[i].slot == OutputSlot::kDx) dx_output_ = static_cast<int>(i);
    }
    v1::ComputeResponse response = Summary(nullptr);
    {
      absl::MutexLock lock(&mu_);
      writing_ = true;
      handling_read_ = true;
      response_ = client::EncodeMessage(response);
    }
    Write();
    // Nothing but X to wait for (BT = 0 and every other input empty): start at once.
    absl::Status s_start = MaybeStartCompute();
    if (!s_start.ok()) {
      FailOverlap(s_start);
    } else {
      StartRead(&request_);
    }
    EndHandlingRead();
  }

  void OnOverlapReadDone(bool ok) {
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kFinished) return;
      handling_read_ = true;
    }
    absl::Status s;
    bool more = false;
    if (!ok) {
      s = OverlapEndOfStream();
    } else if (absl::Status parsed = ParseComputeFrame(request_, &frame_); !parsed.ok()) {
      s = parsed;
    } else {
      s = OnPart();
      if (s.ok()) s = MaybeStartCompute();
      if (s.ok() && rows_ != nullptr) rows_->Arrived(assembler_->XRowsReady());
      more = s.ok();
    }
    if (!s.ok()) {
      FailOverlap(s);
    } else if (more) {
      StartRead(&request_);
    }
    EndHandlingRead();
  }

  // Runs on the reactor's thread while it handles a read.
  absl::Status MaybeStartCompute() {
    if (rows_ != nullptr || !assembler_->AllButXComplete()) return absl::OkStatus();
    // Start before all of X is in only while the executor is idle: overlap is for hiding the
    // wire from a device that would otherwise wait. With other computes queued or running, an
    // early start would hold the executor on this stream's rows while theirs are all in, so
    // this one is submitted once its X is complete (a later part or the end of the stream
    // checks again).
    if (assembler_->XRowsReady() < plan_->bt && !service_->options().overlap_start_when_busy &&
        !engine_->executor_idle()) {
      return absl::OkStatus();
    }
    if (ctx_->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("the deadline passed before the compute started");
    }
    auto rows = std::make_shared<StreamedRows>(
        plan_->bt, engine_->options().overlap_stall, absl::FromChrono(ctx_->deadline()),
        [this](int64_t) { OnDxRows(); });
    rows->Arrived(assembler_->XRowsReady());
    {
      absl::MutexLock lock(&mu_);
      rows_ = rows;
      computing_ = true;
    }
    idle_->Disarm();  // from here a stall of X fails the compute (--overlap_stall)
    engine_->Run(
        plan_, assembler_->buffers(),
        [this](ComputeOutcome outcome) { OnOverlapComputed(std::move(outcome)); },
        absl::FromChrono(ctx_->deadline()), assembler_->finite_checked(),
        OverlapIo{rows, outputs_}, [this] { return ctx_->IsCancelled() || Failed(); });
    return absl::OkStatus();
  }

  absl::Status OverlapEndOfStream() {
    idle_->Disarm();
    if (ctx_->IsCancelled()) return Cancelled();
    absl::Status complete = ReceiveComplete();
    if (!complete.ok()) return complete;
    absl::Status s = MaybeStartCompute();  // X came before the other inputs: start now
    if (!s.ok()) return s;
    absl::MutexLock lock(&mu_);
    read_done_ = true;
    return absl::OkStatus();
  }

  void EndHandlingRead() {
    {
      absl::MutexLock lock(&mu_);
      handling_read_ = false;
    }
    Progress();
  }

  // The call has already failed (a job still queued then does not start).
  bool Failed() {
    absl::MutexLock lock(&mu_);
    return !error_.ok();
  }

  // The first failure wins; the compute, if running, stops at the next rows it waits for.
  void FailOverlap(const absl::Status& s) {
    {
      absl::MutexLock lock(&mu_);
      if (error_.ok()) error_ = s;
    }
    FailRows();
  }
  void FailRows() {
    std::shared_ptr<StreamedRows> rows;
    absl::Status why;
    {
      absl::MutexLock lock(&mu_);
      rows = rows_;
      why = error_;
    }
    if (rows != nullptr && !why.ok()) rows->Fail(why);
  }

  // On the backend's thread (a device callback for CUDA): more rows of dX are final
  // (rows_->dx_ready() says how many).
  void OnDxRows() { Progress(); }

  // On the executor thread.
  void OnOverlapComputed(ComputeOutcome outcome) {
    ObserveCompute(outcome);
    NoteAdded(outcome);
    v1::ComputeResponse response = Summary(outcome);
    // Recorded inside Progress's critical section, not in one of its own before it: once
    // computing_ is false (or computed_ true) another thread's Progress may finish the call,
    // and gRPC delete this reactor, before this thread's Progress locks mu_ again.
    Progress([&] {
      computing_ = false;
      if (!outcome.status.ok() && error_.ok()) error_ = outcome.status;
      if (outcome.status.ok()) {
        computed_ = true;
        final_summary_ = std::move(response);
      }
      send_started_ = absl::Now();
    });
  }

  // Picks the next write, or finishes the call; any thread. `update` runs first, under mu_.
  // Once it returns, a caller that is not a gRPC reaction (nothing holds the call open for
  // it) may touch the reactor no more: the write or the finish it started is its last step.
  void Progress(absl::FunctionRef<void()> update = [] {}) {
    absl::Status finish;
    bool write = false, done = false;
    double send_seconds = 0, bytes_out = 0;
    {
      absl::MutexLock lock(&mu_);
      update();
      if (state_ == State::kFinished || finishing_ || writing_) return;
      if (!error_.ok()) {
        if (computing_ || handling_read_) return;  // they call Progress when they end
        finish = error_;
        done = true;
      } else if (NextOverlapWriteLocked()) {
        writing_ = true;
        write = true;
      } else if (computed_ && read_done_ && !handling_read_) {
        if (!final_sent_) {
          final_sent_ = true;
          writing_ = true;
          write = true;
          response_ = client::EncodeMessage(final_summary_);
        } else {
          done = true;
          // The part of sending the compute did not hide: from its end to the last write.
          send_seconds = SecondsSince(send_started_);
          bytes_out = static_cast<double>(bytes_out_);
        }
      }
      // One Progress finishes: a second that also found the call done could reach FinishOnce
      // after the first's Finish had let gRPC delete the reactor.
      if (done) finishing_ = true;
    }
    if (write) {
      Write();
    } else if (done) {
      if (finish.ok()) {
        service_->metrics()->ObservePhase("Compute", "send", send_seconds);
        service_->metrics()->AddBytesOut(bytes_out);
      }
      FinishOnce(finish);
    }
  }

  // Sets response_ to the next output part that may go now: dX up to the rows reported, and
  // once the compute is done the rest of dX and every other output. False: nothing yet.
  bool NextOverlapWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (dx_output_ >= 0) {
      const OutputDesc& d = plan_->outputs[dx_output_];
      const uint64_t row_bytes = plan_->bt > 0 ? d.bytes / plan_->bt : 0;
      // Once the compute is done every row is final, reported or not.
      const int64_t rows = computed_ ? plan_->bt : rows_ != nullptr ? rows_->dx_ready() : 0;
      const uint64_t ready = static_cast<uint64_t>(rows) * row_bytes;
      if (dx_sent_ < ready) {
        dx_sent_ += EncodeOutputPart(dx_output_, dx_sent_, ready);
        return true;
      }
    }
    if (!computed_) return false;
    while (output_ < plan_->outputs.size() &&
           (static_cast<int>(output_) == dx_output_ ||
            offset_ >= plan_->outputs[output_].bytes)) {
      ++output_;
      offset_ = 0;
    }
    if (output_ == plan_->outputs.size()) return false;
    offset_ += EncodeOutputPart(output_, offset_, plan_->outputs[output_].bytes);
    return true;
  }

  void FinishOnce(absl::Status s) {
    uint64_t release = 0;
    std::shared_ptr<Accumulator> added_to;
    uint64_t added_resets = 0;
    uint64_t bytes_out = 0;
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kFinished) return;
      state_ = State::kFinished;
      release = admitted_bytes_;
      admitted_bytes_ = 0;
      added_to = std::move(added_to_);
      added_resets = added_resets_;
      bytes_out = bytes_out_;
    }
    if (s.ok() && added_to != nullptr && ctx_->IsCancelled()) {
      // Every result was written, but the client gave up before the status: it can only
      // see a failure, so this is one.
      s = absl::CancelledError("the call was cancelled before its OK status went out");
    }
    if (!s.ok() && added_to != nullptr) {
      // Added, but the client hears of a failure (a retry would add it twice): the sum is
      // marked partial rather than trusted, as after a failed update.
      s = absl::Status(s.code(), absl::StrCat(s.message(),
                                              Engine::MarkPartial(*added_to, added_resets)));
    } else if (added_to != nullptr) {
      ok_added_ = std::move(added_to);  // OnDone: did the OK reach the client?
      ok_added_resets_ = added_resets;
    }
    const uint64_t bytes_in = assembler_ != nullptr ? assembler_->bytes_received() : 0;
    inputs_.reset();
    assembler_.reset();
    outputs_.reset();  // the buffers go back once gRPC has released every slice of them
    if (release > 0) engine_->budget().Release(release);
    grpc::Status g = ToGrpcStatus(s);
    ServerMetrics* m = service_->metrics();
    m->CountRequest("Compute", GrpcCodeName(g.error_code()));
    m->ObservePhase("Compute", "total", SecondsSince(started_));
    LogCall({"Compute", ctx_->peer(), GrpcCodeName(g.error_code()), g.error_message(),
             absl::Now() - started_, bytes_in, bytes_out});
    if (entered_) service_->Leave(client_);
    Finish(g);
  }

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  Engine* const engine_;
  const absl::Time started_;
  const std::shared_ptr<IdleWatch::Entry> idle_;  // armed while waiting for the client
  bool entered_ = true;
  std::string client_;  // for the per-client in-flight count

  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kHeader;
  std::shared_ptr<Accumulator> added_to_ ABSL_GUARDED_BY(mu_);  // see NoteAdded
  uint64_t added_resets_ ABSL_GUARDED_BY(mu_) = 0;
  // A call that finished OK after adding (FinishOnce), checked again in OnDone.
  std::shared_ptr<Accumulator> ok_added_;
  uint64_t ok_added_resets_ = 0;
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;  // 0 until Reserve returns (no ticket is 0)
  bool cancel_seen_ ABSL_GUARDED_BY(mu_) = false;  // OnCancel has run
  uint64_t admitted_bytes_ ABSL_GUARDED_BY(mu_) = 0;

  // Overlapped Compute only.
  bool overlap_ = false;
  int dx_output_ = -1;  // index of dX in plan_->outputs
  std::shared_ptr<StreamedRows> rows_;  // set once, on the reactor's thread, under mu_
  bool computing_ ABSL_GUARDED_BY(mu_) = false;
  bool computed_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool handling_read_ ABSL_GUARDED_BY(mu_) = false;
  bool read_done_ ABSL_GUARDED_BY(mu_) = false;
  bool final_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;  // a Progress has decided to finish the call
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  uint64_t dx_sent_ ABSL_GUARDED_BY(mu_) = 0;
  v1::ComputeResponse final_summary_ ABSL_GUARDED_BY(mu_);

  grpc::ByteBuffer request_;
  client::StreamFrame frame_;  // request_ parsed in place
  grpc::ByteBuffer response_;
  std::shared_ptr<const ComputePlan> plan_;
  std::shared_ptr<Engine::InputBuffers> inputs_;
  std::unique_ptr<ComputeAssembler> assembler_;
  SharedOutputs outputs_;  // one per plan_->outputs, same order
  uint32_t response_part_bytes_ = 4u << 20;
  size_t output_ = 0;
  uint64_t offset_ = 0;
  uint64_t bytes_out_ = 0;
  double queue_seconds_ = 0;
  absl::Time receive_started_;
  absl::Time send_started_;
};

// ---------------------------------------------------------------------------------------
// PutWeights: header, then W (and bias) parts copied straight into backend memory. A striped
// upload (header.upload_id set) is one of several streams; the engine joins them, and this
// reactor waits, without blocking, for the last stripe to make the handle.
class PutWeightsReactor final : public grpc::ServerReadReactor<v1::PutWeightsRequest> {
 public:
  PutWeightsReactor(LossService* service, grpc::CallbackServerContext* ctx,
                    v1::PutWeightsResponse* response)
      : service_(service),
        ctx_(ctx),
        response_(response),
        started_(absl::Now()),
        idle_(service->idle_watch().Watch([ctx] { ctx->TryCancel(); })) {
    absl::Status s = service_->Enter(ctx, "PutWeights", &client_);
    if (!s.ok()) {
      entered_ = false;
      FinishOnce(s);
      return;
    }
    // Armed until the weights are committed: a stripe done with its own range waits for its
    // siblings, which are the same client, and follows their activity (see OnMessage).
    idle_->Arm();
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      idle_->Touch();
      if (stripe_) stripe_->activity_ns.store(IdleWatch::Entry::Now());
    }
    absl::Status s = ok ? OnMessage() : OnEnd();
    if (!s.ok()) {
      if (stripe_) service_->engine()->FailStripedUpload(stripe_, s);
      FinishOnce(s);
      return;
    }
    if (ok) StartRead(&request_);
  }

  void OnCancel() override {
    // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
    LOSSD_TSAN_RELEASE_ON_EXIT(this);
    // Only a stripe waiting for its siblings has no operation pending to report the cancel.
    if (waiting_.load() && stripe_) service_->engine()->FailStripedUpload(stripe_, Cancelled());
  }

  void OnDone() override {
    LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
    service_->idle_watch().Unwatch(idle_);
    LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
    delete this;
  }

 private:
  absl::Status OnMessage() {
    Engine* engine = service_->engine();
    if (absl::Status s = RefuseUnknownFields(request_, "PutWeightsRequest"); !s.ok()) return s;
    if (request_.has_header()) {
      if (pending_ || stripe_) {
        return absl::InvalidArgumentError("the PutWeights stream carries a second header");
      }
      const v1::WeightsHeader& h = request_.header();
      absl::Status size = CheckHeaderBytes(h.ByteSizeLong(), "the PutWeights header");
      if (!size.ok()) return size;
      auto w = TensorDescFromWire(h.has_w(), h.w(), "header.w");
      if (!w.ok()) return w.status();
      auto b = TensorDescFromWire(h.has_bias(), h.bias(), "header.bias");
      if (!b.ok()) return b.status();
      if (!h.upload_id().empty()) {
        carries_bias_ = b->present && h.w_begin() == 0;
        auto u = engine->JoinStripedUpload(client_, h.upload_id(), h.stripes(), *w, *b,
                                           h.w_begin(), h.w_end(), carries_bias_,
                                           service_->Principal(ctx_));
        if (!u.ok()) {
          engine->FailStripedUpload(client_, h.upload_id(), u.status());
          return u.status();
        }
        stripe_ = std::move(*u);
        stripe_->activity_ns.store(IdleWatch::Entry::Now());
        idle_->Follow(&stripe_->activity_ns);
        next_w_ = h.w_begin();
        w_end_ = h.w_end();
        bias_bytes_ = carries_bias_ ? stripe_->bias_bytes() : 0;
        upload_bytes_ = stripe_->w_bytes() + stripe_->bias_bytes();
        return absl::OkStatus();
      }
      if (h.stripes() != 0 || h.w_begin() != 0 || h.w_end() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "header.stripes (", h.stripes(), "), header.w_begin (", h.w_begin(),
            ") and header.w_end (", h.w_end(), ") describe one stripe of a striped upload "
            "and need header.upload_id, which is empty"));
      }
      auto p = engine->BeginPutWeights(*w, *b, service_->Principal(ctx_));
      if (!p.ok()) return p.status();
      pending_ = std::move(*p);
      return absl::OkStatus();
    }
    if (!pending_ && !stripe_) {
      return absl::InvalidArgumentError(
          "the first message of a PutWeights stream must be a header");
    }
    const v1::TensorPart& part = request_.part();
    if (part.tensor() != v1::TENSOR_W && part.tensor() != v1::TENSOR_BIAS) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PutWeights accepts parts of TENSOR_W and TENSOR_BIAS, got ",
          v1::TensorId_IsValid(part.tensor()) ? v1::TensorId_Name(part.tensor())
                                              : absl::StrCat(static_cast<int>(part.tensor()))));
    }
    const uint64_t size = part.data().size();
    if (++parts_ > service_->options().max_parts_per_request) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the stream sent more than --max_parts_per_request=",
          service_->options().max_parts_per_request, " parts; send larger parts"));
    }
    if (size > service_->options().max_part_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a part carries ", size, " bytes, more than --max_part_bytes=",
          service_->options().max_part_bytes));
    }
    bytes_in_ += size;
    const bool bias = part.tensor() == v1::TENSOR_BIAS;
    if (!stripe_) {
      return engine->WriteWeights(*pending_, bias, part.offset(), part.data().data(), size);
    }
    // A stripe: parts in order within its own range.
    uint64_t& next = bias ? next_bias_ : next_w_;
    const uint64_t limit = bias ? bias_bytes_ : w_end_;
    if (bias && !carries_bias_) {
      return absl::InvalidArgumentError(
          "a bias part arrived on a stripe that does not carry the bias (the stripe with "
          "w_begin 0 does)");
    }
    if (part.offset() != next) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a part of ", bias ? "bias" : "w", " starts at byte offset ", part.offset(),
          " but this stripe expects offset ", next,
          ": parts must arrive in order, without gaps or overlaps"));
    }
    if (size > limit - next) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a part of ", bias ? "bias" : "w", " at offset ", part.offset(), " with ", size,
          " bytes runs past the stripe's end at ", limit));
    }
    absl::Status s = engine->WriteStripe(*stripe_, bias, part.offset(), part.data().data(), size);
    if (s.ok()) next += size;
    return s;
  }

  // Why a cancelled call ended: the client cancelled it, or the idle watch did.
  absl::Status Cancelled() const {
    if (idle_->expired()) {
      return absl::DeadlineExceededError(
          absl::StrCat(stripe_ ? "a stripe" : "PutWeights", " was cancelled by the server: ",
                       idle_->Reason()));
    }
    return absl::CancelledError(stripe_ ? "a stripe was cancelled"
                                        : "the client cancelled PutWeights");
  }

  absl::Status OnEnd() {
    if (ctx_->IsCancelled()) return Cancelled();
    if (!pending_ && !stripe_) {
      return absl::InvalidArgumentError("the PutWeights stream closed before its header");
    }
    service_->metrics()->AddBytesIn(static_cast<double>(bytes_in_));
    if (stripe_) {
      if (next_w_ != w_end_ || next_bias_ != bias_bytes_) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the stripe closed early: w has ", next_w_, " of the bytes up to ", w_end_,
            carries_bias_ ? absl::StrCat(", bias ", next_bias_, " of ", bias_bytes_) : ""));
      }
      waiting_.store(true);
      service_->engine()->FinishStripe(stripe_, [this](absl::StatusOr<std::string> handle) {
        if (handle.ok()) {
          response_->set_handle(*handle);
          response_->set_bytes(upload_bytes_);
        }
        FinishOnce(handle.status());
      });
      return absl::OkStatus();
    }
    idle_->Disarm();
    const uint64_t bytes = pending_->entry->bytes();
    auto handle = service_->engine()->CommitWeights(std::move(pending_));
    if (!handle.ok()) return handle.status();
    response_->set_handle(*handle);
    response_->set_bytes(bytes);
    FinishOnce(absl::OkStatus());
    return absl::OkStatus();
  }

  void FinishOnce(const absl::Status& s) {
    if (finished_.exchange(true)) return;
    pending_.reset();  // an upload cut off half way leaves no handle and frees its memory
    grpc::Status g = ToGrpcStatus(s);
    service_->metrics()->CountRequest("PutWeights", GrpcCodeName(g.error_code()));
    service_->metrics()->ObservePhase("PutWeights", "total", SecondsSince(started_));
    LogCall({"PutWeights", ctx_->peer(), GrpcCodeName(g.error_code()), g.error_message(),
             absl::Now() - started_, bytes_in_, 0});
    if (entered_) service_->Leave(client_);
    Finish(g);
  }

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::PutWeightsResponse* const response_;
  const absl::Time started_;
  const std::shared_ptr<IdleWatch::Entry> idle_;  // armed while waiting for the client
  bool entered_ = true;
  std::string client_;  // for the per-client in-flight count
  std::atomic<bool> finished_{false};
  std::atomic<bool> waiting_{false};
  v1::PutWeightsRequest request_;
  std::unique_ptr<PendingWeights> pending_;
  uint64_t bytes_in_ = 0;
  // Striped uploads.
  std::shared_ptr<StripedUpload> stripe_;
  bool carries_bias_ = false;
  uint64_t next_w_ = 0, w_end_ = 0, next_bias_ = 0, bias_bytes_ = 0;
  uint64_t upload_bytes_ = 0;  // W and bias of the whole upload
  uint64_t parts_ = 0;
};

// ---------------------------------------------------------------------------------------
// FetchGradients: the snapshot is taken on the executor (after every Compute queued before
// it), then streamed as a header and DW / DB parts. A raw method: the parts are slices of the
// snapshot buffer, so lossd copies no byte of it on the way out.
class FetchGradientsReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  FetchGradientsReactor(LossService* service, grpc::CallbackServerContext* ctx,
                        const grpc::ByteBuffer* raw_request)
      : service_(service),
        ctx_(ctx),
        started_(absl::Now()),
        idle_(service->idle_watch().Watch([ctx] { ctx->TryCancel(); })) {
    absl::Status s = service_->Enter(ctx, "FetchGradients", &client_);
    if (!s.ok()) {
      entered_ = false;
      FinishOnce(s);
      return;
    }
    v1::FetchGradientsRequest request;
    if (!client::DecodeMessage(*raw_request, &request).ok()) {
      FinishOnce(absl::InvalidArgumentError(
          "the FetchGradients request is not a valid FetchGradientsRequest"));
      return;
    }
    s = RefuseUnknownFields(request, "FetchGradientsRequest");
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    const ServiceOptions& o = service_->options();
    auto part_bytes = ResponsePartBytes(request.response_part_bytes(),
                                        o.default_response_part_bytes, o.max_part_bytes,
                                        "response_part_bytes");
    if (!part_bytes.ok()) {
      FinishOnce(part_bytes.status());
      return;
    }
    part_bytes_ = *part_bytes;
    name_ = request.accumulator();
    reset_ = request.reset();
    range_begin_ = request.range_begin();
    range_end_ = request.range_end();
    // The host copy of the range comes out of the memory budget like a Compute's buffers:
    // fetches in parallel wait for memory instead of running the host out of it.
    Engine* engine = service_->engine();
    s = engine->CheckAccumulatorInstance(request.accumulator_instance(), name_,
                                         "accumulator_instance");
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    principal_ = service_->Principal(ctx);
    auto range = engine->CheckFetch(name_, reset_, range_begin_, range_end_, principal_);
    if (!range.ok()) {
      FinishOnce(range.status());
      return;
    }
    std::tie(range_begin_, range_end_) = *range;
    const uint64_t bytes = range_end_ - range_begin_;
    const std::string what = absl::StrCat("fetching bytes [", range_begin_, ", ", range_end_,
                                          ") of accumulator '", name_, "'");
    if (bytes > engine->budget().budget()) {
      FinishOnce(absl::ResourceExhaustedError(absl::StrCat(
          what, " needs a host copy of ", bytes, " bytes, more than the whole memory budget of ",
          engine->budget().budget(),
          " bytes (--memory_budget_bytes); fetch it in smaller ranges (range_begin, range_end)")));
      return;
    }
    uint64_t ticket = 0;
    s = engine->budget().Reserve(
        bytes, what, [this, bytes](absl::Status st) { OnAdmitted(st, bytes); }, &ticket);
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    absl::MutexLock lock(&mu_);
    ticket_ = ticket;
  }

  void OnCancel() override {
    // gRPC may run OnCancel from its own uninstrumented code; it returns before OnDone runs.
    LOSSD_TSAN_RELEASE_ON_EXIT(this);
    uint64_t ticket = 0;
    {
      absl::MutexLock lock(&mu_);
      if (!admitting_) return;  // the snapshot or its writes finish the call
      ticket = ticket_;
    }
    // Still waiting for memory: withdrawn, its callback fails the call with CANCELLED.
    service_->engine()->budget().Cancel(ticket);
  }

  void OnWriteDone(bool ok) override {
    idle_->WriteDone();
    if (!ok) {
      FinishOnce(idle_->expired()
                     ? absl::DeadlineExceededError(absl::StrCat(
                           "the FetchGradients was cancelled by the server: ", idle_->Reason()))
                     : absl::CancelledError(
                           "the client went away while gradients were being sent"));
      return;
    }
    SendNext();
  }

  void OnDone() override {
    LOSSD_TSAN_ACQUIRE(this);  // every other reaction has returned (see OnCancel)
    service_->idle_watch().Unwatch(idle_);
    if (ok_reset_ && ctx_->IsCancelled()) {
      // Finished OK, but the status never reached the client (it gave up at the last
      // moment): it sees a failure, so the reset is undone as for one (on the executor; the
      // reactor is gone by then, so the job owns what it needs).
      Engine* engine = service_->engine();
      auto snapshot = std::make_shared<GradientsSnapshot>(std::move(snapshot_));
      engine->Submit([engine, snapshot, data = std::move(data_)] {
        engine->UndoReset(*snapshot, (*data)[0].get());
      });
    }
    LOSSD_TSAN_RELEASE(service_);  // the server's shutdown returns after every OnDone
    delete this;
  }

 private:
  // Runs once, from Reserve or from whichever thread released the memory it waited for.
  void OnAdmitted(absl::Status s, uint64_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      admitting_ = false;
      if (s.ok()) admitted_bytes_ = bytes;
    }
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    service_->engine()->Submit([this] { TakeSnapshot(); });
  }

  void TakeSnapshot() {
    if (ctx_->IsCancelled()) {
      // Gone while it waited for memory or the executor: nothing is read, nothing reset.
      FinishOnce(absl::CancelledError(
          "the call was cancelled before its snapshot was taken; nothing was read or reset"));
      return;
    }
    auto g = service_->engine()->FetchGradients(name_, reset_, range_begin_, range_end_,
                                                principal_);
    if (!g.ok()) {
      FinishOnce(g.status());
      return;
    }
    snapshot_ = std::move(*g);
    data_ = std::make_shared<std::vector<HostBuffer>>();
    data_->push_back(std::move(snapshot_.data));
    v1::FetchGradientsResponse response;
    v1::GradientsHeader* h = response.mutable_header();
    *h->mutable_dw() = TensorSpecToWire(DType::kF32, {snapshot_.v, snapshot_.h});
    if (snapshot_.has_bias) *h->mutable_db() = TensorSpecToWire(DType::kF32, {snapshot_.v});
    h->set_micro_batches(snapshot_.micro_batches);
    h->set_tokens(snapshot_.tokens);
    h->set_instance(service_->options().instance);
    offset_ = snapshot_.begin;
    response_ = client::EncodeMessage(response);
    idle_->WriteStarted();  // the client has --stream_idle_timeout to take it
    StartWrite(&response_);
  }

  // Sends the snapshot's bytes as parts of DW and DB (a part never straddles the two).
  void SendNext() {
    const uint64_t dw_bytes = snapshot_.dw_bytes();
    if (offset_ >= snapshot_.end) {
      service_->metrics()->AddBytesOut(static_cast<double>(snapshot_.end - snapshot_.begin));
      FinishOnce(absl::OkStatus());
      return;
    }
    const bool in_db = offset_ >= dw_bytes;
    const uint64_t tensor_end = in_db ? snapshot_.end : std::min(snapshot_.end, dw_bytes);
    const uint64_t n = std::min<uint64_t>(part_bytes_, tensor_end - offset_);
    response_ = client::EncodePartSlice(
        in_db ? v1::TENSOR_DB : v1::TENSOR_DW, in_db ? offset_ - dw_bytes : offset_,
        OutputSlice(data_, (*data_)[0].get() + (offset_ - snapshot_.begin), n));
    offset_ += n;
    idle_->WriteStarted();  // the client has --stream_idle_timeout to take it
    StartWrite(&response_);
  }

  void FinishOnce(absl::Status s) {
    if (finished_.exchange(true)) return;
    if (s.ok() && snapshot_.reset_of != nullptr && ctx_->IsCancelled()) {
      // Every part was written, but the client gave up before the status: it can only see a
      // failure, so this is one.
      s = absl::CancelledError("the call was cancelled before its OK status went out");
    }
    if (!s.ok() && snapshot_.reset_of != nullptr && data_ != nullptr) {
      // The accumulator was reset for data that did not arrive: put the sum back, on the
      // executor (after the computes queued before it; a copy of a large dW blocks).
      service_->engine()->Submit([this, s] {
        const std::string said = service_->engine()->UndoReset(snapshot_, (*data_)[0].get());
        FinishNow(absl::Status(s.code(), absl::StrCat(s.message(), said)));
      });
      return;
    }
    FinishNow(s);
  }

  void FinishNow(const absl::Status& s) {
    // The buffer goes back once gRPC has released every slice of it; a reset fetch that went
    // well keeps it until OnDone says whether the OK reached the client.
    ok_reset_ = s.ok() && snapshot_.reset_of != nullptr && data_ != nullptr;
    if (!ok_reset_) data_.reset();
    uint64_t release = 0;
    {
      absl::MutexLock lock(&mu_);
      release = admitted_bytes_;
      admitted_bytes_ = 0;
    }
    if (release > 0) service_->engine()->budget().Release(release);
    grpc::Status g = ToGrpcStatus(s);
    service_->metrics()->CountRequest("FetchGradients", GrpcCodeName(g.error_code()));
    service_->metrics()->ObservePhase("FetchGradients", "total", SecondsSince(started_));
    LogCall({"FetchGradients", ctx_->peer(), GrpcCodeName(g.error_code()), g.error_message(),
             absl::Now() - started_, 0, offset_ > snapshot_.begin ? offset_ - snapshot_.begin : 0});
    if (entered_) service_->Leave(client_);
    Finish(g);
  }

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const absl::Time started_;
  // Never armed (the call reads nothing after its request): times the writes alone.
  const std::shared_ptr<IdleWatch::Entry> idle_;
  bool entered_ = true;
  std::string client_;  // for the per-client in-flight count
  std::atomic<bool> finished_{false};
  std::string name_;
  std::string principal_;  // who may fetch (service/principal.h)
  bool reset_ = false;
  uint64_t range_begin_ = 0, range_end_ = 0;
  uint32_t part_bytes_ = 4u << 20;
  absl::Mutex mu_;
  bool admitting_ ABSL_GUARDED_BY(mu_) = true;  // until the memory budget answers
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t admitted_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // released when the call finishes
  GradientsSnapshot snapshot_;  // its data moved into data_
  SharedOutputs data_;
  bool ok_reset_ = false;  // finished OK after a reset: checked again in OnDone
  grpc::ByteBuffer response_;
  uint64_t offset_ = 0;
};

// A unary call: refuse unknown fields in `request`, run `body`, record metrics, finish.
template <typename Body>
grpc::ServerUnaryReactor* Unary(LossService* service, grpc::CallbackServerContext* ctx,
                                const char* method, const google::protobuf::Message& request,
                                Body body) {
  const absl::Time started = absl::Now();
  std::string client;
  absl::Status s = service->Enter(ctx, method, &client);
  if (s.ok()) {
    s = RefuseUnknownFields(request, request.GetDescriptor()->name());
    if (s.ok()) s = body();
    service->Leave(client);
  }
  grpc::Status g = ToGrpcStatus(s);
  service->metrics()->CountRequest(method, GrpcCodeName(g.error_code()));
  service->metrics()->ObservePhase(method, "total", SecondsSince(started));
  LogCall({method, ctx->peer(), GrpcCodeName(g.error_code()), g.error_message(),
           absl::Now() - started, 0, 0});
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(g);
  LOSSD_TSAN_RELEASE(service);  // the call (and the server's shutdown) ends after we return
  return reactor;
}

}  // namespace

LossService::LossService(Engine* engine, ServerMetrics* metrics, ServiceOptions options)
    : engine_(engine),
      metrics_(metrics),
      options_(std::move(options)),
      idle_watch_(options_.stream_idle_timeout) {}

// The client's identity for fairness: its bearer token when there is one (hashed, never
// kept in clear), else its address without the port.
// A client is its token where tokens are checked; else its host. (An unchecked header would
// let one client be as many as it sends different values.)
static std::string ClientKey(grpc::CallbackServerContext* ctx, bool tokens_checked) {
  auto it = ctx->client_metadata().find("authorization");
  if (tokens_checked && it != ctx->client_metadata().end()) {
    return absl::StrCat("token:",
                        std::hash<std::string>()(std::string(it->second.data(), it->second.size())));
  }
  std::string peer = ctx->peer();
  const size_t colon = peer.rfind(':');
  if (colon != std::string::npos && colon > peer.find(':')) peer.resize(colon);
  return peer;
}

absl::Status LossService::Enter(grpc::CallbackServerContext* ctx, const char* method,
                                std::string* client) {
  if (options_.auth) {
    absl::Status s = options_.auth->Check(ctx->client_metadata());
    if (!s.ok()) return s;
  }
  if (engine_->draining()) {
    return absl::UnavailableError(
        absl::StrCat(method, " refused: the server is draining; retry on another replica"));
  }
  *client = ClientKey(ctx, options_.auth != nullptr);
  {
    absl::MutexLock lock(&clients_mu_);
    uint32_t& mine = client_in_flight_[*client];
    if (mine >= options_.max_in_flight_per_client) {
      return absl::UnavailableError(absl::StrCat(
          method, " refused: this client has ", mine,
          " RPCs in flight (--max_in_flight_per_client); retry later"));
    }
    ++mine;
  }
  uint32_t now = in_flight_.fetch_add(1) + 1;
  if (now > options_.max_in_flight) {
    in_flight_.fetch_sub(1);
    LeaveClient(*client);
    return absl::UnavailableError(absl::StrCat(
        method, " refused: ", options_.max_in_flight,
        " RPCs are in flight (--max_in_flight); retry later"));
  }
  metrics_->InFlight(+1);
  return absl::OkStatus();
}

std::string LossService::Principal(const grpc::CallbackServerContext* ctx) const {
  return CallPrincipal(*ctx, options_.auth.get());
}

void LossService::LeaveClient(const std::string& client) {
  absl::MutexLock lock(&clients_mu_);
  auto it = client_in_flight_.find(client);
  if (it != client_in_flight_.end() && --it->second == 0) client_in_flight_.erase(it);
}

void LossService::Leave(const std::string& client) {
  in_flight_.fetch_sub(1);
  LeaveClient(client);
  metrics_->InFlight(-1);
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* LossService::Compute(
    grpc::CallbackServerContext* ctx) {
  return new ComputeReactor(this, ctx);
}

grpc::ServerReadReactor<v1::PutWeightsRequest>* LossService::PutWeights(
    grpc::CallbackServerContext* ctx, v1::PutWeightsResponse* response) {
  return new PutWeightsReactor(this, ctx, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* LossService::FetchGradients(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request) {
  return new FetchGradientsReactor(this, ctx, request);
}

grpc::ServerUnaryReactor* LossService::DropWeights(grpc::CallbackServerContext* ctx,
                                                   const v1::DropWeightsRequest* request,
                                                   v1::DropWeightsResponse*) {
  return Unary(this, ctx, "DropWeights", *request,
               [&] { return engine_->DropWeights(request->handle(), Principal(ctx)); });
}

grpc::ServerUnaryReactor* LossService::DropAccumulator(
    grpc::CallbackServerContext* ctx, const v1::DropAccumulatorRequest* request,
    v1::DropAccumulatorResponse*) {
  return Unary(this, ctx, "DropAccumulator", *request,
               [&] { return engine_->DropAccumulator(request->accumulator(), Principal(ctx)); });
}

grpc::ServerUnaryReactor* LossService::ServerInfo(grpc::CallbackServerContext* ctx,
                                                  const v1::ServerInfoRequest* request,
                                                  v1::ServerInfoResponse* r) {
  return Unary(this, ctx, "ServerInfo", *request, [&] {
    const BackendInfo b = engine_->backend_info();
    const EngineOptions& o = engine_->options();
    r->set_version(options_.version);
    r->set_instance(options_.instance);
    r->set_backend(b.name);
    r->set_device(b.device);
    r->set_memory_total_bytes(b.memory_total_bytes);
    r->set_memory_budget_bytes(o.memory_budget_bytes);
    r->set_memory_in_use_bytes(engine_->budget().in_use());
    r->set_weight_cache_budget_bytes(o.weight_cache_bytes);
    r->set_weight_cache_bytes(engine_->weights().bytes());
    r->set_max_part_bytes(options_.max_part_bytes);
    r->set_max_bt(o.max_bt);
    r->set_max_h(o.max_h);
    r->set_max_v(o.max_v);
    r->set_max_in_flight(options_.max_in_flight);
    r->set_accumulators(static_cast<uint32_t>(engine_->accumulators().count()));
    for (std::string_view f : kServerFeatures) r->add_features(std::string(f));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* LossService::List(grpc::CallbackServerContext* ctx,
                                            const v1::ListRequest* request,
                                            v1::ListResponse* r) {
  return Unary(this, ctx, "List", *request, [&] {
    for (const StateInfo& s : engine_->ListState(Principal(ctx))) {
      v1::StateEntry* e = r->add_entries();
      e->set_kind(s.kind == StateInfo::Kind::kWeights ? v1::STATE_WEIGHTS
                                                      : v1::STATE_ACCUMULATOR);
      e->set_name(s.name);
      e->set_bytes(s.bytes);
      e->set_last_used_unix_ms(s.last_used_ns / 1000000);
      e->set_micro_batches(s.micro_batches);
    }
    return absl::OkStatus();
  });
}

}  // namespace lossd
