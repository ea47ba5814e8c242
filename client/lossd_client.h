// SPDX-License-Identifier: Apache-2.0
// The C++ client of the lossd service: Compute (linear + cross-entropy loss and gradients),
// weight upload by handle, server-side gradient accumulators, and server info, in plain C++
// types. Tensor bytes are sent from caller memory without copies and received straight into
// their output buffers. Never retries a call and never changes a request's semantics: every
// server error comes back with its gRPC code (1:1 as an absl::StatusCode) and message. Every
// call carries a new request id (x-request-id metadata), and its error ends
// " (request_id <id>)": the server's log lines about the call name the same id.
//
//   ClientOptions opts;                      // target localhost:50051, 4 MiB parts
//   opts.connections = 4;                    // concurrent calls spread over 4 TCP connections;
//                                            // PutWeights/FetchGradients of >= 64 MiB striped
//   auto client = LossClient::Create(opts);  // absl::StatusOr<std::unique_ptr<LossClient>>
//   ComputeRequest r;
//   r.x = HostTensor::View(DType::kBF16, {bt, h}, x_ptr);        // no copy
//   r.w = HostTensor::View(DType::kBF16, {v, h}, w_ptr);
//   r.targets = HostTensor::View(DType::kI64, {bt}, y_ptr);
//   r.output_into[OutputTensor::kDx] = {dx_ptr, dx_bytes};       // optional: land dX here
//   absl::StatusOr<ComputeResult> res = (*client)->Compute(r);   // res->loss, res->outputs
//
// Hosted heads (servers with the "hosted_head" feature): CreateHead keeps W, its optimizer
// and a compute copy on the server; each rank's Compute names the head (ComputeRequest::head)
// and its gradient goes into the head's step; Step applies it once all ranks have called;
// ExportHead / ImportHead checkpoint it.
//
// One LossClient talks to one server (or whatever one target balances to). For many
// replicas, client/pooled_client.h sends each call to the replica holding its state and
// fails over without losing or doubling a sum (docs/replica_pool.md).
#ifndef LOSSD_CLIENT_LOSSD_CLIENT_H_
#define LOSSD_CLIENT_LOSSD_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/call_queue.h"
#include "client/client_types.h"
#include "client/head_types.h"
#include "client/host_tensor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

namespace grpc {
class Channel;
class ClientContext;
class Status;
}  // namespace grpc

namespace lossd {
namespace client {

class GradientsFetch;  // client/gradients_fetch.h

// How many ranges of whole fp32 values a fetch of `total_bytes` takes so that each one holds
// at most half of a server's memory budget of `budget_bytes`, and at least `at_least` ranges.
// Half, because a range of the whole budget would wait until the server held no other memory
// at all, and hold every Compute off while it lasted. 0 where ranges cannot help: `at_least`
// ranges already fit the budget (so it was refused for something else), the budget is
// smaller than two values, or it would take more than kMaxFetchRanges.
inline constexpr uint64_t kMaxFetchRanges = 1 << 16;
uint64_t FetchRangesWithin(uint64_t total_bytes, uint64_t budget_bytes, uint64_t at_least);

// absl::Status with the same code (gRPC and absl codes are numerically equal) and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// Thread-safe: share one client among threads; concurrent calls spread over the connections.
// Caller tensors must stay alive and unchanged until the call that uses them returns.
class LossClient {
 public:
  // INVALID_ARGUMENT for bad options. Connects lazily: an unreachable server shows on the
  // first call (UNAVAILABLE).
  static absl::StatusOr<std::unique_ptr<LossClient>> Create(const ClientOptions& options);
  ~LossClient();

