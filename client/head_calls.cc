// SPDX-License-Identifier: Apache-2.0
#include "client/head_calls.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/client_wire.h"
#include "client/stream_call.h"
#include "core/status_macros.h"
#include "wire/optimizer_config.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {
namespace {

constexpr size_t kMaxHeadName = 128;

absl::Status CheckFloat(const HostTensor& t, const char* name) {
  if (IsFloatDType(t.dtype())) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name, " must be fp32, bf16 or fp16, got ", t.DebugString()));
}

// `value` of the optimizer's `field` must be finite and in [lo, hi) (hi: exclusive) or
// [lo, inf).
absl::Status CheckRange(const char* field, double value, double lo, double hi = INFINITY) {
  if (std::isfinite(value) && value >= lo && (std::isinf(hi) || value < hi)) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("optimizer.", field, " must be ", std::isinf(hi) ? ">= " : "in [", lo,
                   std::isinf(hi) ? "" : absl::StrCat(", ", hi, ")"), ", got ", value));
}

absl::Status ValidateOptimizer(const OptimizerOptions& o) {
  LOSSD_RETURN_IF_ERROR(CheckRange("lr", o.lr, 0));
  LOSSD_RETURN_IF_ERROR(CheckRange("weight_decay", o.WeightDecay(), 0));
  LOSSD_RETURN_IF_ERROR(CheckRange("bias_weight_decay", o.bias_weight_decay, 0));
  if (o.kind == Optimizer::kSgd) {
    LOSSD_RETURN_IF_ERROR(CheckRange("momentum", o.momentum, 0));
    LOSSD_RETURN_IF_ERROR(CheckRange("dampening", o.dampening, 0));
    if (o.nesterov && (o.momentum <= 0 || o.dampening != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "optimizer.nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD), got "
          "momentum ", o.momentum, ", dampening ", o.dampening));
    }
    return absl::OkStatus();
  }
  LOSSD_RETURN_IF_ERROR(CheckRange("beta1", o.beta1, 0, 1));
  LOSSD_RETURN_IF_ERROR(CheckRange("beta2", o.beta2, 0, 1));
  return CheckRange("eps", o.eps, 0);
}

absl::Status ValidateState(const CreateHeadRequest& r) {
  if (r.state.empty()) return absl::OkStatus();
  const std::vector<HeadTensor> want = StateTensors(r.optimizer, r.bias.has_value());
  std::vector<std::string> want_names;
  for (HeadTensor t : want) want_names.push_back(HeadTensorName(t));
  for (const auto& [t, tensor] : r.state) {
    if (std::find(want.begin(), want.end(), t) == want.end()) {
      const std::string optimizer =
          r.optimizer.kind == Optimizer::kAdamW
              ? absl::StrCat("adamw", r.optimizer.amsgrad ? " with amsgrad" : "")
              : absl::StrCat("sgd with momentum ", r.optimizer.momentum);
      return absl::InvalidArgumentError(
          absl::StrCat("state[", HeadTensorName(t), "]: ", optimizer, " keeps [",
                       absl::StrJoin(want_names, ", "), "]", r.bias ? "" : " (no bias)"));
    }
  }
  for (HeadTensor t : want) {
    auto it = r.state.find(t);
    const std::string name = absl::StrCat("state[", HeadTensorName(t), "]");
    if (it == r.state.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " is missing: state given must hold every tensor of the optimizer: [",
          absl::StrJoin(want_names, ", "), "]"));
    }
    LOSSD_RETURN_IF_ERROR(it->second.Validate(name));
    const std::vector<int64_t> shape =
        IsBiasTensor(t) ? std::vector<int64_t>{r.w.dim(0)} : r.w.shape();
    if (it->second.dtype() != DType::kF32 || it->second.shape() != shape) {
      return absl::InvalidArgumentError(absl::StrCat(name, " must be ",
                                                     ShapeString(DType::kF32, shape), ", got ",
                                                     it->second.DebugString()));
    }
  }
  return absl::OkStatus();
}

