// SPDX-License-Identifier: Apache-2.0
// Engine::Plan: a ComputeSpec (what the client described) checked into a ComputePlan (shapes,
// the weights, the options, the accumulator, byte counts, the backend's workspace). Reads no
// tensor data and changes no state: a refused request leaves nothing behind.
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/loss_problem_check.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine/message_bounds.h"
#include "engine/plan_kind.h"
#include "engine/plan_ticket.h"
#include "engine/request_checks.h"

namespace lossd {
namespace {

const TensorDesc& Input(const ComputeSpec& spec, InputSlot s) {
  return spec.inputs[static_cast<int>(s)];
}

absl::Status PlanX(const TensorDesc& x, ComputePlan* plan) {
  if (!x.present) return absl::InvalidArgumentError("header.x is missing");
  LOSSD_RETURN_IF_ERROR(CheckShape(x, "x", 2));
  LOSSD_RETURN_IF_ERROR(CheckFloatDType(x, "x"));
  plan->bt = x.shape[0];
  plan->h = x.shape[1];
  plan->dtype = x.dtype;
  return absl::OkStatus();
}

// A hosted head: its compute copy is the weight (X's H and dtype), its step the accumulator.
absl::Status PlanHead(const ComputeSpec& spec, const TensorDesc& x, HeadStore& heads,
                      const std::string& instance, ComputePlan* plan) {
  const TensorDesc& w = Input(spec, InputSlot::kW);
  const TensorDesc& bias = Input(spec, InputSlot::kBias);
  if (w.present || bias.present || !spec.weight_handle.empty() || !spec.accumulator.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header names head '", ClippedText(spec.head), "' and also ",
        w.present ? "w" : bias.present ? "bias" : !spec.weight_handle.empty() ? "weight_handle"
                                                                               : "accumulator",
        "; a head is the weight and the accumulator: send neither"));
  }
  if (!spec.head_instance.empty() && spec.head_instance != instance) {
    LOSSD_RETURN_IF_ERROR(CheckIdLength(spec.head_instance, "header.head_instance"));
    return heads.CheckInstance(spec.head, spec.head_instance, "header.head_instance",
                               spec.owner);
  }
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, heads.Get(spec.head, spec.owner));
  LOSSD_RETURN_IF_ERROR(CheckNotBroken(*head));
  plan->weights = head->copy;
  plan->v = head->v;
  plan->has_bias = head->has_bias;
  if (head->h != plan->h || head->dtype != plan->dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x (", ShapeString(x.shape), ", ", DTypeName(plan->dtype), ") does not fit head '",
        spec.head, "' (H=", head->h, ", compute dtype ", DTypeName(head->dtype), ")"));
  }
  plan->head = std::move(head);
  plan->head_version = spec.head_version;
  plan->rank = spec.rank;
  plan->micro_batch = spec.micro_batch;
  plan->owner = spec.owner;
  return absl::OkStatus();
}

// W (and its bias) named by a handle: the caller's own, of X's H and dtype.
absl::Status PlanHandleWeights(const ComputeSpec& spec, const TensorDesc& x,
                               WeightCache& weights, ComputePlan* plan) {
  const TensorDesc& w = Input(spec, InputSlot::kW);
  const TensorDesc& bias = Input(spec, InputSlot::kBias);
  LOSSD_RETURN_IF_ERROR(CheckIdLength(spec.weight_handle, "header.weight_handle"));
  if (w.present || bias.present) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header names weight_handle '", spec.weight_handle,
        "' and also describes inline ", w.present ? "w" : "bias",
        "; send one or the other (a handle carries its own bias)"));
  }
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<const WeightEntry> entry,
                         weights.Get(spec.weight_handle));
  LOSSD_RETURN_IF_ERROR(CheckOwner(entry->owner, spec.owner,
                                   absl::StrCat("weight handle '", spec.weight_handle, "'")));
  plan->weights = std::move(entry);
  plan->weight_handle = spec.weight_handle;
  plan->v = plan->weights->v;
  plan->has_bias = plan->weights->bias != nullptr;
  if (plan->weights->h != plan->h) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x.shape ", ShapeString(x.shape), " has H=", plan->h, " but the weights of handle '",
        spec.weight_handle, "' have H=", plan->weights->h));
  }
  if (plan->weights->dtype != plan->dtype) {
    return absl::InvalidArgumentError(absl::StrCat(
        "x.dtype ", DTypeName(plan->dtype), " differs from the dtype of handle '",
        spec.weight_handle, "' (", DTypeName(plan->weights->dtype), ")"));
  }
  return absl::OkStatus();
}