  absl::StatusOr<ComputeResult> Compute(const ComputeRequest& request,
                                        const CallOptions& call = {});
  // Compute without waiting: `done` gets what Compute would have returned (the same status
  // codes and messages, the same head keys and accumulator checks), on one of the client's
  // call threads. At most options().max_in_flight calls run at once, each its own stream;
  // further calls wait in order. The request's views (caller tensors) must stay alive and
  // unchanged until `done` runs; `done` must not destroy this client. A client destroyed
  // first runs its started calls to their end and answers the others CANCELLED.
  using ComputeDone = std::function<void(absl::StatusOr<ComputeResult>)>;
  void ComputeAsync(ComputeRequest request, CallOptions call, ComputeDone done);
  // The same, as a std::future.
  std::future<absl::StatusOr<ComputeResult>> ComputeAsync(ComputeRequest request,
                                                          CallOptions call = {});
  // w: (V, H) bf16/fp16/fp32; bias: (V) same dtype, or null.
  // Striped (see ClientOptions::stripes): W is cut into element-aligned byte ranges sent at
  // once, one stream per connection, under one random upload id; the bias goes with the first
  // range. The server makes the handle once every range has arrived; if any stripe fails the
  // whole upload is aborted, no handle exists, and the first error that is not the siblings'
  // ABORTED comes back.
  absl::StatusOr<PutWeightsResult> PutWeights(const HostTensor& w, const HostTensor* bias,
                                              const CallOptions& call = {});
  absl::Status DropWeights(const std::string& handle, const CallOptions& call = {});
  // Reads the accumulator's dW (and db); `reset` zeroes it afterwards.
  //
  // Striped (see ClientOptions::stripes; possible only with connections > 1): a small ranged
  // fetch first learns the accumulator's size (one extra round trip), then byte ranges of
  // dW | db are fetched at once, one stream per connection, straight into the result. Every
  // range must report the same micro_batches and tokens as the first look, else ABORTED (a
  // Compute added to the accumulator in between: fetch again). A ranged fetch cannot reset,
  // so `reset` then drops the accumulator after the last range has arrived: the next Compute
  // naming it creates it again, zeroed, and until then fetching it is NOT_FOUND rather than
  // zeros. A Compute adding to the accumulator while a striped reset is under way may be
  // lost with it; a whole fetch resets atomically.
  // A fetch of an accumulator this client has added to names its instance: another server
  // instance refuses it (FAILED_PRECONDITION) and resets nothing.
  //
  // A server refuses (RESOURCE_EXHAUSTED) to copy more than its whole --memory_budget_bytes
  // at once. Then the fetch asks for ServerInfo and goes on in ranges of at most half that
  // budget (FetchRangesWithin), one after another on each stream, with the same checks and
  // the same reset-by-drop as striping.
  absl::StatusOr<FetchGradientsResult> FetchGradients(const std::string& accumulator, bool reset,
                                                      const CallOptions& call = {});
  // Also forgets the accumulator's instance, whatever the server answers: the next Compute
  // into that name may begin a new sum on any server.
  absl::Status DropAccumulator(const std::string& accumulator, const CallOptions& call = {});
  absl::StatusOr<ServerInfoResult> ServerInfo(const CallOptions& call = {});
  // The gRPC health check (grpc.health.v1): "SERVING", "NOT_SERVING", ... for `service` ("" =
  // the whole server; "lossd.v1.Loss" = the loss service). Needs no token.
  absl::StatusOr<std::string> Health(const std::string& service = "", const CallOptions& call = {});
  // The caller's own weight handles, accumulators and hosted heads (what its credential
  // created; all of them on a server that checks none). UNIMPLEMENTED from a server without
  // "list_state".
  absl::StatusOr<std::vector<StateEntry>> List(const CallOptions& call = {});
  // OK when the server lists `feature` in ServerInfo.features; else UNIMPLEMENTED naming the
  // feature and the server's version. Asks ServerInfo once and remembers the answer (a failed
  // ask is not remembered). Call it before sending a field that the feature guards: an older
  // server would refuse the field (or, before refuse_unknown_fields, ignore it).
  absl::Status RequireFeature(absl::string_view feature, const CallOptions& call = {});

  // Hosted heads. Every call first checks the server lists "hosted_head" (UNIMPLEMENTED
  // otherwise). The client remembers each head's server instance (from CreateHead, Info and
  // Compute) and names it in Compute, Step and ExportHead: a restarted server refuses them
  // (FAILED_PRECONDITION) rather than act on a head it lost; ImportHead again there.
  //
  // Creates the head from W (fp32, or bf16/fp16: the master is their upcast), the bias and
  // optionally the optimizer's state (a torch optimizer's, or an export's). Creating a head
  // that exists with the same shape, optimizer and version is OK and changes nothing
  // (created = false); at another version it is ALREADY_EXISTS.
  absl::StatusOr<CreateHeadResult> CreateHead(const CreateHeadRequest& request,
                                              const CallOptions& call = {});
  // One rank's Step: returns once all world_size ranks have called (a barrier; give the
  // call a deadline long enough for the slowest rank), with the step's result.
  absl::StatusOr<StepResult> Step(const StepRequest& request, const CallOptions& call = {});
  // The head's master, bias, optimizer state and compute copy at a step boundary, in ranges
  // of options.range_bytes (the server copies one range to host memory at a time): into
  // options.into's buffers where given, else into allocated tensors.
  absl::StatusOr<HeadExport> ExportHead(const std::string& head,
                                        const ExportHeadOptions& options = {},
                                        const CallOptions& call = {});
  // The same, its bytes handed to `sink` (files written as they come: bounded memory here
  // too) after `on_layout` has heard the version and the tensors. No tensors in the result.
  absl::StatusOr<HeadExport> ExportHeadTo(
      const std::string& head, const std::function<absl::Status(const HeadExport&)>& on_layout,
      const HeadExportSink& sink, const ExportHeadOptions& options = {},
      const CallOptions& call = {});
  // CreateHead from an export: the head resumes exactly where it was exported.
  absl::StatusOr<CreateHeadResult> ImportHead(const HeadExport& exported,
                                              const CallOptions& call = {});
  // The same into a head group (this server is group.member; every member gets the whole
  // export and keeps its slices): the recovery after a member was lost, with a new group id.
  absl::StatusOr<CreateHeadResult> ImportHead(const HeadExport& exported, const HeadGroup& group,
                                              const CallOptions& call = {});
  absl::StatusOr<HeadInfo> GetHeadInfo(const std::string& head, const CallOptions& call = {});
  // Also forgets the head's instance, whatever the server answers.
  absl::Status DropHead(const std::string& head, const CallOptions& call = {});