// Appends tensor `t`'s parts under head tensor id `id`.
void AppendHeadParts(HeadTensor id, const HostTensor& t, size_t part_bytes,
                     wire::SliceTracker* tracker,
                     std::vector<grpc::ByteBuffer>* out, uint64_t* bytes) {
  AppendParts(static_cast<v1::TensorId>(id), t, part_bytes, tracker, out, bytes);
}

}  // namespace

absl::Status ValidateHeadName(const std::string& name, const char* field) {
  if (name.empty() || name.size() > kMaxHeadName) {
    return absl::InvalidArgumentError(absl::StrCat(field, " must be 1 to ", kMaxHeadName,
                                                   " characters, got ", name.size()));
  }
  for (char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '/' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " '", name, "' holds '", std::string(1, c), "': only [A-Za-z0-9._:/-]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateCreateHead(const CreateHeadRequest& r) {
  LOSSD_RETURN_IF_ERROR(ValidateHeadName(r.name, "name"));
  LOSSD_RETURN_IF_ERROR(r.w.Validate("w"));
  if (r.w.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("w must be (V, H), got ", r.w.DebugString()));
  }
  LOSSD_RETURN_IF_ERROR(CheckFloat(r.w, "w"));
  if (r.bias.has_value()) {
    LOSSD_RETURN_IF_ERROR(r.bias->Validate("bias"));
    if (r.bias->dtype() != r.w.dtype() || r.bias->shape() != std::vector<int64_t>{r.w.dim(0)}) {
      return absl::InvalidArgumentError(
          absl::StrCat("bias must be ", ShapeString(r.w.dtype(), {r.w.dim(0)}),
                       " (w's dtype, V), got ", r.bias->DebugString()));
    }
  }
  if (!IsFloatDType(r.compute_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compute_dtype must be bf16, fp16 or fp32, got ", DTypeName(r.compute_dtype)));
  }
  if (r.optimizer_step < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("optimizer_step must be >= 0, got ", r.optimizer_step));
  }
  LOSSD_RETURN_IF_ERROR(ValidateOptimizer(r.optimizer));
  if (!r.group.members.empty() && r.group.member >= r.group.size()) {
    // The server checks the rest of the group (the id, the endpoints); an index out of range
    // would route this member's ranks nowhere.
    return absl::InvalidArgumentError(absl::StrCat("group.member must be < ", r.group.size(),
                                                   " (the members given), got ",
                                                   r.group.member));
  }
  return ValidateState(r);
}

