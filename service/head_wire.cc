// SPDX-License-Identifier: Apache-2.0
#include "service/head_wire.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/message_bounds.h"
#include "service/wire_convert.h"
#include "wire/optimizer_config.h"

namespace lossd {
namespace {

constexpr double kDefaultLr = 1e-3;
constexpr double kDefaultSgdWeightDecay = 0;
constexpr double kDefaultAdamWWeightDecay = 1e-2;
constexpr double kDefaultBeta1 = 0.9;
constexpr double kDefaultBeta2 = 0.999;
constexpr double kDefaultEps = 1e-8;

std::string EnumText(int value, bool valid, const std::string& name) {
  return valid ? name : absl::StrCat(value);
}

// An optimizer field the other kind of optimizer has no use for: refused rather than ignored,
// so a trainer that set it learns that it does nothing.
absl::Status NotFor(absl::string_view field, absl::string_view name, absl::string_view kind) {
  return absl::InvalidArgumentError(absl::StrCat(field, ".", name, " is set, but ", kind,
                                                 " has no such argument; leave it unset"));
}

}  // namespace

absl::StatusOr<HeadOptimizer> OptimizerFromWire(const v1::OptimizerConfig& c,
                                                absl::string_view field) {
  HeadOptimizer o;
  switch (c.kind()) {
    case v1::OPTIMIZER_SGD: o.kind = OptimizerKind::kSgd; break;
    case v1::OPTIMIZER_ADAMW: o.kind = OptimizerKind::kAdamW; break;
    case v1::OPTIMIZER_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".kind is OPTIMIZER_UNSPECIFIED; name OPTIMIZER_SGD or OPTIMIZER_ADAMW"));
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ".kind ", static_cast<int>(c.kind()), " is not a known optimizer"));
  }
  const bool sgd = o.kind == OptimizerKind::kSgd;
  if (sgd) {
    if (c.has_beta1()) return NotFor(field, "beta1", "SGD");
    if (c.has_beta2()) return NotFor(field, "beta2", "SGD");
    if (c.has_eps()) return NotFor(field, "eps", "SGD");
    if (c.amsgrad()) return NotFor(field, "amsgrad", "SGD");
  } else {
    if (c.momentum() != 0) return NotFor(field, "momentum", "AdamW");
    if (c.dampening() != 0) return NotFor(field, "dampening", "AdamW");
    if (c.nesterov()) return NotFor(field, "nesterov", "AdamW");
  }
  o.lr = c.has_lr() ? c.lr() : kDefaultLr;
  o.weight_decay = c.has_weight_decay()
                       ? c.weight_decay()
                       : (sgd ? kDefaultSgdWeightDecay : kDefaultAdamWWeightDecay);
  o.bias_weight_decay = c.bias_weight_decay();
  o.momentum = c.momentum();
  o.dampening = c.dampening();
  o.nesterov = c.nesterov();
  o.beta1 = c.has_beta1() ? c.beta1() : kDefaultBeta1;
  o.beta2 = c.has_beta2() ? c.beta2() : kDefaultBeta2;
  o.eps = c.has_eps() ? c.eps() : kDefaultEps;
  o.amsgrad = c.amsgrad();
  return o;
}

v1::OptimizerConfig OptimizerToWire(const HeadOptimizer& o) {
  return OptimizerConfigOf(o.kind == OptimizerKind::kSgd, o.weight_decay, o);
}

absl::StatusOr<HeadSpec> HeadSpecFromWire(const v1::HeadHeader& h, absl::string_view field) {
  HeadSpec spec;
  spec.name = h.name();
  const std::string w_field = absl::StrCat(field, ".w");
  if (!h.has_w()) {
    return absl::InvalidArgumentError(
        absl::StrCat(w_field, " is missing: a head needs its (V, H) weight's spec"));
  }
  auto w = TensorDescFromWire(true, h.w(), w_field);
  if (!w.ok()) return w.status();
  if (w->shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(w_field, ".shape must be (V, H), got ",
                                                   ShapeText(w->shape)));
  }
  spec.v = w->shape[0];
  spec.h = w->shape[1];
  spec.master_dtype = w->dtype;
  if (h.has_bias()) {
    const std::string b_field = absl::StrCat(field, ".bias");
    auto b = TensorDescFromWire(true, h.bias(), b_field);
    if (!b.ok()) return b.status();
    if (b->shape.size() != 1 || b->shape[0] != spec.v) {
      return absl::InvalidArgumentError(absl::StrCat(b_field, ".shape must be (V) = [", spec.v,
                                                     "], got ", ShapeText(b->shape)));
    }
    if (b->dtype != w->dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          b_field, ".dtype ", v1::DType_Name(h.bias().dtype()), " differs from ", w_field,
          ".dtype ", v1::DType_Name(h.w().dtype()), "; send both in one dtype"));
    }
    spec.has_bias = true;
  }
  if (h.compute_dtype() == v1::DTYPE_UNSPECIFIED) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".compute_dtype is unspecified; name the dtype of X (bf16, fp16 or fp32)"));
  }
  auto compute = DTypeFromWire(h.compute_dtype(), absl::StrCat(field, ".compute_dtype"));
  if (!compute.ok()) return compute.status();
  spec.compute_dtype = *compute;
  auto optimizer = OptimizerFromWire(h.optimizer(), absl::StrCat(field, ".optimizer"));
  if (!optimizer.ok()) return optimizer.status();
  spec.optimizer = *optimizer;
  spec.version = h.version();
  spec.optimizer_step = h.optimizer_step();
  spec.with_state = h.with_state();
  spec.group.members.assign(h.group().members().begin(), h.group().members().end());
  spec.group.member = h.group().member();
  spec.group.id = h.group().id();
  return spec;
}