  const ClientOptions& options() const { return options_; }
  // Connects every connection now, skipping gRPC's reconnect backoff (which grows while a
  // server is down, and meanwhile fails calls at once): for a caller that has reason to
  // think the server is back, such as a replica pool trying a replica again. OK once all are
  // connected; DEADLINE_EXCEEDED when they are not within `timeout`.
  absl::Status Connect(absl::Duration timeout);

 private:
  struct Connection;

  explicit LossClient(const ClientOptions& options);
  Connection& NextConnection();
  // `n` distinct connections (n <= connections), taken round-robin.
  std::vector<Connection*> NextConnections(int n);
  // Stripes for a transfer of `bytes` under ClientOptions::stripes.
  int StripesFor(uint64_t bytes) const;
  absl::StatusOr<PutWeightsResult> PutWeightsStriped(const HostTensor& w, const HostTensor* bias,
                                                     int stripes, const CallOptions& call);
  // FetchGradients after its look (fetch->has_look()): `stripes` streams of ranges, more
  // ranges than stripes where the server's memory budget needs them (`refused`: the whole
  // fetch's RESOURCE_EXHAUSTED, or OK).
  absl::StatusOr<FetchGradientsResult> FetchGradientsInRanges(GradientsFetch* fetch,
                                                              const std::string& accumulator,
                                                              bool reset, int stripes,
                                                              absl::Status refused,
                                                              const CallOptions& call);
  void PrepareContext(const CallOptions& call, grpc::ClientContext* ctx) const;
  // PrepareContext(call, ·), for the helpers that open contexts of their own; `call` must
  // outlive it.
  std::function<void(grpc::ClientContext*)> Preparer(const CallOptions& call) const;
  // The server instance an accumulator's sum is on ("" before the first Compute into it).
  std::string AccumulatorInstance(const std::string& accumulator) const;
  // Pins the accumulator to the instance that computed into it. Calls that started before it
  // was known (the first micro-batches of a new accumulator, sent at once from several
  // threads) were not pinned: one that reached another instance is FAILED_PRECONDITION here.
  absl::Status RememberInstance(const std::string& accumulator, const std::string& instance);
  // The server instance a head lives on ("" when not known); Remember: "" forgets it.
  std::string HeadInstance(const std::string& head) const;
  void RememberHeadInstance(const std::string& head, const std::string& instance);

  ClientOptions options_;
  std::vector<std::unique_ptr<Connection>> connections_;
  std::atomic<uint64_t> next_{0};
  // Accumulator name -> (instance, when it was last used); at most kRememberedAccumulators
  // (a trainer that names a new accumulator every step and never drops them would otherwise
  // grow it forever), the least recently used forgotten first.
  static constexpr size_t kRememberedAccumulators = 1024;
  mutable absl::Mutex instances_mu_;
  std::map<std::string, std::pair<std::string, uint64_t>> accumulator_instances_
      ABSL_GUARDED_BY(instances_mu_);
  uint64_t instances_seen_ ABSL_GUARDED_BY(instances_mu_) = 0;
  // Head name -> instance; at most kRememberedAccumulators (heads are few: a server holds at
  // most a few dozen).
  std::map<std::string, std::string> head_instances_ ABSL_GUARDED_BY(instances_mu_);
  // The first successful ServerInfo's version and features, for RequireFeature.
  absl::Mutex features_mu_;
  std::optional<std::pair<std::string, std::vector<std::string>>> features_
      ABSL_GUARDED_BY(features_mu_);
  // ComputeAsync's threads; declared last, so destroyed first: its running calls end while
  // the connections they use still exist.
  std::unique_ptr<CallQueue> calls_;
};

// Sets glibc's malloc to keep multi-MiB blocks instead of returning them to the kernel after
// every message (M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD max): nearly doubles upload speed.
// Process-wide, so left to the program's main() to call once at start-up.
void TuneMallocForLargeMessages();

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSD_CLIENT_H_