absl::Status ValidateStep(const StepRequest& r) {
  LOSSD_RETURN_IF_ERROR(ValidateHeadName(r.head, "head"));
  if (r.world_size < 1 || r.rank >= r.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank must be < world_size >= 1, got rank ",
                                                   r.rank, ", world_size ", r.world_size));
  }
  if (r.clip_coef.has_value() && r.max_norm.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "give clip_coef (", *r.clip_coef, ") or max_norm (", *r.max_norm, "), not both"));
  }
  if (r.clip_coef.has_value() && !(std::isfinite(*r.clip_coef) && *r.clip_coef >= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip_coef must be finite and >= 0, got ", *r.clip_coef));
  }
  if (r.max_norm.has_value() && !(std::isfinite(*r.max_norm) && *r.max_norm > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_norm must be finite and > 0, got ", *r.max_norm));
  }
  if (r.lr.has_value() && !(std::isfinite(*r.lr) && *r.lr >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be finite and >= 0, got ", *r.lr));
  }
  return absl::OkStatus();
}

v1::OptimizerConfig OptimizerToProto(const OptimizerOptions& o) {
  return OptimizerConfigOf(o.kind == Optimizer::kSgd, o.WeightDecay(), o);
}

OptimizerOptions OptimizerFromProto(const v1::OptimizerConfig& c) {
  OptimizerOptions o;
  o.kind = c.kind() == v1::OPTIMIZER_SGD ? Optimizer::kSgd : Optimizer::kAdamW;
  if (c.has_lr()) o.lr = c.lr();
  if (c.has_weight_decay()) o.weight_decay = c.weight_decay();
  o.bias_weight_decay = c.bias_weight_decay();
  o.momentum = c.momentum();
  o.dampening = c.dampening();
  o.nesterov = c.nesterov();
  if (c.has_beta1()) o.beta1 = c.beta1();
  if (c.has_beta2()) o.beta2 = c.beta2();
  if (c.has_eps()) o.eps = c.eps();
  o.amsgrad = c.amsgrad();
  return o;
}

v1::HeadHeader HeadHeaderOf(const CreateHeadRequest& r) {
  v1::HeadHeader h;
  h.set_name(r.name);
  FillSpec(r.w, h.mutable_w());
  if (r.bias.has_value()) FillSpec(*r.bias, h.mutable_bias());
  h.set_compute_dtype(ToProto(r.compute_dtype));
  *h.mutable_optimizer() = OptimizerToProto(r.optimizer);
  h.set_version(r.version);
  h.set_optimizer_step(r.optimizer_step);
  h.set_with_state(!r.state.empty());
  if (!r.group.members.empty()) {
    v1::HeadGroupSpec* g = h.mutable_group();
    for (const std::string& m : r.group.members) g->add_members(m);
    g->set_member(r.group.member);
    g->set_id(r.group.id);
  }
  return h;
}

absl::StatusOr<HeadSpec> HeadSpecFromProto(const v1::HeadHeader& h) {
  HeadSpec s;
  s.name = h.name();
  const std::vector<int64_t> w = ShapeOf(h.w());
  if (w.size() != 2) {
    return absl::InternalError(
        absl::StrCat("server described head '", h.name(), "' with a w of rank ", w.size()));
  }
  s.v = w[0];
  s.h = w[1];
  s.has_bias = h.has_bias() && h.bias().dtype() != v1::DTYPE_UNSPECIFIED;
  LOSSD_ASSIGN_OR_RETURN(s.master_dtype, FromProto(h.w().dtype()));
  LOSSD_ASSIGN_OR_RETURN(s.compute_dtype, FromProto(h.compute_dtype()));
  s.optimizer = OptimizerFromProto(h.optimizer());
  s.version = h.version();
  s.optimizer_step = h.optimizer_step();
  s.with_state = h.with_state();
  return s;
}

absl::StatusOr<HeadInfo> HeadInfoFromProto(const v1::HeadInfo& h) {
  HeadInfo i;
  i.name = h.name();
  const std::vector<int64_t> w = ShapeOf(h.w());
  if (w.size() != 2) {
    return absl::InternalError(
        absl::StrCat("server described head '", h.name(), "' with a w of rank ", w.size()));
  }
  i.v = w[0];
  i.h = w[1];
  i.has_bias = h.has_bias();
  LOSSD_ASSIGN_OR_RETURN(i.compute_dtype, FromProto(h.compute_dtype()));
  i.optimizer = OptimizerFromProto(h.optimizer());
  i.version = h.version();
  i.optimizer_step = h.optimizer_step();
  i.bytes = h.bytes();
  i.contributions = h.contributions();
  i.tokens = h.tokens();
  i.ranks_waiting = h.ranks_waiting();
  i.instance = h.instance();
  i.last_used_unix_ms = h.last_used_unix_ms();
  if (h.group().members_size() > 1) {
    i.group.members.assign(h.group().members().begin(), h.group().members().end());
    i.group.member = h.group().member();
    i.group.id = h.group().id();
    if (i.group.member >= i.group.size()) {
      return absl::InternalError(absl::StrCat("server described head '", h.name(),
                                              "' as member ", i.group.member, " of a group of ",
                                              i.group.size()));
    }
  }
  return i;
}

v1::StepRequest StepRequestOf(const StepRequest& r, const std::string& instance) {
  v1::StepRequest s;
  s.set_head(r.head);
  s.set_version(r.version);
  s.set_rank(r.rank);
  s.set_world_size(r.world_size);
  s.set_phase(r.phase == StepPhase::kReduce  ? v1::STEP_REDUCE
              : r.phase == StepPhase::kApply ? v1::STEP_APPLY
                                             : v1::STEP_FULL);
  if (r.lr.has_value()) s.set_lr(*r.lr);
  if (r.clip_coef.has_value()) s.set_clip_coef(*r.clip_coef);
  if (r.max_norm.has_value()) s.set_max_norm(*r.max_norm);
  s.set_skip(r.skip);
  s.set_head_instance(instance);
  return s;
}

StepResult StepResultFromProto(const v1::StepResponse& s) {
  StepResult r;
  r.version = s.version();
  r.grad_norm = s.grad_norm();
  r.finite = s.finite();
  r.applied = s.applied();
  r.clip_coef = s.clip_coef();
  r.contributions = s.contributions();
  r.tokens = s.tokens();
  r.step_seconds = s.step_seconds();
  r.instance = s.instance();
  return r;
}

absl::StatusOr<CreateHeadResult> RunCreateHead(grpc::GenericStub* stub,
                                               const ContextPreparer& prepare,
                                               const CreateHeadRequest& r, size_t part_bytes) {
  LOSSD_RETURN_IF_ERROR(ValidateCreateHead(r));
  v1::CreateHeadRequest head;
  *head.mutable_header() = HeadHeaderOf(r);
  wire::SliceTracker tracker;  // outlives the stream: gRPC may hold the caller's bytes until then
  uint64_t sent = 0;
  std::vector<grpc::ByteBuffer> out;
  out.push_back(wire::EncodeMessage(head));
  AppendHeadParts(HeadTensor::kMasterW, r.w, part_bytes, &tracker, &out, &sent);
  if (r.bias.has_value()) {
    AppendHeadParts(HeadTensor::kMasterBias, *r.bias, part_bytes, &tracker, &out, &sent);
  }
  if (!r.state.empty()) {
    for (HeadTensor t : StateTensors(r.optimizer, r.bias.has_value())) {
      AppendHeadParts(t, r.state.at(t), part_bytes, &tracker, &out, &sent);
    }
  }
  v1::CreateHeadResponse reply;
  int replies = 0;
  auto on_message = [&](const grpc::ByteBuffer& msg) -> absl::Status {
    if (++replies > 1) return absl::InternalError("server sent more than one CreateHead reply");
    absl::Status s = wire::DecodeMessage(msg, &reply);
    return s.ok() ? s : absl::InternalError(s.message());
  };
  const absl::Status status = RunStream(stub, kCreateHeadMethod, prepare, std::move(out),
                                        on_message);
  tracker.WaitUntilReleased();
  LOSSD_RETURN_IF_ERROR(status);
  if (replies != 1) return absl::InternalError("server ended CreateHead without a reply");
  CreateHeadResult result;
  LOSSD_ASSIGN_OR_RETURN(result.head, HeadInfoFromProto(reply.head()));
  result.created = reply.created();
  return result;
}

absl::StatusOr<CreateHeadRequest> ImportRequestOf(const HeadExport& e) {
  auto view = [&](HeadTensor t) -> absl::StatusOr<HostTensor> {
    auto it = e.tensors.find(t);
    if (it == e.tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the export of head '", e.spec.name,
                                                     "' lacks ", HeadTensorName(t)));
    }
    return HostTensor::View(it->second.dtype(), it->second.shape(), it->second.data());
  };
  CreateHeadRequest r;
  r.name = e.spec.name;
  LOSSD_ASSIGN_OR_RETURN(r.w, view(HeadTensor::kMasterW));
  if (e.spec.has_bias) {
    LOSSD_ASSIGN_OR_RETURN(HostTensor b, view(HeadTensor::kMasterBias));
    r.bias = std::move(b);
  }
  r.compute_dtype = e.spec.compute_dtype;
  r.optimizer = e.spec.optimizer;
  r.version = e.spec.version;
  r.optimizer_step = e.spec.optimizer_step;
  if (e.spec.with_state) {
    for (HeadTensor t : StateTensors(r.optimizer, e.spec.has_bias)) {
      LOSSD_ASSIGN_OR_RETURN(HostTensor s, view(t));
      r.state.emplace(t, std::move(s));
    }
  }
  return r;
}

}  // namespace client
}  // namespace lossd
