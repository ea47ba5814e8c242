// SPDX-License-Identifier: Apache-2.0
#include "client/lossd_client.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/client_wire.h"
#include "client/lossd_client_internal.h"
#include "client/compute_call.h"
#include "client/gradients_fetch.h"
#include "client/head_calls.h"
#include "client/head_export.h"
#include "client/health_check.h"
#include "client/output_receiver.h"
#include "client/stream_call.h"
#include "core/status_macros.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {
namespace {

// A channel argument that differs between a client's channels, so that gRPC gives each its
// own subchannel (and TCP connection) even in a local subchannel pool.
constexpr char kConnectionIndexArg[] = "lossd.connection_index";
// The default rule stripes over at most this many connections: four gave 3-6x one, more
// adds little on one host.
constexpr int kDefaultMaxStripes = 4;
// The server accepts at most this many stripes per upload.
constexpr int kMaxStripes = 64;
// After a stripe hears ABORTED (the server aborted the whole upload and tells every stripe),
// how long the others may take to report on their own before they are cancelled: the stripe
// that caused the abort is then heard with its own error.
constexpr absl::Duration kAbortedGrace = absl::Seconds(1);

// Runs one PutWeights stream and takes its single reply.
absl::Status RunPutWeightsStream(grpc::GenericStub* stub,
                                 const std::function<void(grpc::ClientContext*)>& prepare,
                                 std::vector<grpc::ByteBuffer> out, v1::PutWeightsResponse* reply,
                                 StripeGroup* group = nullptr, int stripe = 0) {
  int replies = 0;
  auto on_message = [&](const grpc::ByteBuffer& msg) -> absl::Status {
    if (++replies > 1) return absl::InternalError("server sent more than one PutWeights reply");
    absl::Status s = wire::DecodeMessage(msg, reply);
    return s.ok() ? s : absl::InternalError(s.message());
  };
  LOSSD_RETURN_IF_ERROR(
      RunStream(stub, kPutWeightsMethod, prepare, std::move(out), on_message, group, stripe));
  if (replies != 1) return absl::InternalError("server ended PutWeights without a reply");
  if (reply->handle().empty()) return absl::InternalError("server returned an empty handle");
  return absl::OkStatus();
}

}  // namespace

// LossClient::Connection and CallUnary are in client/lossd_client_internal.h (the heads'
// calls use them too).
using internal::CallUnary;

absl::StatusOr<std::unique_ptr<LossClient>> LossClient::Create(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("empty target");
  if (options.part_bytes == 0) return absl::InvalidArgumentError("part_bytes must be > 0");
  // A part's message adds a few dozen bytes of framing to its data.
  if (options.max_send_message_bytes >= 0 &&
      options.part_bytes + 64 > static_cast<size_t>(options.max_send_message_bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("part_bytes ", options.part_bytes,
                                                   " does not fit max_send_message_bytes ",
                                                   options.max_send_message_bytes));
  }
  if (options.tls_client_cert.empty() != options.tls_client_key.empty()) {
    return absl::InvalidArgumentError("tls_client_cert and tls_client_key go together");
  }
  if (!options.tls && (!options.tls_root_certs.empty() || !options.tls_client_cert.empty() ||
                       !options.tls_server_name.empty())) {
    return absl::InvalidArgumentError("TLS settings given without tls = true");
  }
  if (options.connections < 1 || options.connections > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("connections must be in [1, 256], got ", options.connections));
  }
  if (options.stripes < 0 || options.stripes > kMaxStripes) {
    return absl::InvalidArgumentError(absl::StrCat("stripes must be in [0, ", kMaxStripes,
                                                   "] (0 = the default rule), got ",
                                                   options.stripes));
  }
  for (const auto& [key, value] : options.metadata) {
    if (absl::AsciiStrToLower(key) == kRequestIdKey) {
      return absl::InvalidArgumentError(
          "metadata x-request-id: the client makes a new one for every call (each error names "
          "it, as the server's log line does); leave it out");
    }
  }
  if (options.stripes > options.connections) {
    return absl::InvalidArgumentError(
        absl::StrCat("stripes (", options.stripes, ") needs as many connections, got ",
                     options.connections, ": each stripe is a stream on a connection of its own"));
  }
  if (options.max_in_flight < 1 || options.max_in_flight > 64) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_in_flight must be in [1, 64] (ComputeAsync's calls at once), got ",
        options.max_in_flight));
  }
  return std::unique_ptr<LossClient>(new LossClient(options));
}