// W (and the bias) sent inline: (V, H) and (V), of X's H and dtype.
absl::Status PlanInlineWeights(const TensorDesc& w, const TensorDesc& bias, ComputePlan* plan) {
  if (!w.present) return absl::InvalidArgumentError("header has neither w nor weight_handle");
  LOSSD_RETURN_IF_ERROR(CheckShape(w, "w", 2));
  LOSSD_RETURN_IF_ERROR(CheckFloatDType(w, "w"));
  if (w.shape[1] != plan->h) {
    return absl::InvalidArgumentError(absl::StrCat(
        "w.shape ", ShapeString(w.shape), " must be (V, H) with H = x.shape[1] = ", plan->h));
  }
  if (w.dtype != plan->dtype) {
    return absl::InvalidArgumentError(absl::StrCat("w.dtype ", DTypeName(w.dtype),
                                                   " differs from x.dtype ",
                                                   DTypeName(plan->dtype)));
  }
  plan->v = w.shape[0];
  if (!bias.present) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(CheckShape(bias, "bias", 1));
  if (bias.shape[0] != plan->v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bias.shape ", ShapeString(bias.shape), " must be (V) = [", plan->v, "]"));
  }
  if (bias.dtype != plan->dtype) {
    return absl::InvalidArgumentError(absl::StrCat("bias.dtype ", DTypeName(bias.dtype),
                                                   " differs from x.dtype ",
                                                   DTypeName(plan->dtype)));
  }
  plan->has_bias = true;
  return absl::OkStatus();
}

absl::Status CheckShapeLimits(const ComputePlan& plan, const EngineOptions& o) {
  if (plan.bt > o.max_bt || plan.h > o.max_h || plan.v > o.max_v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shape (BT=", plan.bt, ", H=", plan.h, ", V=", plan.v, ") exceeds the limits (BT <= ",
        o.max_bt, ", H <= ", o.max_h, ", V <= ", o.max_v, "; --max_bt, --max_h, --max_v)"));
  }
  return absl::OkStatus();
}

// Targets (BT) int32 or int64 (kDistill may leave them out: every row counts), and class
// weights (V) fp32 when sent.
absl::Status PlanTargetsAndClassWeights(const TensorDesc& targets, const TensorDesc& cw,
                                        ComputePlan* plan) {
  if (!targets.present && plan->kind == LossKind::kDistill) {
    if (plan->distill.weight_hard_loss != 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "header.targets is missing: distill.weight_hard_loss ", plan->distill.weight_hard_loss,
          " needs the labels of its cross-entropy term"));
    }
    plan->has_targets = false;
    return absl::OkStatus();
  }
  if (!targets.present) return absl::InvalidArgumentError("header.targets is missing");
  LOSSD_RETURN_IF_ERROR(CheckShape(targets, "targets", 1));
  if (targets.shape[0] != plan->bt) {
    return absl::InvalidArgumentError(absl::StrCat("targets.shape ", ShapeString(targets.shape),
                                                   " must be (BT) = [", plan->bt, "]"));
  }
  if (targets.dtype != DType::kI32 && targets.dtype != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat("targets.dtype must be int32 or int64, got ",
                                                   DTypeName(targets.dtype)));
  }
  plan->target_dtype = targets.dtype;
  if (!cw.present) return absl::OkStatus();
  LOSSD_RETURN_IF_ERROR(CheckShape(cw, "class_weights", 1));
  if (cw.shape[0] != plan->v) {
    return absl::InvalidArgumentError(absl::StrCat(
        "class_weights.shape ", ShapeString(cw.shape), " must be (V) = [", plan->v, "]"));
  }
  if (cw.dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("class_weights.dtype must be fp32, got ", DTypeName(cw.dtype)));
  }
  return absl::OkStatus();
}

