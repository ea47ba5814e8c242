// SPDX-License-Identifier: Apache-2.0
#include "client/compute_call.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client_wire.h"
#include "core/status_macros.h"

namespace lossd {
namespace client {
namespace {

// The dtype and shape of output `t` of request `r`, with V = `v`.
std::pair<DType, std::vector<int64_t>> OutputSpecOf(const ComputeRequest& r, OutputTensor t,
                                                    int64_t v) {
  const int64_t bt = RowsOf(r);
  const int64_t h = r.x.dim(1);
  const DType grad = r.grad_dtype.value_or(r.x.dtype());
  switch (t) {
    case OutputTensor::kLoss:
    case OutputTensor::kLse:
    case OutputTensor::kZLoss:
    case OutputTensor::kLogp:
    case OutputTensor::kEntropy:
      break;
    case OutputTensor::kPredictions:
      return {DType::kI64, {bt}};
    case OutputTensor::kDx:
      return {grad, {bt, h}};
    case OutputTensor::kDw:
      return {grad, {v, h}};
    case OutputTensor::kDb:
      return {grad, {v}};
  }
  return {DType::kF32, {bt}};
}

// A backward naming a ticket knows BT (its dlogp/dentropy) but not H, V or X's dtype: its
// outputs are checked for what it knows.
absl::Status CheckTicketOutputSpec(const ComputeRequest& r, OutputTensor t, DType dtype,
                                   const std::vector<int64_t>& shape) {
  const int64_t bt = RowsOf(r);
  bool ok = false;
  switch (t) {
    case OutputTensor::kDx:
      ok = shape.size() == 2 && shape[0] == bt && shape[1] > 0;
      break;
    case OutputTensor::kDw:
      ok = shape.size() == 2 && shape[0] > 0 && shape[1] > 0;
      break;
    case OutputTensor::kDb:
      ok = shape.size() == 1 && shape[0] > 0;
      break;
    default:
      ok = dtype == DType::kF32 && shape == std::vector<int64_t>{bt};
  }
  const bool grad = t == OutputTensor::kDx || t == OutputTensor::kDw || t == OutputTensor::kDb;
  if (grad) ok = ok && IsFloatDType(dtype) && (!r.grad_dtype || *r.grad_dtype == dtype);
  if (ok) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("server announced ", OutputTensorName(t), " as ",
                                          ShapeString(dtype, shape), " for the backward of ",
                                          "ticket '", r.ticket, "' of BT=", bt));
}

absl::Status CheckOutputSpec(const ComputeRequest& r, OutputTensor t, DType dtype,
                             const std::vector<int64_t>& shape) {
  if (!r.ticket.empty()) return CheckTicketOutputSpec(r, t, dtype, shape);
  // V is known only for inline weights; with a handle any V >= 1 is accepted.
  const int64_t v = r.w.has_value() ? r.w->dim(0) : (shape.empty() ? -1 : shape[0]);
  const auto [want_dtype, want_shape] = OutputSpecOf(r, t, v);
  if (dtype != want_dtype || shape != want_shape || (!shape.empty() && shape[0] < 0)) {
    return absl::InternalError(absl::StrCat("server announced ", OutputTensorName(t), " as ",
                                            ShapeString(dtype, shape), ", expected ",
                                            ShapeString(want_dtype, want_shape)));
  }
  return absl::OkStatus();
}

// Caller buffers for outputs the call does not return, or too small for what it returns.
absl::Status ValidateOutputInto(const ComputeRequest& r) {
  const bool none = r.options.reduction == Reduction::kNone;
  const int64_t v = r.w.has_value() ? r.w->dim(0) : -1;  // -1: behind a weight handle
  for (const auto& [tensor, buf] : r.output_into) {
    bool returned = true;
    switch (tensor) {
      case OutputTensor::kLoss: returned = none; break;
      case OutputTensor::kZLoss: returned = none && r.want.z_loss; break;
      case OutputTensor::kLse: returned = r.want.lse; break;
      case OutputTensor::kPredictions: returned = r.want.predictions; break;
      case OutputTensor::kDx: returned = r.want.dx; break;
      case OutputTensor::kDw:
        returned = r.want.dw && r.accumulator.empty() && r.head.empty();
        break;
      case OutputTensor::kDb:
        // With a handle the bias is the handle's: whether one comes back is known only then.
        returned = r.want.db && r.accumulator.empty() && r.head.empty() &&
                   (r.bias.has_value() || !r.w.has_value());
        break;
      case OutputTensor::kLogp: returned = r.kind == LossKind::kLogprob; break;
      case OutputTensor::kEntropy:
        returned = r.kind == LossKind::kLogprob && r.want.entropy;
        break;
    }
    const std::string name = OutputTensorName(tensor);
    if (!returned) {
      return absl::InvalidArgumentError(absl::StrCat(
          "output_into[", name, "]: this call does not return ", name,
          " (see want, options.reduction, kind, accumulator and head)"));
    }
    if (v < 0 && (tensor == OutputTensor::kDw || tensor == OutputTensor::kDb)) continue;
    // A backward's H is its ticket's: dX's size is known only from the reply.
    if (!r.ticket.empty() && tensor == OutputTensor::kDx) continue;
    const auto [dtype, shape] = OutputSpecOf(r, tensor, v);
    absl::StatusOr<size_t> need = TensorByteSize(dtype, shape);
    if (need.ok() && buf.data != nullptr && buf.capacity < *need) {
      return absl::InvalidArgumentError(
          absl::StrCat("output_into[", name, "] holds ", buf.capacity, " bytes; the ",
                       ShapeString(dtype, shape), " result needs ", *need));
    }
  }
  return absl::OkStatus();
}

// A head names the weight and where dW/db go: nothing else may (the server refuses them
// together; refused here before anything is sent).
absl::Status ValidateHeadFields(const ComputeRequest& r) {
  if (r.head.empty()) {
    if (r.head_version != 0 || r.rank != 0 || r.micro_batch != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head_version (", r.head_version, "), rank (", r.rank, ") and micro_batch (",
          r.micro_batch, ") go with a head; no head is named"));
    }
    return absl::OkStatus();
  }
  const std::pair<bool, const char*> others[] = {{r.w.has_value(), "w"},
                                                 {!r.weight_handle.empty(), "weight_handle"},
                                                 {r.bias.has_value(), "bias"},
                                                 {!r.accumulator.empty(), "accumulator"}};
  for (const auto& [given, field] : others) {
    if (given) {
      return absl::InvalidArgumentError(absl::StrCat(
          "head '", r.head, "' is the weight and takes the gradients: give no ", field,
          " with it"));
    }
  }
  return absl::OkStatus();
}

// The inputs of the other loss kinds: each well formed, and the teacher's head named once.
// Which kind takes which input, and their shapes, are the server's to check (one set of
// rules, core/loss_problem_check).
absl::Status ValidateKindInputs(const ComputeRequest& r) {
  const std::pair<const std::optional<HostTensor>*, const char*> inputs[] = {
      {&r.dlogp, "dlogp"},         {&r.dentropy, "dentropy"},   {&r.advantages, "advantages"},
      {&r.old_logp, "old_logp"},   {&r.ref_logp, "ref_logp"},   {&r.teacher_x, "teacher_x"},
      {&r.teacher_w, "teacher_w"}, {&r.teacher_bias, "teacher_bias"}, {&r.is_ratio, "is_ratio"},
      {&r.teacher_topk_ids, "teacher_topk_ids"}, {&r.teacher_topk_logp, "teacher_topk_logp"}};
  for (const auto& [t, name] : inputs) {
    if (t->has_value()) LOSSD_RETURN_IF_ERROR((*t)->Validate(name));
  }
  if (r.teacher_w.has_value() && !r.teacher_weight_handle.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "give one of teacher_w and teacher_weight_handle ('", r.teacher_weight_handle,
        "'), not both"));
  }
  if (r.teacher_bias.has_value() && !r.teacher_w.has_value()) {
    return absl::InvalidArgumentError(
        "teacher_bias goes with an inline teacher_w; a teacher weight handle carries its own "
        "bias");
  }
  const bool topk = r.teacher_topk_ids.has_value() || r.teacher_topk_logp.has_value();
  if (r.kind == LossKind::kDistill && !r.teacher_w.has_value() &&
      r.teacher_weight_handle.empty() && !topk) {
    return absl::InvalidArgumentError(
        "kind distill needs the teacher's head: teacher_w or teacher_weight_handle (or its "
        "top-k: teacher_topk_ids and teacher_topk_logp)");
  }
  return absl::OkStatus();
}

