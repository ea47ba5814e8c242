// SPDX-License-Identifier: Apache-2.0
// How the C++ client drives its streaming calls: one stream to its end (RunStream: sends
// every message while it reads the replies, handing each to a handler on the caller's thread)
// and a group of streams striped over several connections (StripeGroup: a thread each, the
// first real error wins, the rest cancelled). Knows gRPC's generic stubs and byte buffers,
// never lossd's messages: what the bytes mean is the handler's business.
#ifndef LOSSD_CLIENT_STREAM_CALL_H_
#define LOSSD_CLIENT_STREAM_CALL_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace lossd {
namespace client {

// absl::Status with the same code (gRPC and absl codes are numerically equal) and message.
// (Also declared in client/lossd_client.h, the client's API.)
absl::Status FromGrpcStatus(const grpc::Status& status);

// Every call the client makes carries an id of its own in this metadata key; the server
// names it in its log lines about the call and the client in the call's error, so that the
// two can be matched (service/request_id.h checks what a server accepts).
inline constexpr char kRequestIdKey[] = "x-request-id";

// 16 random lowercase hex digits, new for each call.
std::string NewRequestId();

// `s` with " (request_id <id>)" after its message (same code and payloads); OK stays OK.
absl::Status WithRequestId(const absl::Status& s, absl::string_view request_id);

// Takes one received message; an error ends the call (it is cancelled) with that error.
using MessageHandler = std::function<absl::Status(const grpc::ByteBuffer&)>;

// Runs the streams of one striped call at once, one thread each, and gathers their statuses.
// Once a stripe has failed the others are pointless, and a stripe the server never heard of
// would leave its siblings waiting there until their deadline, so the group cancels the
// streams still running: at once after any error but ABORTED, and `aborted_grace` after an
// ABORTED (the server aborted the whole upload and is telling every stripe; the grace lets
// the stripe that caused it report why).
class StripeGroup {
 public:
  StripeGroup(int n, absl::Duration aborted_grace)
      : n_(n), grace_(aborted_grace), contexts_(n, nullptr), statuses_(n), cancelled_(n, false) {}

  // Runs body(i) for every stripe i in [0, n) on a thread of its own and returns when all are
  // over: OK when every stripe succeeded, else the first error (in the order they happened)
  // that is neither ABORTED nor the group's own cancelling, else the first error.
  absl::Status Run(const std::function<absl::Status(int)>& body);

  // Stripe i's call is live on `ctx` (until Unregister): the group may cancel it. A stripe
  // that registers after the group gave up is cancelled at once.
  void Register(int i, grpc::ClientContext* ctx);
  void Unregister(int i);

 private:
  bool AllFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_ == n_; }
  void Finish(int i, absl::Status status);
  void CancelAllLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int n_;
  const absl::Duration grace_;
  absl::Mutex mu_;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> statuses_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> cancelled_ ABSL_GUARDED_BY(mu_);  // cancelled by the group
  std::vector<int> failed_ ABSL_GUARDED_BY(mu_);      // stripes that failed, in order
  int finished_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time cancel_at_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();
  bool cancel_all_ ABSL_GUARDED_BY(mu_) = false;
};

// Runs one streaming call (any of the three streaming kinds: on the wire they are all a
// stream each way) to its end on a ClientContext of its own, destroyed before this returns
// (after `prepare`, it gets a new request id; any error returned names it, WithRequestId):
// the context holds the call, and the call keeps any slice it did not send (after an early
// error) until it is destroyed, so a wire::SliceTracker could not finish waiting while it lives.
// Sends `out` in order and half-closes; hands each reply to `on_message`. Returns the
// handler's first error, else the call's status. With a group, the call is stripe `stripe`
// of it, which may cancel it. on_sent (nullable): called once, on a gRPC thread, when the last
// message has been written; it must return quickly.
absl::Status RunStream(grpc::GenericStub* stub, const char* method,
                       const std::function<void(grpc::ClientContext*)>& prepare,
                       std::vector<grpc::ByteBuffer> out, MessageHandler on_message,
                       StripeGroup* group = nullptr, int stripe = 0,
                       std::function<void()> on_sent = nullptr);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_STREAM_CALL_H_