LossClient::LossClient(const ClientOptions& options)
    : options_(options), calls_(std::make_unique<CallQueue>(options.max_in_flight)) {
  for (int i = 0; i < options_.connections; ++i) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options_.max_receive_message_bytes);
    args.SetMaxSendMessageSize(options_.max_send_message_bytes);
    // Channels with equal arguments share one connection through gRPC's global subchannel
    // pool; a local pool plus a distinct argument gives each channel its own.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(kConnectionIndexArg, i);
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (options_.tls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = options_.tls_root_certs;
      ssl.pem_cert_chain = options_.tls_client_cert;
      ssl.pem_private_key = options_.tls_client_key;
      creds = grpc::SslCredentials(ssl);
      if (!options_.tls_server_name.empty()) {
        args.SetSslTargetNameOverride(options_.tls_server_name);
      }
    }
    auto c = std::make_unique<Connection>();
    c->channel = grpc::CreateCustomChannel(options_.target, creds, args);
    c->generic = std::make_unique<grpc::GenericStub>(c->channel);
    c->stub = v1::Loss::NewStub(c->channel);
    connections_.push_back(std::move(c));
  }
}

LossClient::~LossClient() = default;

absl::Status LossClient::Connect(absl::Duration timeout) {
  const auto deadline = std::chrono::system_clock::now() + absl::ToChronoNanoseconds(timeout);
  for (auto& c : connections_) {
    grpc::experimental::ChannelResetConnectionBackoff(c->channel.get());
    if (!c->channel->WaitForConnected(deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("not connected to ", options_.target,
                                                      " within ", absl::FormatDuration(timeout)));
    }
  }
  return absl::OkStatus();
}

LossClient::Connection& LossClient::NextConnection() {
  return *connections_[next_.fetch_add(1, std::memory_order_relaxed) % connections_.size()];
}

std::vector<LossClient::Connection*> LossClient::NextConnections(int n) {
  const uint64_t first = next_.fetch_add(n, std::memory_order_relaxed);
  std::vector<Connection*> out;
  for (int i = 0; i < n; ++i) out.push_back(connections_[(first + i) % connections_.size()].get());
  return out;
}

int LossClient::StripesFor(uint64_t bytes) const {
  if (options_.stripes > 0) return options_.stripes;
  if (bytes < options_.auto_stripe_bytes) return 1;
  return std::min(options_.connections, kDefaultMaxStripes);
}

std::function<void(grpc::ClientContext*)> LossClient::Preparer(const CallOptions& call) const {
  return [this, &call](grpc::ClientContext* ctx) { PrepareContext(call, ctx); };
}

void LossClient::PrepareContext(const CallOptions& call, grpc::ClientContext* ctx) const {
  const absl::Duration deadline = call.deadline.value_or(options_.deadline);
  if (deadline != absl::InfiniteDuration()) {
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoNanoseconds(deadline));
  }
  ctx->set_wait_for_ready(options_.wait_for_ready);
  if (!options_.auth_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.auth_token);
  }
  for (const auto& kv : options_.metadata) ctx->AddMetadata(kv.first, kv.second);
}