// verl's menu (docs/rl_losses.md). The core enums carry the wire's values; at its default each
// field is off the wire (proto3), so an older server reads the request as before.
void SetVerlFields(const PolicyParams& policy, v1::PolicyOptions* p) {
  p->set_kl_estimator(static_cast<v1::PolicyKlEstimator>(policy.kl_estimator));
  p->set_kl_straight_through(policy.kl_straight_through);
  p->set_entropy_coeff(policy.entropy_coeff);
  p->set_aggregation(static_cast<v1::PolicyAggregation>(policy.aggregation));
  p->set_loss_scale_factor(policy.loss_scale_factor);
  if (policy.loss_type == PolicyLossType::kKlCov) {  // else unset: an older server reads on
    p->set_kl_cov_ratio(policy.kl_cov_ratio);
    p->set_ppo_kl_coef(policy.ppo_kl_coef);
  }
  if (policy.loss_type == PolicyLossType::kVespo) {  // likewise
    p->set_vespo_k_pos(policy.vespo_k_pos);
    p->set_vespo_lambda_pos(policy.vespo_lambda_pos);
    p->set_vespo_k_neg(policy.vespo_k_neg);
    p->set_vespo_lambda_neg(policy.vespo_lambda_neg);
  }
}

// The loss kind's fields of the header. Left unset for plain cross-entropy at T = 1, so such
// a request reads as it always has to a server that predates the kinds.
void SetKindFields(const ComputeRequest& r, v1::ComputeHeader* h) {
  if (r.kind != LossKind::kCrossEntropy) h->set_kind(ToProto(r.kind));
  if (r.kind != LossKind::kCrossEntropy || r.options.temperature != kDefaultTemperature) {
    h->mutable_options()->set_temperature(r.options.temperature);
  }
  if (r.want.entropy) h->mutable_outputs()->set_entropy(true);
  if (r.kind == LossKind::kPolicy) {
    v1::PolicyOptions* p = h->mutable_policy();
    p->set_loss_type(ToProto(r.policy.loss_type));
    p->set_epsilon_low(r.policy.epsilon_low);
    p->set_epsilon_high(r.policy.epsilon_high);
    p->set_beta(r.policy.beta);
    p->set_sequences(r.policy.sequences);
    p->set_max_completion_length(r.policy.max_completion_length);
    p->set_dapo_normalizer(r.policy.dapo_normalizer);
    p->set_sapo_temperature_pos(r.policy.sapo_temperature_pos);
    p->set_sapo_temperature_neg(r.policy.sapo_temperature_neg);
    if (r.policy.delta != 0.0f) p->set_delta(r.policy.delta);
    p->set_use_bias_correction_kl(r.policy.use_bias_correction_kl);
    // Token level (the default) is left unset, so an older server reads the request as before.
    if (r.policy.importance_sampling != ImportanceSampling::kToken) {
      p->set_importance_sampling(
          static_cast<v1::PolicyImportanceSampling>(r.policy.importance_sampling));
    }
    SetVerlFields(r.policy, p);
  }
  if (r.kind == LossKind::kDistill) {
    v1::DistillOptions* d = h->mutable_distill();
    d->set_jsd_beta(r.distill.jsd_beta);
    // The default weights (the divergence alone) stay unset: an older server reads the
    // request as before.
    if (DistillWeighted(r.distill)) {
      d->set_weight_hard_loss(r.distill.weight_hard_loss);
      d->set_weight_soft_loss(r.distill.weight_soft_loss);
    }
    if (r.distill.topk_tail != DistillTopkTail::kBucket) {  // the default stays unset too
      d->set_topk_tail(static_cast<v1::DistillTopkTail>(r.distill.topk_tail));
    }
  }
  const std::pair<const std::optional<HostTensor>*, v1::TensorSpec* (v1::ComputeHeader::*)()>
      specs[] = {{&r.dlogp, &v1::ComputeHeader::mutable_dlogp},
                 {&r.dentropy, &v1::ComputeHeader::mutable_dentropy},
                 {&r.advantages, &v1::ComputeHeader::mutable_advantages},
                 {&r.old_logp, &v1::ComputeHeader::mutable_old_logp},
                 {&r.ref_logp, &v1::ComputeHeader::mutable_ref_logp},
                 {&r.is_ratio, &v1::ComputeHeader::mutable_is_ratio},
                 {&r.teacher_x, &v1::ComputeHeader::mutable_teacher_x},
                 {&r.teacher_w, &v1::ComputeHeader::mutable_teacher_w},
                 {&r.teacher_bias, &v1::ComputeHeader::mutable_teacher_bias},
                 {&r.teacher_topk_ids, &v1::ComputeHeader::mutable_teacher_topk_ids},
                 {&r.teacher_topk_logp, &v1::ComputeHeader::mutable_teacher_topk_logp}};
  for (const auto& [t, spec] : specs) {
    if (t->has_value()) FillSpec(**t, (h->*spec)());
  }
  h->set_teacher_weight_handle(r.teacher_weight_handle);
}

