// SPDX-License-Identifier: Apache-2.0
// What the C++ client's calls take and return, in plain C++ types: the client's options, a
// Compute's request (tensors as caller-memory views, loss options, wanted outputs, where to
// land them) and every call's result. Data only: nothing here talks to a server or includes
// gRPC or protobuf. client/lossd_client.h includes this header; include that one.
#ifndef LOSSD_CLIENT_CLIENT_TYPES_H_
#define LOSSD_CLIENT_CLIENT_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "client/host_tensor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"

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
  // Channels to open, each its own TCP connection. One connection tops out near 4.2 GiB/s;
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
  // Metadata added to every call. Not x-request-id (INVALID_ARGUMENT): the client makes a new
  // one for every call.
  std::vector<std::pair<std::string, std::string>> metadata;
  // LossClient::ComputeAsync's calls running at once (1-64); further calls wait in order.
  // Bounds the client's memory of outputs being received.
  int max_in_flight = 2;
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
  kLogp = 23,         // (BT) fp32 log p(target) at the temperature (LossKind::kLogprob)
  kEntropy = 24,      // (BT) fp32 entropy at the temperature (kLogprob, want.entropy)
};
// "loss", "lse", ..., "dx", "dw", "db", "logp", "entropy".
const char* OutputTensorName(OutputTensor t);

// Which outputs to return; the scalar loss always comes back.
struct WantedOutputs {
  bool dx = true;
  bool dw = true;  // ignored (never returned) when an accumulator is named
  bool db = false;
  bool lse = false;
  bool z_loss = false;
  bool accuracy = false;
  bool predictions = false;
  bool entropy = false;  // LossKind::kLogprob: the per-token entropy (kEntropy)
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
  HostTensor targets;  // (BT) int32 or int64; kDistill: may be left default (no rows ignored)
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
  // A hosted head (LossClient::CreateHead; servers with the "hosted_head" feature): the
  // weight is the head's compute copy (x's dtype must be the head's compute dtype) and dW/db
  // go into the head's current step, never returned; not with w, weight_handle, bias or
  // accumulator. head_version: the version computed against (StepResult::version); the next
  // one waits (within the deadline) while this version's step is pending. (rank,
  // micro_batch) is the idempotency key: a retried Compute is answered but not added twice.
  // Data-parallel averaging is options.grad_scale (e.g. 1/world_size).
  std::string head;
  uint64_t head_version = 0;
  uint32_t rank = 0;
  uint64_t micro_batch = 0;
  // nullopt = ClientOptions::overlap.
  std::optional<bool> overlap;

  // What the call computes over the head (core/loss_problem.h, docs/rl_losses.md; servers
  // listing the feature "loss_kind_<name>"). options.temperature applies to the kinds other
  // than cross-entropy. Cross-entropy-only inputs and options (class_weights, grad_output,
  // label smoothing, z-loss, token scaling, a reduction other than mean) are refused by the
  // server for the others.
  LossKind kind = LossKind::kCrossEntropy;
  // kLogprob: upstream gradients of logp and of the entropy, (BT) fp32; absent = zeros (with
  // neither, want no gradients: a forward-only call).
  std::optional<HostTensor> dlogp;
  std::optional<HostTensor> dentropy;
  // kPolicy: targets are the sampled ids, ignore_index where the completion mask is 0;
  // advantages (required), old_logp and ref_logp per token, (BT) fp32.
  std::optional<HostTensor> advantages;
  std::optional<HostTensor> old_logp;
  std::optional<HostTensor> ref_logp;
  // The rollout correction (Liger's vllm_is_ratio), (BT) fp32 >= 0; servers listing
  // policy_is_ratio.
  std::optional<HostTensor> is_ratio;
  PolicyParams policy;  // Liger-Kernel's defaults
  // kDistill: the teacher's hidden states (BT, Ht) in x's dtype, and its head: teacher_w
  // (V, Ht) inline (with an optional teacher_bias (V)) or a PutWeights handle (which carries
  // its own bias). targets only mark ignored rows.
  std::optional<HostTensor> teacher_x;
  std::optional<HostTensor> teacher_w;
  std::optional<HostTensor> teacher_bias;
  std::string teacher_weight_handle;
  // Or, instead of the teacher's head and hidden states, its top-k (servers listing
  // distill_topk): per row its k most likely ids, (BT, k) int32 or int64, and their
  // log-probs, (BT, k) fp32; distill.topk_tail says what stands for the rest.
  std::optional<HostTensor> teacher_topk_ids;
  std::optional<HostTensor> teacher_topk_logp;
  DistillParams distill;  // Liger-Kernel's defaults

  // Two-phase kLogprob (servers listing "logprob_two_phase"), for a trainer whose upstream
  // gradient depends on the log-probs. The forward sets keep_ms > 0 with no dlogp/dentropy
  // and no gradient wanted: it returns logp (and entropy) and ComputeResult::ticket, and the
  // server keeps X, the targets and the weight for keep_ms (at most its --ticket_max_ms). The
  // backward names `ticket` and gives only dlogp and/or dentropy (x, targets, w, bias,
  // weight_handle and head left empty); it may want dx, dw, db, set grad_scale, grad_dtype,
  // an accumulator or, for a ticket taken against a head, rank and micro_batch. Its other
  // options are the forward's and are not sent. Neither phase is overlapped. A backward that
  // succeeds consumes the ticket; NOT_FOUND (expired, consumed, unknown) means: send the call
  // again as one phase, X with dlogp/dentropy.
  uint32_t keep_ms = 0;
  std::string ticket;
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
  // With a head: the version computed against, and whether this call's dW/db were added to
  // its step (false: its (rank, micro_batch) key was already there: a retry).
  uint64_t head_version = 0;
  bool head_added = false;
  // LossKind::kPolicy: Liger's mean-KL metric (0 when beta is 0) and clip fraction.
  float kl = 0.0f;
  float clip_fraction = 0.0f;
  // A forward with keep_ms: the ticket its backward names, and when it expires (ms since the
  // epoch, the server's clock).
  std::string ticket;
  int64_t ticket_expires_unix_ms = 0;
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
  std::string compute_path;  // the backend's compute path; empty from an older server
};

// One weight handle, accumulator or hosted head of the caller's, as List reports it.
struct StateEntry {
  enum class Kind { kWeights, kAccumulator, kHead, kTicket };
  Kind kind = Kind::kWeights;
  std::string name;  // the weight handle, the accumulator's or the head's name, the ticket
  uint64_t bytes = 0;  // server memory it holds
  int64_t last_used_unix_ms = 0;  // created, or last named by a call
  // Accumulators: micro-batches summed since the last reset; heads: Computes added to the
  // current step.
  uint64_t micro_batches = 0;
  uint64_t version = 0;  // heads: steps completed
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_CLIENT_TYPES_H_
