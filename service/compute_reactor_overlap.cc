// SPDX-License-Identifier: Apache-2.0
// The overlapped half of ComputeReactor (ComputeHeader.overlap): reads, the compute and
// writes at once (see compute_reactor.h). Apart from compute_reactor.cc to keep each file
// readable at once; the same class, the same State.
#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "engine/overlap_start.h"
#include "service/compute_reactor.h"
#include "service/wire_convert.h"

namespace lossd {

// --- Overlapped Compute (ComputeHeader.overlap) -----------------------------------------
// Reads, the compute and writes run at once: the compute starts once every input but X is
// in and takes X's rows as they arrive (StreamedRows); dX parts go out as the backend
// reports rows final; the final summary goes last. Every event (a read, a write done, dX
// rows, the compute's end) ends in Progress(), which under mu_ picks the one next write or
// the finish. The call finishes only when no compute job holds `this`, no write is in
// flight and no read is being handled (a read still pending is fine: Finish ends it).

// After admission: the preliminary summary (outputs and specs) goes out while X comes in.
void ComputeReactor::StartOverlap() {
  outputs_ = std::make_shared<std::vector<HostBuffer>>(Engine::NewOutputs(*plan_));
  std::vector<uint64_t> output_bytes;
  int dx_output = -1;
  for (size_t i = 0; i < plan_->outputs.size(); ++i) {
    output_bytes.push_back(plan_->outputs[i].bytes);
    if (plan_->outputs[i].slot == OutputSlot::kDx) dx_output = static_cast<int>(i);
  }
  v1::ComputeResponse response = Summary(nullptr);
  {
    absl::MutexLock lock(&mu_);
    sends_ = std::make_unique<OverlapSends>(std::move(output_bytes), dx_output, plan_->bt,
                                            response_part_bytes_);
    sends_->WriteStarted();
    sends_->SetHandlingRead(true);
    response_ = wire::EncodeMessage(response);
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

void ComputeReactor::OnOverlapReadDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    if (state_ != State::kStreaming) return;  // finishing: Finish ends the pending read
    sends_->SetHandlingRead(true);
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

// Runs on the reactor's thread while it handles a read. When to start is the engine's
// policy (OverlapMayStart); a later part or the end of the stream asks again.
absl::Status ComputeReactor::MaybeStartCompute() {
  if (rows_ != nullptr) return absl::OkStatus();
  const OverlapProgress arrived{assembler_->AllButXComplete(), assembler_->XRowsReady(),
                                plan_->bt};
  if (!OverlapMayStart(arrived, service_->options().overlap_start_when_busy,
                       engine_->executor_idle())) {
    return absl::OkStatus();
  }
  if (ctx_->deadline() < std::chrono::system_clock::now()) {
    return absl::DeadlineExceededError("the deadline passed before the compute started");
  }
  auto rows = std::make_shared<StreamedRows>(
      plan_->bt, engine_->options().overlap_stall, absl::FromChrono(ctx_->deadline()),
      [this](int64_t) { Progress(); });  // on the backend's thread: more rows of dX are final
  rows->Arrived(assembler_->XRowsReady());
  {
    absl::MutexLock lock(&mu_);
    rows_ = rows;
    sends_->ComputeStarted();
  }
  idle_->Disarm();  // from here a stall of X fails the compute (--overlap_stall)
  engine_->Run(
      plan_, assembler_->buffers(),
      [this](ComputeOutcome outcome) { OnOverlapComputed(std::move(outcome)); },
      absl::FromChrono(ctx_->deadline()), assembler_->finite_checked(),
      OverlapIo{rows, outputs_}, [this] { return ctx_->IsCancelled() || Failed(); });
  return absl::OkStatus();
}

absl::Status ComputeReactor::OverlapEndOfStream() {
  idle_->Disarm();
  if (ctx_->IsCancelled()) return Cancelled();
  LOSSD_RETURN_IF_ERROR(ReceiveComplete());
  absl::Status s = MaybeStartCompute();  // X came before the other inputs: start now
  if (!s.ok()) return s;
  absl::MutexLock lock(&mu_);
  sends_->ReadsDone();
  return absl::OkStatus();
}

void ComputeReactor::EndHandlingRead() {
  {
    absl::MutexLock lock(&mu_);
    sends_->SetHandlingRead(false);
  }
  Progress();
}

// The call has already failed (a job still queued then does not start).
bool ComputeReactor::Failed() {
  absl::MutexLock lock(&mu_);
  return !sends_->error().ok();
}

// The first failure wins; the compute, if running, stops at the next rows it waits for.
void ComputeReactor::FailOverlap(const absl::Status& s) {
  {
    absl::MutexLock lock(&mu_);
    sends_->Fail(s);
  }
  FailRows();
}

void ComputeReactor::FailRows() {
  std::shared_ptr<StreamedRows> rows;
  absl::Status why;
  {
    absl::MutexLock lock(&mu_);
    rows = rows_;
    why = sends_->error();
  }
  if (rows != nullptr && !why.ok()) rows->Fail(why);
}

// On the executor thread.
void ComputeReactor::OnOverlapComputed(ComputeOutcome outcome) {
  ObserveCompute(outcome);
  NoteAdded(outcome);
  v1::ComputeResponse response = Summary(&outcome);
  // Recorded inside Progress's critical section, not in one of its own before it: once the
  // compute has ended another thread's Progress may finish the call, and gRPC delete this
  // reactor, before this thread's Progress locks mu_ again.
  Progress([&] {
    sends_->ComputeEnded(outcome.status);
    if (outcome.status.ok()) final_summary_ = std::move(response);
    send_started_ = absl::Now();
  });
}

// Picks the next write, or finishes the call; any thread. `update` runs first, under mu_.
// Once it returns, a caller that is not a gRPC reaction (nothing holds the call open for
// it) may touch the reactor no more: the write or the finish it started is its last step.
void ComputeReactor::Progress(absl::FunctionRef<void()> update) {
  absl::Status finish;
  bool write = false, done = false;
  double send_seconds = 0, bytes_out = 0;
  {
    absl::MutexLock lock(&mu_);
    update();
    if (state_ != State::kStreaming) return;
    const OverlapSends::Step step = sends_->Next(rows_ != nullptr ? rows_->dx_ready() : 0);
    switch (step.kind) {
      case OverlapSends::Step::Kind::kWait:
        return;
      case OverlapSends::Step::Kind::kPart:
        EncodeOutputPart(step.output, step.offset, step.offset + step.bytes);
        write = true;
        break;
      case OverlapSends::Step::Kind::kFinalSummary:
        response_ = wire::EncodeMessage(final_summary_);
        write = true;
        break;
      case OverlapSends::Step::Kind::kFinish:
        finish = step.status;
        done = true;
        // The part of sending the compute did not hide: from its end to the last write.
        send_seconds = SecondsSince(send_started_);
        bytes_out = static_cast<double>(bytes_out_);
        // One Progress finishes: a second that also found the call done could reach
        // FinishOnce after the first's Finish had let gRPC delete the reactor.
        SetStateLocked(State::kFinishing);
        break;
    }
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

}  // namespace lossd