// The options and grad_output (BT) fp32. The option rules are the one validation's
// (core/loss_problem_check.h), checked here so that a request is refused before its tensors
// arrive; the grad_output tensor between them keeps the order in which a request's first
// error is reported. At most `max_chunks` chunks for a client's chunk_rows.
absl::Status PlanOptions(const ComputeSpec& spec, const TensorDesc& go, int64_t max_chunks,
                         ComputePlan* plan) {
  const LossOptions& o = spec.options;
  LOSSD_RETURN_IF_ERROR(CheckReduction(o, go.present));
  if (go.present) {
    LOSSD_RETURN_IF_ERROR(CheckShape(go, "grad_output", 1));
    if (go.shape[0] != plan->bt) {
      return absl::InvalidArgumentError(absl::StrCat(
          "grad_output.shape ", ShapeString(go.shape), " must be (BT) = [", plan->bt, "]"));
    }
    if (go.dtype != DType::kF32) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad_output.dtype must be fp32, got ", DTypeName(go.dtype)));
    }
  }
  LOSSD_RETURN_IF_ERROR(CheckOptionRanges(o));
  if (o.reduction == Reduction::kNone && o.grad_scale != 1.0f) {
    // A rule of the request, not of the problem: both backends scale per row by grad_output
    // there, so a grad_scale would be ignored (and the client would not know).
    return absl::InvalidArgumentError(absl::StrCat(
        "options.grad_scale ", o.grad_scale, " applies to reduction mean and sum; with "
        "reduction none scale grad_output (one value per row) instead"));
  }
  LOSSD_RETURN_IF_ERROR(CheckChunkRows(o));
  // More than max_chunks chunks <=> chunk_rows < ceil(BT / max_chunks), which cannot overflow
  // whatever chunk_rows is.
  const int64_t least = (plan->bt + max_chunks - 1) / max_chunks;
  if (o.chunk_rows > 0 && o.chunk_rows < least) {
    // Each chunk is a few GEMMs and kernel launches, and a running compute cannot be
    // cancelled: a million one-row chunks would hold the device for most of a minute.
    return absl::InvalidArgumentError(absl::StrCat(
        "options.chunk_rows ", o.chunk_rows, " splits BT=", plan->bt, " rows into ",
        (plan->bt + o.chunk_rows - 1) / o.chunk_rows, " chunks; at most ", max_chunks,
        " are served (chunk_rows >= ", least, " here, or 0 to let the server choose)"));
  }
  plan->options = o;
  plan->wanted = spec.wanted;
  plan->allow_nonfinite_loss = spec.allow_nonfinite_loss;
  plan->grad_dtype = spec.grad_fp32 ? DType::kF32 : plan->dtype;
  return absl::OkStatus();
}

