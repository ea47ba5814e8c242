// The C++ client of the lossd service: Compute (linear + cross-entropy loss and gradients),
// weight upload by handle, server-side gradient accumulators, and server info, in plain C++
// types. Tensor bytes are sent from caller memory without copies and received straight into
// their output buffers. Never retries a call and never changes a request's semantics: every
// server error comes back with its gRPC code (1:1 as an absl::StatusCode) and message.
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
#ifndef LOSSD_CLIENT_LOSSD_CLIENT_H_
#define LOSSD_CLIENT_LOSSD_CLIENT_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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

struct ClientOptions {
  std::string target = "localhost:50051";
  // Largest data bytes of one sent TensorPart, rounded down to whole elements of each tensor
  // (at least one). 1-4 MiB moves fastest; the server caps it (16 MiB by default).
  size_t part_bytes = 4 << 20;
  // Largest data bytes of one received part the server is asked to send (0 = its default).
  uint32_t response_part_bytes = 0;
  // Per-call deadline (each Compute, PutWeights, ... call); InfiniteDuration = none.
  absl::Duration deadline = absl::Minutes(10);
  // Message size limits set on the channel. Parts of 16 MiB and more must fit; gRPC's 4 MiB
  // default receive limit would refuse them.
  int max_receive_message_bytes = 256 << 20;
  int max_send_message_bytes = 256 << 20;
  // Channels to open, each its own TCP connection. One connection tops out near 4.5 GB/s;
  // concurrent calls round-robin over the channels.
  int connections = 1;
  // Striping: how many connections one big PutWeights or FetchGradients is split over, each
  // carrying a byte range of the tensor on its own stream (4 connections move 3-6x what one
  // does). 0 = the default rule: min(connections, 4) for tensors of at least
  // auto_stripe_bytes, else 1. 1 = never stripe. Must not exceed `connections` (so with one
  // connection striping is off) nor 64.
  int stripes = 0;
  uint64_t auto_stripe_bytes = 64ull << 20;
  // Compute overlaps transfer with compute (ComputeHeader.overlap): the server computes each
  // chunk of rows as its part of X arrives and sends dX back while later chunks compute, so a
  // call takes about max(transfer, compute) instead of their sum. The cost: once computing
  // has started, a call that fails (cut off, a NaN in a late part of X) poisons the named
  // accumulator, as a failed update always does. Per call: ComputeRequest::overlap.
  bool overlap = true;
  // Wait for the server to become reachable instead of failing fast with UNAVAILABLE.
  bool wait_for_ready = false;
  // Transport security: plaintext unless `tls` is set. PEM contents, not file paths.
  bool tls = false;
  std::string tls_root_certs;   // CAs the server certificate must chain to; empty = defaults
  std::string tls_client_cert;  // mutual TLS: this client's certificate (chain) ...
  std::string tls_client_key;   // ... and its private key
  // Checked against the server certificate instead of the target's host name (an IP target,
  // a test certificate).
  std::string tls_server_name;
  // When set, every call carries "authorization: Bearer <auth_token>".
  std::string auth_token;
  // Metadata added to every call.
  std::vector<std::pair<std::string, std::string>> metadata;
};

// Per-call overrides of ClientOptions.
struct CallOptions {
  std::optional<absl::Duration> deadline;
};

// Output tensors a Compute can return.
enum class OutputTensor : int32_t {
  kLoss = 16,         // (BT) fp32 per-token loss, reduction none only
  kLse = 17,          // (BT) fp32
  kZLoss = 18,        // (BT) fp32 per-token z-loss, reduction none only
  kPredictions = 19,  // (BT) int64 argmax
  kDx = 20,           // (BT, H) grad dtype
  kDw = 21,           // (V, H) grad dtype
  kDb = 22,           // (V) grad dtype
};
const char* OutputTensorName(OutputTensor t);  // "loss", "lse", ..., "dx", "dw", "db"

// Which outputs to return; the scalar loss always comes back.
struct WantedOutputs {
  bool dx = true;
  bool dw = true;  // ignored (never returned) when an accumulator is named
  bool db = false;
  bool lse = false;
  bool z_loss = false;
  bool accuracy = false;
  bool predictions = false;
};

// Where a wanted output should land instead of a newly allocated buffer (no extra copy).
struct OutputBuffer {
  void* data = nullptr;  // caller memory, at least `capacity` bytes, alive during the call
  size_t capacity = 0;
};

