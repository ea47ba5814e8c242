// SPDX-License-Identifier: Apache-2.0
// What the C++ client's hosted-head calls take and return, in plain C++ types: the optimizer
// (torch's arguments and defaults), a head to create or import, a Step and its result, an
// export and its tensors, a head's description. Data only: nothing here talks to a server or
// includes gRPC or protobuf. client/lossd_client.h includes this header; include that one.
#ifndef LOSSD_CLIENT_HEAD_TYPES_H_
#define LOSSD_CLIENT_HEAD_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "client/client_types.h"
#include "client/host_tensor.h"
#include "core/dtype.h"

namespace lossd {
namespace client {

// The ServerInfo feature every head call needs.
inline constexpr char kHostedHeadFeature[] = "hosted_head";

enum class Optimizer { kSgd, kAdamW };  // torch.optim.SGD, torch.optim.AdamW

// torch's arguments, with torch's defaults; every value is sent as set here.
struct OptimizerOptions {
  Optimizer kind = Optimizer::kAdamW;
  double lr = 1e-3;  // a Step may give its own (schedules stay in the trainer)
  // Of W. nullopt = torch's default for the kind: SGD 0 (coupled), AdamW 0.01 (decoupled).
  std::optional<double> weight_decay;
  double bias_weight_decay = 0;  // the bias is a parameter group of its own
  double momentum = 0;           // SGD
  double dampening = 0;          // SGD
  bool nesterov = false;         // SGD
  double beta1 = 0.9;            // AdamW
  double beta2 = 0.999;          // AdamW
  double eps = 1e-8;             // AdamW
  bool amsgrad = false;          // AdamW

  double WeightDecay() const {
    return weight_decay.value_or(kind == Optimizer::kAdamW ? 0.01 : 0.0);
  }
};
const char* OptimizerName(Optimizer kind);  // "sgd", "adamw"

// A head's tensors, as lossd.proto numbers them (TENSOR_HEAD_*). The master and the
// optimizer state are fp32 (a created head's master may come as bf16/fp16); the copies are in
// the head's compute dtype.
enum class HeadTensor : int32_t {
  kMasterW = 32,         // (V, H)
  kMasterBias = 33,      // (V)
  kExpAvgW = 34,         // (V, H) AdamW exp_avg; SGD momentum_buffer
  kExpAvgBias = 35,      // (V)
  kExpAvgSqW = 36,       // (V, H) AdamW exp_avg_sq
  kExpAvgSqBias = 37,    // (V)
  kMaxExpAvgSqW = 38,    // (V, H) AdamW max_exp_avg_sq (amsgrad)
  kMaxExpAvgSqBias = 39, // (V)
  kCopyW = 40,           // (V, H) export only: the compute copy
  kCopyBias = 41,        // (V)
};
// "master_w", "exp_avg_bias", ... (also the .npy file names lossctl writes and reads).
const char* HeadTensorName(HeadTensor t);
// The tensor of that name; nullopt for another name.
std::optional<HeadTensor> HeadTensorFromName(absl::string_view name);
bool IsBiasTensor(HeadTensor t);
// The optimizer state tensors `o` keeps, W's then the bias's where `bias` (in wire order):
// AdamW exp_avg, exp_avg_sq (and max_exp_avg_sq with amsgrad); SGD with momentum its
// momentum buffer; SGD without none.
std::vector<HeadTensor> StateTensors(const OptimizerOptions& o, bool bias);

// A head group (docs/hosted_head.md "Head groups"): S lossd instances serving one head, each
// with 1/S of its master and optimizer state. Rank r's Computes and Steps go to member
// HeadGroupMemberOf(r, S). Empty members: one server (no group).
struct HeadGroup {
  std::vector<std::string> members;  // every member's endpoint, as the trainers' pools name it
  uint32_t member = 0;               // this server's index in members
  std::string id;                    // the group's id: new for every group (never reused)