absl::StatusOr<ComputeResult> LossClient::Compute(const ComputeRequest& r,
                                                  const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(ValidateRequest(r));
  if (!r.head.empty()) LOSSD_RETURN_IF_ERROR(RequireFeature(kHostedHeadFeature, call));
  const absl::Time start = absl::Now();
  // A two-phase call is never overlapped: the backward sends no X, and the server keeps the
  // forward's X whole.
  const bool overlap =
      r.ticket.empty() && r.keep_ms == 0 && r.overlap.value_or(options_.overlap);
  const v1::ComputeRequest head = ComputeHeaderOf(
      r, r.accumulator.empty() ? std::string() : AccumulatorInstance(r.accumulator),
      options_.response_part_bytes, overlap, r.head.empty() ? "" : HeadInstance(r.head));

  // The tracker outlives the call: it waits (in its destructor too) until gRPC lets go of
  // the caller's memory.
  wire::SliceTracker tracker;
  ComputeResult result;
  std::vector<grpc::ByteBuffer> out;
  out.push_back(wire::EncodeMessage(head));
  AppendComputeInputs(r, options_.part_bytes, &tracker, &out, &result.bytes_sent);
  OutputPrefetcher prefetched;  // dX's (and dW's) buffers get ready meanwhile
  PrefetchOutputs(r, &prefetched);
  ComputeReplyReader reader(r, overlap, &result, &prefetched);
  const absl::Status status = RunStream(
      NextConnection().generic.get(), kComputeMethod, Preparer(call), std::move(out),
      [&reader](const grpc::ByteBuffer& msg) { return reader.OnMessage(msg); },
      /*group=*/nullptr, /*stripe=*/0, [&prefetched] { prefetched.Sent(); });
  tracker.WaitUntilReleased();
  LOSSD_RETURN_IF_ERROR(status);
  LOSSD_RETURN_IF_ERROR(reader.Finish());
  result.wall_seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!r.accumulator.empty() && !result.instance.empty()) {
    LOSSD_RETURN_IF_ERROR(RememberInstance(r.accumulator, result.instance));
  }
  if (!r.head.empty() && HeadInstance(r.head).empty()) {
    RememberHeadInstance(r.head, result.instance);
  }
  return result;
}

void LossClient::ComputeAsync(ComputeRequest request, CallOptions call, ComputeDone done) {
  auto req = std::make_shared<ComputeRequest>(std::move(request));
  AddCall<absl::StatusOr<ComputeResult>>(
      *calls_, [this, req, call] { return Compute(*req, call); }, std::move(done), "client");
}

std::future<absl::StatusOr<ComputeResult>> LossClient::ComputeAsync(ComputeRequest request,
                                                                    CallOptions call) {
  auto req = std::make_shared<ComputeRequest>(std::move(request));
  return AddCall<absl::StatusOr<ComputeResult>>(
      *calls_, [this, req, call] { return Compute(*req, call); }, "client");
}

std::string LossClient::AccumulatorInstance(const std::string& accumulator) const {
  absl::MutexLock lock(&instances_mu_);
  auto it = accumulator_instances_.find(accumulator);
  return it == accumulator_instances_.end() ? std::string() : it->second.first;
}

absl::Status LossClient::RememberInstance(const std::string& accumulator,
                                          const std::string& instance) {
  // The sum's home from its first Compute on: later calls ask for the same instance. Calls
  // that started before it was known (the first micro-batches of a new accumulator, sent
  // at once from several threads) were not pinned, and are checked here instead.
  absl::MutexLock lock(&instances_mu_);
  auto it = accumulator_instances_.find(accumulator);
  if (it != accumulator_instances_.end()) {
    if (it->second.first != instance) {
      return absl::FailedPreconditionError(absl::StrCat(
          "accumulator '", accumulator, "' began on server instance '", it->second.first,
          "', but this Compute was added to one on instance '", instance,
          "' (concurrent first Computes reached different replicas): the sum is split; "
          "drop the accumulator and redo the step on one replica"));
    }
    it->second.second = instances_seen_++;  // recently used: evicted last
  } else {
    if (accumulator_instances_.size() >= kRememberedAccumulators) {
      auto oldest = accumulator_instances_.begin();
      for (auto o = oldest; o != accumulator_instances_.end(); ++o) {
        if (o->second.second < oldest->second.second) oldest = o;
      }
      accumulator_instances_.erase(oldest);
    }
    accumulator_instances_.emplace(accumulator, std::make_pair(instance, instances_seen_++));
  }
  return absl::OkStatus();
}