bool Given(const HostTensor& t) { return t.rank() != 0 || t.data() != nullptr; }

// A backward naming a ticket: only the upstream gradients (everything else is the ticket's).
absl::Status ValidateBackward(const ComputeRequest& r) {
  const std::pair<bool, const char*> kept[] = {
      {Given(r.x), "x"},
      {Given(r.targets), "targets"},
      {r.w.has_value(), "w"},
      {r.bias.has_value(), "bias"},
      {!r.weight_handle.empty(), "weight_handle"},
      {!r.head.empty(), "head"},
      {r.class_weights.has_value(), "class_weights"},
      {r.grad_output.has_value(), "grad_output"},
      {r.advantages.has_value() || r.old_logp.has_value() || r.ref_logp.has_value() ||
           r.is_ratio.has_value(),
       "a policy input"},
      {r.teacher_x.has_value() || r.teacher_w.has_value() || r.teacher_bias.has_value() ||
           !r.teacher_weight_handle.empty() || r.teacher_topk_ids.has_value() ||
           r.teacher_topk_logp.has_value(),
       "a distill input"},
      {r.keep_ms != 0, "keep_ms"}};
  for (const auto& [given, field] : kept) {
    if (given) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the backward of ticket '", r.ticket, "' gives ", field, ": a backward gives only "
          "dlogp and/or dentropy (the rest is the ticket's)"));
    }
  }
  if (r.kind != LossKind::kLogprob) {
    return absl::InvalidArgumentError(
        absl::StrCat("ticket '", r.ticket, "' names a two-phase logprob forward; set kind "
                     "logprob"));
  }
  if (!r.dlogp.has_value() && !r.dentropy.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the backward of ticket '", r.ticket, "' needs dlogp and/or dentropy, (BT) fp32"));
  }
  if (r.dlogp && r.dentropy && r.dlogp->rank() == 1 && r.dentropy->rank() == 1 &&
      r.dlogp->dim(0) != r.dentropy->dim(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "dlogp ", r.dlogp->DebugString(), " and dentropy ", r.dentropy->DebugString(),
        " must both be (BT)"));
  }
  const HostTensor& rows = r.dlogp ? *r.dlogp : *r.dentropy;
  if (rows.rank() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        r.dlogp ? "dlogp" : "dentropy", " must be (BT) fp32, got ", rows.DebugString()));
  }
  LOSSD_RETURN_IF_ERROR(ValidateKindInputs(r));
  return ValidateOutputInto(r);
}

}  // namespace

