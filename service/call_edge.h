// SPDX-License-Identifier: Apache-2.0
// What the streamed calls' reactors (CreateHead, PutWeights, ExportHead, FetchGradients) do
// alike at the call's edge, whatever the call computes: the client counted in and out of the
// service, the idle watch that cancels a stalled stream, the end recorded once; the state
// machine's bookkeeping; an upload's message order and part limits; the request of a streamed
// response.
// The reactors keep what is their own: reading, calling the engine, writing.
#ifndef LOSSD_SERVICE_CALL_EDGE_H_
#define LOSSD_SERVICE_CALL_EDGE_H_

#include <cassert>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "engine/response_parts.h"
#include "service/idle_watch.h"
#include "service/loss_service.h"
#include "wire/part_codec.h"
#include "wire/unknown_fields.h"

namespace lossd {

// One call of `method`, from its reactor's construction to its OnDone.
class CallEdge {
 public:
  // Times the call and has the idle watch cancel it when it stalls (armed by the reactor).
  CallEdge(LossService* service, grpc::CallbackServerContext* ctx, const char* method);

  // Counts the call in for its client (LossService::Enter); a refusal is the call's status.
  absl::Status Enter();
  // The call's end: its status mapped, counted, timed and logged (RecordCall) with the tensor
  // bytes it took in and sent, and the client counted out. Once, from the reactor's finish.
  grpc::Status End(const absl::Status& s, uint64_t bytes_in, uint64_t bytes_out);
  // From OnDone: the idle watch forgets the call.
  void Unwatch();

  // Why a write failed: the idle watch cancelled the call (with its reason), or the client
  // went away (`gone`).
  absl::Status WriteFailed(absl::string_view gone) const;
  // One more part of an upload, of `size` bytes: within --max_parts_per_request parts and
  // --max_part_bytes each.
  absl::Status CountPart(uint64_t size);

  IdleWatch::Entry* idle() const { return idle_.get(); }
  const std::string& client() const { return client_; }
  const std::string& request_id() const { return request_id_; }

 private:
  LossService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const char* const method_;
  const absl::Time started_;
  const std::string request_id_;  // sent back at once, named in the call's log lines
  const std::shared_ptr<IdleWatch::Entry> idle_;
  bool entered_ = false;
  std::string client_;  // for the per-client in-flight count
  uint64_t parts_ = 0;
};

// A reactor's state, under its own lock. It moves only where `legal` allows: a wrong move is
// the reactor's bug, never the client's, so it is a debug assert and ignored otherwise. Any
// state but `finished` may finish.
template <typename State>
class CallState {
 public:
  using Legal = bool (*)(State from, State to);
  CallState(State first, State finished, Legal legal)
      : finished_(finished), legal_(legal), state_(first) {}

  State get() {
    absl::MutexLock lock(&mu_);
    return state_;
  }
  void Set(State next) {
    absl::MutexLock lock(&mu_);
    assert(legal_(state_, next) && "illegal state transition");
    if (legal_(state_, next)) state_ = next;
  }
  // True the first time only: the caller finishes the call.
  bool Finish() {
    absl::MutexLock lock(&mu_);
    if (state_ == finished_) return false;
    state_ = finished_;
    return true;
  }

 private:
  const State finished_;
  const Legal legal_;
  absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_);
};

// The request of a call that streams its response (raw, to send slices without copying):
// decoded (else INVALID_ARGUMENT naming the message), no unknown fields, and its
// response_part_bytes resolved against the server's flags.
template <typename Request>
absl::StatusOr<uint32_t> ReadStreamedRequest(const grpc::ByteBuffer& raw, const char* method,
                                             const ServiceOptions& o, Request* request) {
  const std::string& type = Request::descriptor()->name();
  if (!wire::DecodeMessage(raw, request).ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", method, " request is not a valid ", type));
  }
  if (absl::Status s = RefuseUnknownFields(*request, type); !s.ok()) return s;
  return ResponsePartBytes(request->response_part_bytes(), o.default_response_part_bytes,
                           o.max_part_bytes, "response_part_bytes");
}

// One message of an upload stream (a oneof of `header` and `part`: a header, then parts): no
// unknown fields, the header first and only once; then the header's or the part's handler.
template <typename Request, typename OnHeader, typename OnPart>
absl::Status ReadUploadMessage(const Request& request, const char* method, bool have_header,
                               OnHeader on_header, OnPart on_part) {
  if (absl::Status s = RefuseUnknownFields(request, Request::descriptor()->name()); !s.ok()) {
    return s;
  }
  if (request.has_header()) {
    if (have_header) {
      return absl::InvalidArgumentError(
          absl::StrCat("the ", method, " stream carries a second header"));
    }
    return on_header(request.header());
  }
  if (!have_header) {
    return absl::InvalidArgumentError(
        absl::StrCat("the first message of a ", method, " stream must be a header"));
  }
  return on_part(request.part());
}

}  // namespace lossd

#endif  // LOSSD_SERVICE_CALL_EDGE_H_