// The byte counts of the inline inputs, the outputs in the order they are sent, and the host
// bytes of both.
void PlanBuffers(bool has_cw, bool has_go, ComputePlan* plan) {
  const uint64_t es = DTypeSize(plan->dtype);
  auto& ib = plan->input_bytes;
  // A backward's X and targets are its ticket's: nothing of them is sent.
  const bool sent = plan->ticket == nullptr;
  if (sent) ib[static_cast<int>(InputSlot::kX)] = static_cast<uint64_t>(plan->bt) * plan->h * es;
  if (!plan->weights) {
    ib[static_cast<int>(InputSlot::kW)] = static_cast<uint64_t>(plan->v) * plan->h * es;
    if (plan->has_bias) ib[static_cast<int>(InputSlot::kBias)] = plan->v * es;
  }
  if (plan->has_targets && sent) {
    ib[static_cast<int>(InputSlot::kTargets)] = plan->bt * DTypeSize(plan->target_dtype);
  }
  if (has_cw) ib[static_cast<int>(InputSlot::kClassWeights)] = plan->v * 4;
  if (has_go) ib[static_cast<int>(InputSlot::kGradOutput)] = plan->bt * 4;

  const bool none = plan->options.reduction == Reduction::kNone;
  const WantedOutputs& want = plan->wanted;
  auto add = [&](OutputSlot slot, DType dt, std::vector<int64_t> shape) {
    uint64_t bytes = NumElements(shape) * DTypeSize(dt);
    plan->outputs.push_back(OutputDesc{slot, dt, std::move(shape), bytes});
  };
  if (none) add(OutputSlot::kLoss, DType::kF32, {plan->bt});
  if (none && want.z_loss) add(OutputSlot::kZLoss, DType::kF32, {plan->bt});
  if (want.lse) add(OutputSlot::kLse, DType::kF32, {plan->bt});
  if (want.predictions) add(OutputSlot::kPredictions, DType::kI64, {plan->bt});
  if (plan->kind == LossKind::kLogprob) add(OutputSlot::kLogp, DType::kF32, {plan->bt});
  if (want.entropy) add(OutputSlot::kEntropy, DType::kF32, {plan->bt});
  if (want.dx) add(OutputSlot::kDx, plan->grad_dtype, {plan->bt, plan->h});
  if (plan->accumulator.empty() && !plan->head) {
    if (want.dw) add(OutputSlot::kDw, plan->grad_dtype, {plan->v, plan->h});
    if (want.db && plan->has_bias) add(OutputSlot::kDb, plan->grad_dtype, {plan->v});
  }

  uint64_t host = 0;
  for (uint64_t b : ib) host += b;
  for (const OutputDesc& d : plan->outputs) host += d.bytes;
  plan->host_bytes = host;
}

// The backend's worst case for this plan's shape (no data yet). Every input and output the
// request has, so the backend counts all of its device copies (a device budget refuses the
// request here, not after its tensors have arrived).
uint64_t WorkspaceBytesOf(Backend& backend, const ComputePlan& plan, bool has_cw, bool has_go) {
  WorkspaceShape shape;
  shape.bt = plan.bt;
  shape.h = plan.h;
  shape.v = plan.v;
  shape.dtype = plan.dtype;
  shape.grad_dtype = plan.grad_dtype;
  shape.w_memory = plan.weights ? Memory::kBackend : Memory::kHost;
  shape.has_bias = plan.has_bias;
  shape.has_class_weights = has_cw;
  shape.has_grad_output = has_go;
  shape.chunk_rows = plan.options.chunk_rows;
  shape.want_dx = plan.wanted.dx;
  shape.kind = plan.kind;
  shape.teacher_h = plan.teacher_h;
  shape.teacher_topk = plan.teacher_topk;
  shape.teacher_w_memory = plan.teacher_weights ? Memory::kBackend : Memory::kHost;
  shape.want_entropy = plan.wanted.entropy;
  // A head's forward that keeps a ticket adds nothing to its step.
  if (!plan.accumulator.empty() || (plan.head && plan.keep_ms == 0)) {
    shape.dw = GradOut::kAccumulated;
    if (plan.has_bias) shape.db = GradOut::kAccumulated;
    shape.accum_memory = Memory::kBackend;
  } else {
    if (plan.wanted.dw) shape.dw = GradOut::kWritten;
    if (plan.wanted.db && plan.has_bias) shape.db = GradOut::kWritten;
  }
  return backend.WorkspaceBytes(shape);
}

}  // namespace