int64_t RowsOf(const ComputeRequest& r) {
  if (r.ticket.empty()) return r.x.dim(0);
  const std::optional<HostTensor>& rows = r.dlogp ? r.dlogp : r.dentropy;
  return rows && rows->rank() == 1 ? rows->dim(0) : 0;
}

bool HasTargets(const ComputeRequest& r) {
  if (!r.ticket.empty()) return false;  // a backward's are its ticket's
  return r.kind != LossKind::kDistill || r.targets.rank() != 0 || r.targets.data() != nullptr;
}

absl::Status ValidateRequest(const ComputeRequest& r) {
  if (!r.ticket.empty()) return ValidateBackward(r);
  if (r.keep_ms != 0 && r.kind != LossKind::kLogprob) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keep_ms ", r.keep_ms, " keeps a two-phase logprob forward; set kind logprob"));
  }
  LOSSD_RETURN_IF_ERROR(r.x.Validate("x"));
  if (HasTargets(r)) LOSSD_RETURN_IF_ERROR(r.targets.Validate("targets"));
  if (r.x.rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("x must be (BT, H), got ", r.x.DebugString()));
  }
  LOSSD_RETURN_IF_ERROR(ValidateHeadFields(r));
  if (r.head.empty() && r.w.has_value() == !r.weight_handle.empty()) {
    return absl::InvalidArgumentError("give exactly one of w, weight_handle and head");
  }
  if (r.w.has_value()) {
    LOSSD_RETURN_IF_ERROR(r.w->Validate("w"));
    if (r.w->rank() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("w must be (V, H), got ", r.w->DebugString()));
    }
  }
  if (r.bias.has_value()) {
    if (!r.w.has_value()) {
      return absl::InvalidArgumentError(
          "bias goes with inline weights; a weight handle carries its own bias");
    }
    LOSSD_RETURN_IF_ERROR(r.bias->Validate("bias"));
  }
  if (r.class_weights.has_value()) {
    LOSSD_RETURN_IF_ERROR(r.class_weights->Validate("class_weights"));
  }
  if (r.grad_output.has_value()) {
    LOSSD_RETURN_IF_ERROR(r.grad_output->Validate("grad_output"));
  }
  LOSSD_RETURN_IF_ERROR(ValidateKindInputs(r));
  return ValidateOutputInto(r);
}

