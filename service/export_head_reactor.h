// SPDX-License-Identifier: Apache-2.0
// The ExportHead call: the range is checked by the engine's HeadStore (CheckExport), a window
// of it at a time is admitted in the memory budget (as a fetch's host copy is, so exports in
// parallel wait for memory instead of running the host out of it), copied on the executor
// (HeadStore::Export, under the head's lock) and streamed as an ExportHeader and TENSOR_HEAD_*
// parts. Every window after the first names the version the first one found, so a step in
// between fails the call rather than mixing two versions. A raw method: the parts are slices
// of the copied window, so lossd copies no byte of it on the way out.
#ifndef LOSSD_SERVICE_EXPORT_HEAD_REACTOR_H_
#define LOSSD_SERVICE_EXPORT_HEAD_REACTOR_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "engine/admission.h"
#include "engine/heads.h"
#include "grpcpp/grpcpp.h"
#include "service/call_edge.h"
#include "service/loss_service.h"
#include "service/reactor_common.h"

namespace lossd {

// The most bytes of a head one ExportHead holds on the host at once (its admission): large
// enough that the copy is a small part of sending it, small enough that exports of a 7 GiB
// AdamW head in parallel do not need 7 GiB each.
inline constexpr uint64_t kExportWindowBytes = 64ull << 20;

class ExportHeadReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  ExportHeadReactor(LossService* service, grpc::CallbackServerContext* ctx,
                    const grpc::ByteBuffer* raw_request);

  void OnCancel() override;
  void OnWriteDone(bool ok) override;
  void OnDone() override;

 private:
  // kChecking -> kAdmitting (waiting for memory) -> kCopying (a window's copy waits on the
  // executor) -> kSending -> kCopying (the next window) ... -> kFinished; any state but
  // kFinished may go to kFinished.
  enum class State { kChecking, kAdmitting, kCopying, kSending, kFinished };
  static bool LegalTransition(State from, State to);

  absl::Status Start(const grpc::ByteBuffer& raw_request);
  void OnAdmitted(absl::Status s);
  void CopyWindow();
  void SendHeader(const HeadExportRange& r);
  void SendNext();
  void Write();
  void FinishOnce(const absl::Status& s);

  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  // Its idle watch is never armed (the call reads nothing after its request): it times the
  // writes alone.
  CallEdge edge_;
  Admission admission_;  // one window's bytes, until the call finishes
  CallState<State> state_{State::kChecking, State::kFinished, &LegalTransition};

  // Set in Start; then each step runs after the previous one has handed over (the admission
  // callback, the executor job, a write's completion), one at a time.
  std::string head_;
  std::string principal_;
  std::optional<uint64_t> version_;  // pinned by the first window when the client left it
  uint64_t begin_ = 0, end_ = 0;     // the resolved range of the concatenation
  uint64_t window_bytes_ = 0;
  uint32_t part_bytes_ = 4u << 20;
  // The concatenation's tensors: id, and the byte where each starts.
  std::vector<std::pair<HeadTensor, uint64_t>> starts_;
  SharedOutputs window_;              // the window being sent (one buffer)
  uint64_t window_begin_ = 0, window_end_ = 0;
  uint64_t offset_ = 0;               // the next byte of the concatenation to send
  grpc::ByteBuffer response_;
};

}  // namespace lossd

#endif  // LOSSD_SERVICE_EXPORT_HEAD_REACTOR_H_