absl::StatusOr<ComputePlan> Engine::Plan(const ComputeSpec& request) {
  ComputePlan plan;
  LOSSD_RETURN_IF_ERROR(CheckKindServed(request, backend_name_, loss_kinds_));
  // A two-phase backward's X, targets, weight and options are its ticket's: the rest of the
  // planning reads them from `backward` (the request with the ticket's options).
  ComputeSpec backward;
  const bool ticketed = !request.ticket.empty();
  if (ticketed) {
    LOSSD_RETURN_IF_ERROR(PlanTicketBackward(request, tickets_, &plan, &backward));
  } else {
    LOSSD_RETURN_IF_ERROR(CheckKeepFirst(request));
  }
  const ComputeSpec& spec = ticketed ? backward : request;
  const TensorDesc& x = Input(spec, InputSlot::kX);
  const TensorDesc& cw = Input(spec, InputSlot::kClassWeights);
  const TensorDesc& go = Input(spec, InputSlot::kGradOutput);
  if (!ticketed) {
    LOSSD_RETURN_IF_ERROR(PlanX(x, &plan));
    if (!spec.head.empty()) {
      LOSSD_RETURN_IF_ERROR(PlanHead(spec, x, *heads_, options_.instance, &plan));
    } else if (!spec.weight_handle.empty()) {
      LOSSD_RETURN_IF_ERROR(PlanHandleWeights(spec, x, weights_, &plan));
    } else {
      LOSSD_RETURN_IF_ERROR(PlanInlineWeights(Input(spec, InputSlot::kW),
                                              Input(spec, InputSlot::kBias), &plan));
    }
  }
  LOSSD_RETURN_IF_ERROR(CheckShapeLimits(plan, options_));
  LOSSD_RETURN_IF_ERROR(PlanKind(spec, options_.max_h, weights_, &plan));
  if (!ticketed) {
    LOSSD_RETURN_IF_ERROR(
        PlanTargetsAndClassWeights(Input(spec, InputSlot::kTargets), cw, &plan));
  }
  LOSSD_RETURN_IF_ERROR(PlanOptions(spec, go, kMaxRequestedChunks, &plan));

  if (!plan.head && (!spec.head_instance.empty() || spec.head_version != 0 ||
                     spec.rank != 0 || spec.micro_batch != 0)) {
    return absl::InvalidArgumentError(
        "header.head_version, rank, micro_batch and head_instance belong to a Compute that "
        "names a head, and header.head is empty");
  }
  if (spec.accumulator.empty() && !spec.accumulator_instance.empty()) {
    return absl::InvalidArgumentError(
        "header.accumulator_instance is set but header.accumulator is not: the instance is "
        "checked for a named accumulator only");
  }
  if (!spec.accumulator.empty()) {
    LOSSD_RETURN_IF_ERROR(ValidateAccumulatorName(spec.accumulator, "header.accumulator"));
    LOSSD_RETURN_IF_ERROR(CheckAccumulatorInstance(spec.accumulator_instance, spec.accumulator,
                                                   "header.accumulator_instance"));
    // Refused now rather than after every byte of X and W has arrived.
    LOSSD_RETURN_IF_ERROR(
        accumulators_.Check(spec.accumulator, plan.v, plan.h, plan.has_bias, spec.owner));
    plan.accumulator = spec.accumulator;
    plan.owner = spec.owner;
  }

  if (spec.keep_ms > 0) LOSSD_RETURN_IF_ERROR(PlanTicketForward(spec, tickets_, &plan));
  PlanBuffers(cw.present, go.present, &plan);
  if (plan.host_bytes > options_.max_request_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request of (BT=", plan.bt, ", H=", plan.h, ", V=", plan.v, ") moves ", plan.host_bytes,
        " bytes of tensors, more than --max_request_bytes=", options_.max_request_bytes));
  }
  plan.workspace_bytes = WorkspaceBytesOf(*backend_, plan, cw.present, go.present);
  return plan;
}

}  // namespace lossd