absl::StatusOr<PutWeightsResult> LossClient::PutWeights(const HostTensor& w, const HostTensor* bias,
                                                        const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(w.Validate("w"));
  if (bias != nullptr) LOSSD_RETURN_IF_ERROR(bias->Validate("bias"));
  // Every stripe needs at least one element of W.
  const int stripes = static_cast<int>(std::min<int64_t>(
      StripesFor(w.num_bytes() + (bias != nullptr ? bias->num_bytes() : 0)), w.num_elements()));
  if (stripes > 1) return PutWeightsStriped(w, bias, stripes, call);

  v1::PutWeightsRequest head;
  FillSpec(w, head.mutable_header()->mutable_w());
  if (bias != nullptr) FillSpec(*bias, head.mutable_header()->mutable_bias());
  wire::SliceTracker tracker;
  uint64_t sent = 0;
  std::vector<grpc::ByteBuffer> out;
  out.push_back(wire::EncodeMessage(head));
  AppendParts(v1::TENSOR_W, w, options_.part_bytes, &tracker, &out, &sent);
  if (bias != nullptr) {
    AppendParts(v1::TENSOR_BIAS, *bias, options_.part_bytes, &tracker, &out, &sent);
  }
  v1::PutWeightsResponse reply;
  const absl::Status status = RunPutWeightsStream(
      NextConnection().generic.get(), Preparer(call), std::move(out), &reply);
  tracker.WaitUntilReleased();
  LOSSD_RETURN_IF_ERROR(status);
  return PutWeightsResult{reply.handle(), reply.bytes(), 1};
}

absl::StatusOr<PutWeightsResult> LossClient::PutWeightsStriped(const HostTensor& w,
                                                               const HostTensor* bias, int stripes,
                                                               const CallOptions& call) {
  const std::string upload_id = RandomUploadId();
  const uint64_t elem = DTypeSize(w.dtype());
  const uint64_t elems = static_cast<uint64_t>(w.num_elements());
  std::vector<Connection*> conns = NextConnections(stripes);
  std::vector<v1::PutWeightsResponse> replies(stripes);
  StripeGroup group(stripes, kAbortedGrace);
  const absl::Status status = group.Run([&](int i) -> absl::Status {
    // Equal shares of whole elements; the bias rides with the first.
    const uint64_t begin = elem * (elems * i / stripes);
    const uint64_t end = elem * (elems * (i + 1) / stripes);
    v1::PutWeightsRequest head;
    v1::WeightsHeader* h = head.mutable_header();
    FillSpec(w, h->mutable_w());
    if (bias != nullptr) FillSpec(*bias, h->mutable_bias());
    h->set_upload_id(upload_id);
    h->set_stripes(static_cast<uint32_t>(stripes));
    h->set_w_begin(begin);
    h->set_w_end(end);
    wire::SliceTracker tracker;
    uint64_t sent = 0;
    std::vector<grpc::ByteBuffer> out;
    out.push_back(wire::EncodeMessage(head));
    AppendRange(v1::TENSOR_W, w, begin, end, options_.part_bytes, &tracker, &out, &sent);
    if (i == 0 && bias != nullptr) {
      AppendParts(v1::TENSOR_BIAS, *bias, options_.part_bytes, &tracker, &out, &sent);
    }
    const absl::Status s = RunPutWeightsStream(
        conns[i]->generic.get(), Preparer(call), std::move(out), &replies[i], &group, i);
    tracker.WaitUntilReleased();
    return s;
  });
  LOSSD_RETURN_IF_ERROR(status);
  for (int i = 1; i < stripes; ++i) {
    if (replies[i].handle() != replies[0].handle()) {
      return absl::InternalError(absl::StrCat("stripes of upload '", upload_id,
                                              "' got different handles: '", replies[0].handle(),
                                              "' and '", replies[i].handle(), "'"));
    }
  }
  return PutWeightsResult{replies[0].handle(), replies[0].bytes(), stripes};
}

absl::Status LossClient::DropWeights(const std::string& handle, const CallOptions& call) {
  v1::DropWeightsRequest req;
  req.set_handle(handle);
  v1::DropWeightsResponse resp;
  return CallUnary(NextConnection().stub.get(), &v1::Loss::Stub::DropWeights, Preparer(call), req,
                   &resp);
}