struct ComputeRequest {
  HostTensor x;                             // (BT, H) bf16, fp16 or fp32
  std::optional<HostTensor> w;              // (V, H) x's dtype; absent when weight_handle is set
  std::string weight_handle;                // from PutWeights (which carries its own bias)
  std::optional<HostTensor> bias;           // (V) x's dtype, inline weights only
  HostTensor targets;                       // (BT) int32 or int64
  std::optional<HostTensor> class_weights;  // (V) fp32
  std::optional<HostTensor> grad_output;    // (BT) fp32, reduction none only
  LossOptions options;                      // ignore_index, reduction, smoothing, z-loss, ...
  std::optional<DType> grad_dtype;          // nullopt = x's dtype; else kF32 (or x's dtype)
  WantedOutputs want;
  // When set, dW (and db) are added into this server-side fp32 accumulator, not returned.
  // The client remembers the server instance of each accumulator it has added to, and a
  // server of another instance (another replica behind a balancer that spread this client's
  // connections, or the same server restarted) refuses the call with FAILED_PRECONDITION
  // instead of starting a second, partial sum; DropAccumulator forgets it. First Computes
  // into a new accumulator sent at once, before its instance is known, are checked when they
  // return: one that landed elsewhere is FAILED_PRECONDITION (the sum is already split).
  std::string accumulator;
  std::map<OutputTensor, OutputBuffer> output_into;
  // nullopt = ClientOptions::overlap.
  std::optional<bool> overlap;
};

struct ComputeResult {
  float loss = 0.0f;  // mean or sum; for reduction none the sum of the per-token loss
  float z_loss = 0.0f;
  float accuracy = 0.0f;         // when wanted
  int64_t tokens = 0;            // non-ignored tokens
  double compute_seconds = 0.0;  // server-side compute time
  std::string backend;
  std::string instance;  // the server instance that computed
  uint64_t accumulated_micro_batches = 0;
  // Gradients holding a NaN or Inf after the call (kDx, kDw, kDb; with an accumulator, kDw
  // and kDb mean its sum, which then refuses further use until a reset fetch or a drop).
  // Servers with the "nonfinite_outputs" feature; older ones leave it empty.
  std::vector<OutputTensor> nonfinite;
  // Returned tensors, as the server listed them. Those with an output_into buffer are
  // mutable views of it; the rest own their bytes.
  std::map<OutputTensor, HostTensor> outputs;
  // Client-side measurements.
  double wall_seconds = 0.0;
  uint64_t bytes_sent = 0;      // tensor data bytes
  uint64_t bytes_received = 0;  // tensor data bytes

  // The output or null when it was not returned.
  const HostTensor* Find(OutputTensor t) const;
};

struct PutWeightsResult {
  std::string handle;
  uint64_t bytes = 0;  // server-side bytes the weights take
  int stripes = 1;     // streams (connections) the upload was split over
};

struct FetchGradientsResult {
  HostTensor dw;                 // (V, H) fp32
  std::optional<HostTensor> db;  // (V) fp32, when the accumulator saw a bias
  uint64_t micro_batches = 0;
  int64_t tokens = 0;
  std::string instance;
  int stripes = 1;  // range streams (connections) the fetch was split over
  int ranges = 1;   // ranged fetches it took (more than stripes where the server's budget is small)
};

struct ServerInfoResult {
  std::string version;
  std::string instance;
  std::string backend;
  std::string device;
  uint64_t memory_total_bytes = 0;
  uint64_t memory_budget_bytes = 0;
  uint64_t memory_in_use_bytes = 0;
  uint64_t weight_cache_budget_bytes = 0;
  uint64_t weight_cache_bytes = 0;
  uint32_t max_part_bytes = 0;
  int64_t max_bt = 0;
  int64_t max_h = 0;
  int64_t max_v = 0;
  uint32_t max_in_flight = 0;
  uint32_t accumulators = 0;
  std::vector<std::string> features;  // see engine/features.h
};

// One weight handle or accumulator of the caller's, as List reports it.
struct StateEntry {
  enum class Kind { kWeights, kAccumulator };
  Kind kind = Kind::kWeights;
  std::string name;  // the weight handle or the accumulator's name
  uint64_t bytes = 0;  // server memory it holds
  int64_t last_used_unix_ms = 0;  // created, or last named by a call
  uint64_t micro_batches = 0;  // accumulators: micro-batches summed since the last reset
};

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
  // The caller's own weight handles and accumulators (what its credential created; all of
  // them on a server that checks none). UNIMPLEMENTED from a server without "list_state".
  absl::StatusOr<std::vector<StateEntry>> List(const CallOptions& call = {});
  // OK when the server lists `feature` in ServerInfo.features; else UNIMPLEMENTED naming the
  // feature and the server's version. Asks ServerInfo once and remembers the answer (a failed
  // ask is not remembered). Call it before sending a field that the feature guards: an older
  // server would refuse the field (or, before refuse_unknown_fields, ignore it).
  absl::Status RequireFeature(absl::string_view feature, const CallOptions& call = {});

  const ClientOptions& options() const { return options_; }

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
  void PrepareContext(const CallOptions& call, grpc::ClientContext* ctx) const;
  // The server instance an accumulator's sum is on ("" before the first Compute into it).
  std::string AccumulatorInstance(const std::string& accumulator) const;

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
  // The first successful ServerInfo's version and features, for RequireFeature.
  absl::Mutex features_mu_;
  std::optional<std::pair<std::string, std::vector<std::string>>> features_
      ABSL_GUARDED_BY(features_mu_);
};

// Sets glibc's malloc to keep multi-MiB blocks instead of returning them to the kernel after
// every message (M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD max): nearly doubles upload speed.
// Process-wide, so left to the program's main() to call once at start-up.
void TuneMallocForLargeMessages();

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSD_CLIENT_H_