v1::ComputeRequest ComputeHeaderOf(const ComputeRequest& r, const std::string& instance,
                                   uint32_t response_part_bytes, bool overlap,
                                   const std::string& head_instance) {
  v1::ComputeRequest head;
  v1::ComputeHeader* h = head.mutable_header();
  const bool backward = !r.ticket.empty();
  if (!backward) FillSpec(r.x, h->mutable_x());
  if (r.w.has_value()) FillSpec(*r.w, h->mutable_w());
  h->set_weight_handle(r.weight_handle);
  if (r.bias.has_value()) FillSpec(*r.bias, h->mutable_bias());
  if (HasTargets(r)) FillSpec(r.targets, h->mutable_targets());
  if (r.class_weights.has_value()) FillSpec(*r.class_weights, h->mutable_class_weights());
  if (r.grad_output.has_value()) FillSpec(*r.grad_output, h->mutable_grad_output());
  v1::LossOptions* o = h->mutable_options();
  o->set_ignore_index(r.options.ignore_index);
  o->set_reduction(ToProto(r.options.reduction));
  o->set_label_smoothing(r.options.label_smoothing);
  o->set_lse_square_scale(r.options.z_loss_scale);
  o->set_softcap(r.options.softcap);
  o->set_grad_dtype(r.grad_dtype.has_value() ? ToProto(*r.grad_dtype) : v1::DTYPE_UNSPECIFIED);
  o->set_grad_scale(r.options.grad_scale);
  o->set_chunk_rows(r.options.chunk_rows);
  o->set_token_scaling(r.options.token_scaling);  // false is not on the wire: old servers too
  v1::Outputs* want = h->mutable_outputs();
  want->set_dx(r.want.dx);
  want->set_dw(r.want.dw);
  want->set_db(r.want.db);
  want->set_lse(r.want.lse);
  want->set_z_loss(r.want.z_loss);
  want->set_accuracy(r.want.accuracy);
  want->set_predictions(r.want.predictions);
  SetKindFields(r, h);
  if (backward) {
    // The forward's options are the ticket's: a backward repeats none of them (a different
    // value is refused), so they stay off the wire.
    o->clear_ignore_index();
    o->clear_temperature();
    o->set_softcap(0);
    o->set_chunk_rows(0);
    h->set_ticket(r.ticket);
    // A head's ticket: the key of this backward in the head's step (the head is the
    // ticket's).
    h->set_rank(r.rank);
    h->set_micro_batch(r.micro_batch);
  }
  h->set_keep_ms(r.keep_ms);
  h->set_accumulator(r.accumulator);
  if (!r.accumulator.empty()) h->set_accumulator_instance(instance);
  h->set_response_part_bytes(response_part_bytes);
  h->set_overlap(overlap);
  if (!r.head.empty()) {  // unset otherwise: an older server refuses fields it does not know
    h->set_head(r.head);
    h->set_head_version(r.head_version);
    h->set_rank(r.rank);
    h->set_micro_batch(r.micro_batch);
    h->set_head_instance(head_instance);
  }
  return head;
}

