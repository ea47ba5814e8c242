// SPDX-License-Identifier: Apache-2.0
// A Compute request as the engine sees it: plain shapes, dtypes and options (converted from
// the wire by the transport), and the validated plan made from it. No gRPC, no protobuf.
#ifndef LOSSD_ENGINE_COMPUTE_PLAN_H_
#define LOSSD_ENGINE_COMPUTE_PLAN_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/loss_problem.h"
#include "engine/accumulators.h"
#include "engine/heads.h"
#include "engine/tickets.h"
#include "engine/weight_cache.h"

namespace lossd {

// Inputs a Compute stream may carry (the loss kinds' after cross-entropy's).
enum class InputSlot : int {
  kX = 0, kW, kBias, kTargets, kClassWeights, kGradOutput,
  kDlogp, kDentropy, kAdvantages, kOldLogp, kRefLogp, kTeacherX, kTeacherW, kTeacherBias,
  kIsRatio, kTeacherTopkIds, kTeacherTopkLogp, kCount
};
// Outputs a Compute may return (the order they are sent is the plan's).
enum class OutputSlot : int {
  kLoss = 0, kZLoss, kLse, kPredictions, kDx, kDw, kDb, kLogp, kEntropy, kCount
};

const char* InputSlotName(InputSlot s);   // "x", "w", "bias", ...
const char* OutputSlotName(OutputSlot s);  // "loss", "z_loss", ...

struct TensorDesc {
  bool present = false;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
};

struct WantedOutputs {
  bool dx = false, dw = false, db = false;
  bool lse = false, z_loss = false, accuracy = false, predictions = false;
  bool entropy = false;  // kLogprob
};

struct ComputeSpec {
  std::array<TensorDesc, static_cast<int>(InputSlot::kCount)> inputs;
  std::string weight_handle;          // instead of inputs[kW] and inputs[kBias]
  LossOptions options;
  LossKind kind = LossKind::kCrossEntropy;
  PolicyParams policy;                // kPolicy
  DistillParams distill;              // kDistill
  std::string teacher_weight_handle;  // kDistill: instead of inputs[kTeacherW], kTeacherBias
  bool grad_fp32 = false;             // gradients in fp32 instead of the input dtype
  WantedOutputs wanted;
  std::string accumulator;            // add dW/db into this accumulator instead of returning
  std::string accumulator_instance;   // the instance it must live on; empty = any
  std::string owner;  // the caller's principal (owner.h), set by the service; "" = no auth
  // A hosted head (engine/heads.h) instead of the weight and an accumulator.
  std::string head;
  uint64_t head_version = 0;
  uint32_t rank = 0;          // with micro_batch, the idempotency key in the head's step
  uint64_t micro_batch = 0;
  std::string head_instance;  // the instance it must live on; empty = any
  // Two-phase kLogprob (engine/tickets.h): a forward that keeps a ticket for keep_ms, or a
  // backward that names one. Whether the client set temperature and ignore_index (a backward
  // may repeat the forward's, never change them).
  uint32_t keep_ms = 0;
  std::string ticket;
  bool temperature_set = false, ignore_index_set = false;
  // The caller streams X while the compute runs (ComputeHeader.overlap): planning refuses it
  // with keep_ms or a ticket (plan_ticket.h).
  bool overlap = false;
  // ComputeHeader.allow_nonfinite_loss: answer a loss that overflowed instead of refusing it.
  bool allow_nonfinite_loss = false;
};

struct OutputDesc {
  OutputSlot slot;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t bytes;
};

// A validated request: everything needed to receive, admit and run it.
struct ComputePlan {
  int64_t bt = 0, h = 0, v = 0;
  DType dtype = DType::kBF16;
  DType target_dtype = DType::kI64;
  DType grad_dtype = DType::kBF16;
  bool has_bias = false;
  bool has_targets = true;  // false: a kDistill request without them (every row counts)
  LossOptions options;
  WantedOutputs wanted;
  LossKind kind = LossKind::kCrossEntropy;
  PolicyParams policy;
  DistillParams distill;
  // kDistill's teacher: its hidden size, and its weights when they come by handle.
  int64_t teacher_h = 0;
  bool teacher_has_bias = false;
  std::shared_ptr<const WeightEntry> teacher_weights;
  std::string teacher_weight_handle;
  // kDistill from the teacher's top-k instead (teacher_h 0): k ids per row and their dtype.
  int64_t teacher_topk = 0;
  DType teacher_topk_id_dtype = DType::kI64;
  // Bytes expected per input slot on the stream (0 = not sent in this stream).
  std::array<uint64_t, static_cast<int>(InputSlot::kCount)> input_bytes{};
  std::vector<OutputDesc> outputs;  // tensors returned after the summary, in order
  std::shared_ptr<const WeightEntry> weights;  // when W comes by handle
  std::string weight_handle;
  std::string accumulator;
  std::string owner;  // ComputeSpec::owner: who creates or must own the accumulator
  std::shared_ptr<Head> head;  // a hosted head: weights is its copy, dW/db go to its step
  uint64_t head_version = 0;
  uint32_t rank = 0;
  uint64_t micro_batch = 0;
  // A forward that keeps: the TTL asked and the bytes its ticket will hold. A backward: the
  // ticket, whose X, targets and weight the compute reads.
  uint32_t keep_ms = 0;
  uint64_t ticket_bytes = 0;
  std::shared_ptr<const Ticket> ticket;
  // A loss that overflowed is answered, not refused (never with an accumulator or a head).
  bool allow_nonfinite_loss = false;
  uint64_t host_bytes = 0;       // input and output buffers held on the host
  uint64_t workspace_bytes = 0;  // backend's worst case beyond those
  uint64_t admission_bytes() const { return host_bytes + workspace_bytes; }
  // The student's forward and backward GEMMs, and a teacher's forward.
  double flops() const { return 6.0 * bt * h * v + 2.0 * bt * teacher_h * v; }
};

}  // namespace lossd

#endif  // LOSSD_ENGINE_COMPUTE_PLAN_H_