uint64_t FetchRangesWithin(uint64_t total_bytes, uint64_t budget_bytes, uint64_t at_least) {
  const uint64_t values = total_bytes / sizeof(float);
  at_least = std::max<uint64_t>(at_least, 1);
  if ((values + at_least - 1) / at_least * sizeof(float) <= budget_bytes) return 0;
  const uint64_t per_range = budget_bytes / 2 / sizeof(float);
  if (per_range == 0) return 0;
  const uint64_t ranges = std::max(at_least, (values + per_range - 1) / per_range);
  return ranges > kMaxFetchRanges ? 0 : ranges;
}

absl::StatusOr<FetchGradientsResult> LossClient::FetchGradients(const std::string& accumulator,
                                                                bool reset,
                                                                const CallOptions& call) {
  GradientsFetch fetch(accumulator, AccumulatorInstance(accumulator),
                       options_.response_part_bytes,
                       Preparer(call));
  // Striping needs the accumulator's size: a one-element range fetch says it.
  const bool may_stripe =
      options_.stripes > 1 || (options_.stripes == 0 && options_.connections > 1);
  int stripes = 1;
  if (may_stripe) {
    LOSSD_RETURN_IF_ERROR(fetch.TakeLook(NextConnection().generic.get()));
    stripes = static_cast<int>(
        std::min<uint64_t>(StripesFor(fetch.total_bytes()), fetch.total_bytes() / sizeof(float)));
  }
  absl::Status refused;  // what the server said to a fetch too large for its memory budget
  if (stripes <= 1) {
    FetchGradientsResult result;
    bool had_header = false;
    const absl::Status s =
        fetch.FetchWhole(NextConnection().generic.get(), reset, &result, &had_header);
    if (s.ok()) return result;
    // Refused before its header (so nothing was reset) for want of memory: it may be larger
    // than the server's whole memory budget, which ranges can fit (below).
    if (s.code() != absl::StatusCode::kResourceExhausted || had_header) return s;
    refused = s;
    if (!fetch.has_look()) LOSSD_RETURN_IF_ERROR(fetch.TakeLook(NextConnection().generic.get()));
  }
  return FetchGradientsInRanges(&fetch, accumulator, reset, stripes, refused, call);
}

absl::StatusOr<FetchGradientsResult> LossClient::FetchGradientsInRanges(
    GradientsFetch* fetch, const std::string& accumulator, bool reset, int stripes,
    absl::Status refused, const CallOptions& call) {
  // Ranges of whole fp32 values straight into the result: `stripes` streams at once, one per
  // connection, each fetching its share of the ranges one after another.
  FetchGradientsResult result;
  LOSSD_RETURN_IF_ERROR(AllocateGradients(fetch->look_header(), &result));
  const GradientsStream::Dest dest{result.dw.mutable_data(),
                                   result.db.has_value() ? result.db->mutable_data() : nullptr};
  auto fetch_ranges = [&](uint64_t ranges) -> absl::Status {
    std::vector<grpc::GenericStub*> stubs;
    for (Connection* c : NextConnections(stripes)) stubs.push_back(c->generic.get());
    return fetch->FetchRanges(stubs, ranges, dest);
  };
  // Ranges small enough for the server's memory budget, after a fetch was refused for want
  // of memory: as many as it takes (at least `stripes`), or the refusal where ranges cannot
  // help.
  auto ranges_within_budget = [&]() -> absl::StatusOr<uint64_t> {
    absl::StatusOr<ServerInfoResult> info = ServerInfo(call);
    if (!info.ok()) return refused;
    const uint64_t ranges = FetchRangesWithin(fetch->total_bytes(), info->memory_budget_bytes,
                                              static_cast<uint64_t>(stripes));
    if (ranges == 0) return refused;
    return ranges;
  };

  std::optional<PagePopulator> populate;  // joined before the result is returned
  populate.emplace(result.dw.mutable_data(), result.dw.num_bytes());
  uint64_t ranges = static_cast<uint64_t>(stripes);
  absl::Status s;
  if (!refused.ok()) {
    absl::StatusOr<uint64_t> p = ranges_within_budget();
    s = p.status();
    if (p.ok()) ranges = *p;
  }
  if (s.ok()) s = fetch_ranges(ranges);
  if (s.code() == absl::StatusCode::kResourceExhausted && refused.ok()) {
    // Striped ranges can each be larger than the budget too. Ranges change nothing on the
    // server, so fetching them again is safe.
    refused = s;
    absl::StatusOr<uint64_t> p = ranges_within_budget();
    s = p.status();
    if (p.ok()) {
      ranges = *p;
      s = fetch_ranges(ranges);
    }
  }
  populate.reset();
  LOSSD_RETURN_IF_ERROR(s);
  // A ranged fetch cannot reset: drop it instead, now that every range is here.
  if (reset) LOSSD_RETURN_IF_ERROR(DropAccumulator(accumulator, call));
  result.stripes = stripes;
  result.ranges = static_cast<int>(ranges);
  return result;
}