void AppendComputeInputs(const ComputeRequest& r, size_t part_bytes, wire::SliceTracker* tracker,
                         std::vector<grpc::ByteBuffer>* out, uint64_t* bytes) {
  const size_t pb = part_bytes;
  if (r.w.has_value()) AppendParts(v1::TENSOR_W, *r.w, pb, tracker, out, bytes);
  if (r.teacher_w.has_value()) {
    AppendParts(v1::TENSOR_TEACHER_W, *r.teacher_w, pb, tracker, out, bytes);
  }
  if (r.bias.has_value()) AppendParts(v1::TENSOR_BIAS, *r.bias, pb, tracker, out, bytes);
  if (r.teacher_bias.has_value()) {
    AppendParts(v1::TENSOR_TEACHER_BIAS, *r.teacher_bias, pb, tracker, out, bytes);
  }
  if (r.class_weights.has_value()) {
    AppendParts(v1::TENSOR_CLASS_WEIGHTS, *r.class_weights, pb, tracker, out, bytes);
  }
  if (HasTargets(r)) AppendParts(v1::TENSOR_TARGETS, r.targets, pb, tracker, out, bytes);
  if (r.grad_output.has_value()) {
    AppendParts(v1::TENSOR_GRAD_OUTPUT, *r.grad_output, pb, tracker, out, bytes);
  }
  // Per-row inputs besides X, teacher_x among them: the server's overlapped path streams only
  // X, so everything else must be in place before X's first rows arrive.
  const std::pair<const std::optional<HostTensor>*, v1::TensorId> rows[] = {
      {&r.dlogp, v1::TENSOR_DLOGP},       {&r.dentropy, v1::TENSOR_DENTROPY},
      {&r.advantages, v1::TENSOR_ADVANTAGES}, {&r.old_logp, v1::TENSOR_OLD_LOGP},
      {&r.ref_logp, v1::TENSOR_REF_LOGP}, {&r.is_ratio, v1::TENSOR_IS_RATIO},
      {&r.teacher_x, v1::TENSOR_TEACHER_X}, {&r.teacher_topk_ids, v1::TENSOR_TEACHER_TOPK_IDS},
      {&r.teacher_topk_logp, v1::TENSOR_TEACHER_TOPK_LOGP}};
  for (const auto& [t, id] : rows) {
    if (t->has_value()) AppendParts(id, **t, pb, tracker, out, bytes);
  }
  if (r.ticket.empty()) AppendParts(v1::TENSOR_X, r.x, pb, tracker, out, bytes);
}

void PrefetchOutputs(const ComputeRequest& r, OutputPrefetcher* prefetched) {
  const int32_t dx_id = static_cast<int32_t>(OutputTensor::kDx);
  const int32_t dw_id = static_cast<int32_t>(OutputTensor::kDw);
  const DType grad = r.grad_dtype.value_or(r.x.dtype());
  // A backward's dX shape is its ticket's, known from the reply only.
  if (r.want.dx && r.ticket.empty() && r.output_into.count(OutputTensor::kDx) == 0) {
    prefetched->Add(dx_id, grad, {r.x.dim(0), r.x.dim(1)});
  }
  if (r.want.dw && r.accumulator.empty() && r.w.has_value() &&
      r.output_into.count(OutputTensor::kDw) == 0) {
    prefetched->Add(dw_id, grad, {r.w->dim(0), r.w->dim(1)});
  }
  prefetched->Start();
}

absl::Status ComputeReplyReader::OnMessage(const grpc::ByteBuffer& msg) {
  absl::Status parsed = frame_.Parse(msg);
  if (!parsed.ok()) return absl::InternalError(parsed.message());
  if (frame_.kind() == wire::StreamFrame::Kind::kPart) {
    if (!have_summary_) return absl::InternalError("server sent a part before its summary");
    if (have_results_ && overlap_) {
      return absl::InternalError("server sent a part after its final summary");
    }
    return receiver_.Accept(frame_);
  }
  if (frame_.kind() != wire::StreamFrame::Kind::kHeader) {
    return absl::InternalError("server sent a ComputeResponse with neither summary nor part");
  }
  return OnSummary();
}