v1::HeadHeader HeadHeaderToWire(const HeadSpec& spec) {
  v1::HeadHeader h;
  h.set_name(spec.name);
  *h.mutable_w() = TensorSpecToWire(spec.master_dtype, {spec.v, spec.h});
  if (spec.has_bias) *h.mutable_bias() = TensorSpecToWire(spec.master_dtype, {spec.v});
  h.set_compute_dtype(DTypeToWire(spec.compute_dtype));
  *h.mutable_optimizer() = OptimizerToWire(spec.optimizer);
  h.set_version(spec.version);
  h.set_optimizer_step(spec.optimizer_step);
  h.set_with_state(spec.with_state);
  return h;
}

absl::StatusOr<StepCall> StepCallFromWire(const v1::StepRequest& r) {
  StepCall c;
  c.head = r.head();
  c.version = r.version();
  c.rank = r.rank();
  c.world_size = r.world_size();
  switch (r.phase()) {
    case v1::STEP_FULL: c.phase = StepPhase::kFull; break;
    case v1::STEP_REDUCE: c.phase = StepPhase::kReduce; break;
    case v1::STEP_APPLY: c.phase = StepPhase::kApply; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "StepRequest.phase ", static_cast<int>(r.phase()),
          " is not STEP_FULL, STEP_REDUCE or STEP_APPLY"));
  }
  if (r.has_lr()) c.lr = r.lr();
  if (r.has_clip_coef()) c.clip_coef = r.clip_coef();
  if (r.has_max_norm()) c.max_norm = r.max_norm();
  c.skip = r.skip();
  return c;
}

v1::StepResponse StepResponseToWire(const StepResult& r, const std::string& instance) {
  v1::StepResponse s;
  s.set_version(r.version);
  s.set_grad_norm(r.grad_norm);
  s.set_finite(r.finite);
  s.set_applied(r.applied);
  s.set_clip_coef(r.clip_coef);
  s.set_contributions(r.contributions);
  s.set_tokens(r.tokens);
  s.set_step_seconds(r.step_seconds);
  s.set_instance(instance);
  return s;
}

v1::HeadInfo HeadInfoToWire(const HeadSummary& s, const std::string& instance) {
  v1::HeadInfo i;
  i.set_name(s.name);
  *i.mutable_w() = TensorSpecToWire(s.dtype, {s.v, s.h});
  i.set_has_bias(s.has_bias);
  i.set_compute_dtype(DTypeToWire(s.dtype));
  *i.mutable_optimizer() = OptimizerToWire(s.optimizer);
  i.set_version(s.version);
  i.set_optimizer_step(s.optimizer_step);
  i.set_bytes(s.bytes);
  i.set_contributions(s.contributions);
  i.set_tokens(s.tokens);
  if (s.group.size() > 1) {
    v1::HeadGroupSpec* g = i.mutable_group();
    for (const std::string& m : s.group.members) g->add_members(m);
    g->set_member(s.group.member);
    g->set_id(s.group.id);
  }
  i.set_ranks_waiting(s.ranks_waiting);
  i.set_instance(instance);
  i.set_last_used_unix_ms(s.last_used_ns / 1000000);
  return i;
}

absl::StatusOr<HeadTensor> HeadTensorFromWire(v1::TensorId id, absl::string_view field) {
  const int n = static_cast<int>(id) - static_cast<int>(v1::TENSOR_HEAD_MASTER_W);
  if (n >= 0 && n < static_cast<int>(HeadTensor::kCount)) return static_cast<HeadTensor>(n);
  return absl::InvalidArgumentError(absl::StrCat(
      field, " ", EnumText(id, v1::TensorId_IsValid(id), v1::TensorId_Name(id)),
      " is not a head tensor (TENSOR_HEAD_*)"));
}

// The TENSOR_HEAD_* ids follow HeadTensor's order from TENSOR_HEAD_MASTER_W on.
static_assert(v1::TENSOR_HEAD_COPY_BIAS - v1::TENSOR_HEAD_MASTER_W + 1 ==
                  static_cast<int>(HeadTensor::kCount),
              "TENSOR_HEAD_* and HeadTensor differ");

v1::TensorId HeadTensorToWire(HeadTensor t) {
  return static_cast<v1::TensorId>(static_cast<int>(v1::TENSOR_HEAD_MASTER_W) +
                                   static_cast<int>(t));
}

v1::TensorSpec HeadTensorSpec(HeadTensor t, int64_t v, int64_t h, DType copy_dtype) {
  // Even ids are W's tensors, odd ones the bias's (master_w, master_bias, exp_avg_w, ...).
  const bool bias = static_cast<int>(t) % 2 == 1;
  const bool copy = t == HeadTensor::kCopyW || t == HeadTensor::kCopyBias;
  const DType dtype = copy ? copy_dtype : DType::kF32;
  return bias ? TensorSpecToWire(dtype, {v}) : TensorSpecToWire(dtype, {v, h});
}

void StateEntryToWire(const StateInfo& s, v1::StateEntry* e) {
  switch (s.kind) {
    case StateInfo::Kind::kWeights: e->set_kind(v1::STATE_WEIGHTS); break;
    case StateInfo::Kind::kAccumulator: e->set_kind(v1::STATE_ACCUMULATOR); break;
    case StateInfo::Kind::kHead: e->set_kind(v1::STATE_HEAD); break;
    case StateInfo::Kind::kTicket: e->set_kind(v1::STATE_TICKET); break;
  }
  e->set_name(s.name);
  e->set_bytes(s.bytes);
  e->set_last_used_unix_ms(s.last_used_ns / 1000000);
  e->set_micro_batches(s.micro_batches);
  if (s.kind == StateInfo::Kind::kHead) e->set_version(s.version);
}

}  // namespace lossd