  size_t size() const { return members.size(); }
};
// The member serving `rank` in a group of `size` members (round robin; the server's rule).
inline uint32_t HeadGroupMemberOf(uint32_t rank, size_t size) {
  return size == 0 ? 0 : static_cast<uint32_t>(rank % size);
}

// A head as CreateHead takes it and an export describes it (HeadHeader).
struct HeadSpec {
  std::string name;  // 1 to 128 of [A-Za-z0-9._:/-]
  int64_t v = 0, h = 0;
  bool has_bias = false;
  DType master_dtype = DType::kF32;  // W as sent: fp32, or bf16/fp16 (the master is its upcast)
  DType compute_dtype = DType::kBF16;  // the compute copy's: X's dtype in every Compute
  OptimizerOptions optimizer;
  uint64_t version = 0;  // steps completed
  // Updates applied so far: torch's `step` for AdamW; for SGD with momentum, > 0 means the
  // momentum buffer holds a value (torch's is None before the first step).
  int64_t optimizer_step = 0;
  bool with_state = false;  // the optimizer state tensors come with it
};

// CreateHead: a new head, a running job's head with its torch optimizer state, or an import.
struct CreateHeadRequest {
  std::string name;
  HostTensor w;                    // (V, H) fp32, or bf16/fp16 (the master is its upcast)
  std::optional<HostTensor> bias;  // (V) w's dtype
  DType compute_dtype = DType::kBF16;
  OptimizerOptions optimizer;
  uint64_t version = 0;
  int64_t optimizer_step = 0;
  // The optimizer's state, fp32, keyed by kExpAvgW ... kMaxExpAvgSqBias: empty = zeros (a new
  // head); else exactly StateTensors(optimizer, bias), each of its parameter's shape.
  std::map<HeadTensor, HostTensor> state;
  // A head group: every member gets this request with its own `member` (at once: each call
  // returns once all have joined). PooledClient fills `member` in itself.
  HeadGroup group;
};

// A head as Info, List and CreateHead describe it.
struct HeadInfo {
  std::string name;
  int64_t v = 0, h = 0;
  bool has_bias = false;
  DType compute_dtype = DType::kBF16;
  OptimizerOptions optimizer;  // every default filled in by the server
  uint64_t version = 0;
  int64_t optimizer_step = 0;
  uint64_t bytes = 0;          // server memory it holds
  uint64_t contributions = 0;  // Computes added to the current step
  int64_t tokens = 0;          // their non-ignored tokens
  uint32_t ranks_waiting = 0;  // ranks that have called Step for the current version
  std::string instance;
  int64_t last_used_unix_ms = 0;
  HeadGroup group;  // the head group serving it (empty members: one server)
};

struct CreateHeadResult {
  HeadInfo head;
  bool created = false;  // false: the same head at the same version was already there
};

enum class StepPhase { kFull, kReduce, kApply };

// One rank's Step: a barrier over the step's world_size ranks (lossd.proto's StepRequest).
struct StepRequest {
  std::string head;
  uint64_t version = 0;  // the version this step's Computes named
  uint32_t rank = 0;     // < world_size
  uint32_t world_size = 1;
  StepPhase phase = StepPhase::kFull;
  std::optional<double> lr;        // unset: the head's
  std::optional<float> clip_coef;  // the trainer's clip coefficient; not with max_norm
  std::optional<double> max_norm;  // clip by the head's own norm, as clip_grad_norm_
  bool skip = false;               // drop the step's gradients, W unchanged
};

struct StepResult {
  uint64_t version = 0;  // after the call: +1 once applied or skipped
  double grad_norm = 0;  // of the summed gradient (W and bias), before clipping
  bool finite = true;
  bool applied = false;
  float clip_coef = 1.0f;
  uint64_t contributions = 0;
  int64_t tokens = 0;
  double step_seconds = 0;
  std::string instance;
};

// Where an export's bytes go, `size` bytes of tensor `t` at byte `offset` of it. Called in
// byte order within each tensor, from one thread at a time.
using HeadExportSink =
    std::function<absl::Status(HeadTensor t, uint64_t offset, const uint8_t* data, size_t size)>;

struct ExportHeadOptions {
  std::optional<uint64_t> version;  // unset: the current one (then pinned for every range)
  // Bytes of the concatenation fetched per range (one stream each, one after another): what
  // the server copies to host memory at once. Rounded down to whole 4-byte values.
  uint64_t range_bytes = 256ull << 20;
  // Tensors that land in caller memory (ExportHead only); the rest are allocated.
  std::map<HeadTensor, OutputBuffer> into;
};

// One tensor of an export, as the server announced it.
struct ExportedTensor {
  HeadTensor id = HeadTensor::kMasterW;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

// An exported head: what ImportHead takes to create it again, as it was.
struct HeadExport {
  HeadSpec spec;  // what CreateHead takes (master fp32, with_state as exported)
  // Every exported tensor, with the shapes and dtypes the server announced; views of
  // ExportHeadOptions::into where given. Empty from ExportHeadTo.
  std::map<HeadTensor, HostTensor> tensors;
  std::vector<ExportedTensor> layout;  // the export's tensors in wire order
  std::string instance;
  int ranges = 0;  // range streams it took
  uint64_t bytes = 0;  // of every tensor
};

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_HEAD_TYPES_H_