absl::Status ComputeReplyReader::OnSummary() {
  if (have_results_) return absl::InternalError("server sent a second summary");
  v1::ComputeSummary s;
  if (!s.ParseFromString(frame_.header_bytes())) {
    return absl::InternalError("cannot parse the server's ComputeSummary");
  }
  if (s.tensors_size() != s.specs_size()) {
    return absl::InternalError(absl::StrCat("summary lists ", s.tensors_size(), " tensors but ",
                                            s.specs_size(), " specs"));
  }
  if (s.preliminary() != (overlap_ && !have_summary_)) {
    return absl::InternalError(absl::StrCat(
        "server sent a ", s.preliminary() ? "preliminary" : "final", " summary where a ",
        s.preliminary() ? "final" : "preliminary", " one was due (overlap ",
        overlap_ ? "on" : "off", ")"));
  }
  if (have_summary_) {  // the final summary of an overlapped call: the same outputs
    if (s.tensors_size() != announced_) {
      return absl::InternalError(absl::StrCat("final summary lists ", s.tensors_size(),
                                              " tensors; the preliminary one ", announced_));
    }
    LOSSD_RETURN_IF_ERROR(receiver_.CheckComplete());
  }
  have_results_ = !s.preliminary();
  ComputeResult& result = *result_;
  result.loss = s.loss();
  result.z_loss = s.z_loss();
  result.accuracy = s.accuracy();
  result.tokens = s.tokens();
  result.compute_seconds = s.compute_seconds();
  result.backend = s.backend();
  result.instance = s.instance();
  result.accumulated_micro_batches = s.accumulated_micro_batches();
  result.head_version = s.head_version();
  result.head_added = s.head_added();
  result.kl = s.kl();
  result.clip_fraction = s.clip_fraction();
  result.ticket = s.ticket();
  result.ticket_expires_unix_ms = s.ticket_expires_unix_ms();
  result.nonfinite.clear();
  for (int t : s.nonfinite()) result.nonfinite.push_back(static_cast<OutputTensor>(t));
  if (have_summary_) return absl::OkStatus();
  have_summary_ = true;
  announced_ = s.tensors_size();
  return Announce(s);
}

absl::Status ComputeReplyReader::Announce(const v1::ComputeSummary& s) {
  for (int i = 0; i < s.tensors_size(); ++i) {
    const int32_t id = s.tensors(i);
    if (id < static_cast<int32_t>(OutputTensor::kLoss) ||
        id > static_cast<int32_t>(kLastOutputTensor)) {
      return absl::InternalError(
          absl::StrCat("summary lists ", TensorIdName(id), ", not an output tensor"));
    }
    const OutputTensor t = static_cast<OutputTensor>(id);
    absl::StatusOr<DType> dtype = FromProto(s.specs(i).dtype());
    if (!dtype.ok()) return dtype.status();
    std::vector<int64_t> shape = ShapeOf(s.specs(i));
    LOSSD_RETURN_IF_ERROR(CheckOutputSpec(r_, t, *dtype, shape));
    auto into = r_.output_into.find(t);
    LOSSD_RETURN_IF_ERROR(
        receiver_.Announce(id, *dtype, std::move(shape),
                           into == r_.output_into.end() ? nullptr : &into->second, prefetched_));
  }
  return absl::OkStatus();
}

absl::Status ComputeReplyReader::Finish() {
  if (!have_results_) {
    return absl::InternalError(have_summary_
                                   ? "server ended the stream without its final summary"
                                   : "server ended the stream without a summary");
  }
  LOSSD_RETURN_IF_ERROR(receiver_.CheckComplete());
  for (Incoming& in : receiver_.incoming()) {
    result_->outputs.emplace(static_cast<OutputTensor>(in.id), std::move(in.tensor));
  }
  result_->bytes_received = receiver_.bytes();
  return absl::OkStatus();
}

}  // namespace client
}  // namespace lossd