absl::Status LossClient::DropAccumulator(const std::string& accumulator, const CallOptions& call) {
  {
    absl::MutexLock lock(&instances_mu_);
    accumulator_instances_.erase(accumulator);
  }
  v1::DropAccumulatorRequest req;
  req.set_accumulator(accumulator);
  v1::DropAccumulatorResponse resp;
  return CallUnary(NextConnection().stub.get(), &v1::Loss::Stub::DropAccumulator, Preparer(call),
                   req, &resp);
}

absl::StatusOr<std::string> LossClient::Health(const std::string& service,
                                               const CallOptions& call) {
  grpc::ClientContext ctx;
  PrepareContext(call, &ctx);
  return CheckHealth(*NextConnection().generic, &ctx, service);
}

absl::StatusOr<ServerInfoResult> LossClient::ServerInfo(const CallOptions& call) {
  v1::ServerInfoRequest req;
  v1::ServerInfoResponse resp;
  LOSSD_RETURN_IF_ERROR(CallUnary(NextConnection().stub.get(), &v1::Loss::Stub::ServerInfo,
                                  Preparer(call), req, &resp));
  return ServerInfoFromProto(resp);
}

absl::StatusOr<std::vector<StateEntry>> LossClient::List(const CallOptions& call) {
  LOSSD_RETURN_IF_ERROR(RequireFeature("list_state", call));
  v1::ListRequest req;
  v1::ListResponse resp;
  LOSSD_RETURN_IF_ERROR(CallUnary(NextConnection().stub.get(), &v1::Loss::Stub::List,
                                  Preparer(call), req, &resp));
  std::vector<StateEntry> entries;
  for (const v1::StateEntry& e : resp.entries()) {
    StateEntry s;
    s.kind = e.kind() == v1::STATE_ACCUMULATOR ? StateEntry::Kind::kAccumulator
             : e.kind() == v1::STATE_HEAD      ? StateEntry::Kind::kHead
             : e.kind() == v1::STATE_TICKET    ? StateEntry::Kind::kTicket
                                               : StateEntry::Kind::kWeights;
    s.name = e.name();
    s.bytes = e.bytes();
    s.last_used_unix_ms = e.last_used_unix_ms();
    s.micro_batches = e.micro_batches();
    s.version = e.version();
    entries.push_back(std::move(s));
  }
  return entries;
}

absl::Status LossClient::RequireFeature(absl::string_view feature, const CallOptions& call) {
  std::optional<std::pair<std::string, std::vector<std::string>>> known;
  {
    absl::MutexLock lock(&features_mu_);
    known = features_;
  }
  if (!known.has_value()) {
    absl::StatusOr<ServerInfoResult> info = ServerInfo(call);
    if (!info.ok()) return info.status();
    known.emplace(info->version, info->features);
    absl::MutexLock lock(&features_mu_);
    features_ = known;
  }
  const std::vector<std::string>& features = known->second;
  if (std::find(features.begin(), features.end(), feature) != features.end()) {
    return absl::OkStatus();
  }
  return absl::UnimplementedError(absl::StrCat(
      "the server (lossd ", known->first, ") does not support '", feature,
      "' (not in its ServerInfo.features): upgrade the server to use it"));
}

void TuneMallocForLargeMessages() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, INT_MAX);
}

}  // namespace client
}  // namespace lossd
