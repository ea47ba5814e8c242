// SPDX-License-Identifier: Apache-2.0
#include "service/wire_convert.h"

#include "absl/strings/str_cat.h"
#include "core/loss_problem.h"

namespace lossd {

absl::StatusOr<DType> DTypeFromWire(v1::DType d, absl::string_view field) {
  switch (d) {
    case v1::DTYPE_BF16: return DType::kBF16;
    case v1::DTYPE_FP16: return DType::kF16;
    case v1::DTYPE_FP32: return DType::kF32;
    case v1::DTYPE_INT32: return DType::kI32;
    case v1::DTYPE_INT64: return DType::kI64;
    case v1::DTYPE_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat(field, ".dtype is unspecified"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".dtype ", static_cast<int>(d), " is not a known dtype"));
  }
}

v1::DType DTypeToWire(DType d) {
  switch (d) {
    case DType::kBF16: return v1::DTYPE_BF16;
    case DType::kF16: return v1::DTYPE_FP16;
    case DType::kF32: return v1::DTYPE_FP32;
    case DType::kI32: return v1::DTYPE_INT32;
    case DType::kI64: return v1::DTYPE_INT64;
  }
  return v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<TensorDesc> TensorDescFromWire(bool present, const v1::TensorSpec& spec,
                                              absl::string_view field) {
  TensorDesc t;
  if (!present) return t;
  auto dt = DTypeFromWire(spec.dtype(), field);
  if (!dt.ok()) return dt.status();
  t.present = true;
  t.dtype = *dt;
  t.shape.assign(spec.shape().begin(), spec.shape().end());
  return t;
}

v1::TensorSpec TensorSpecToWire(DType dtype, const std::vector<int64_t>& shape) {
  v1::TensorSpec s;
  s.set_dtype(DTypeToWire(dtype));
  for (int64_t d : shape) s.add_shape(d);
  return s;
}

namespace {

// The kind and its options. A kind or loss type out of range is passed on for the one
// validation to refuse by its number; options for another kind than the header's are refused
// here, where the header's field names are known.
absl::Status KindFromWire(const v1::ComputeHeader& h, ComputeSpec* spec) {
  spec->kind = static_cast<LossKind>(h.kind());
  const std::string kind = v1::LossKind_IsValid(h.kind())
                               ? v1::LossKind_Name(h.kind())
                               : absl::StrCat(static_cast<int>(h.kind()));
  if (h.has_policy() && h.kind() != v1::LOSS_KIND_POLICY) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.policy is for header.kind LOSS_KIND_POLICY; this request's kind is ", kind));
  }
  if (h.has_distill() && h.kind() != v1::LOSS_KIND_DISTILL) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.distill is for header.kind LOSS_KIND_DISTILL; this request's kind is ", kind));
  }
  const v1::PolicyOptions& p = h.policy();
  const PolicyParams defaults;
  PolicyParams& pp = spec->policy;
  pp.loss_type = static_cast<PolicyLossType>(p.loss_type());
  pp.epsilon_low = p.has_epsilon_low() ? p.epsilon_low() : defaults.epsilon_low;
  pp.epsilon_high = p.has_epsilon_high() ? p.epsilon_high() : defaults.epsilon_high;
  pp.beta = p.has_beta() ? p.beta() : defaults.beta;
  pp.sequences = p.sequences() != 0 ? p.sequences() : defaults.sequences;
  pp.max_completion_length = p.max_completion_length();
  pp.dapo_normalizer = p.dapo_normalizer();
  pp.sapo_temperature_pos =
      p.has_sapo_temperature_pos() ? p.sapo_temperature_pos() : defaults.sapo_temperature_pos;
  pp.sapo_temperature_neg =
      p.has_sapo_temperature_neg() ? p.sapo_temperature_neg() : defaults.sapo_temperature_neg;
  pp.delta = p.has_delta() ? p.delta() : defaults.delta;
  pp.use_bias_correction_kl = p.use_bias_correction_kl();
  pp.importance_sampling = static_cast<ImportanceSampling>(p.importance_sampling());
  pp.kl_estimator = static_cast<KlEstimator>(p.kl_estimator());
  pp.kl_straight_through = p.kl_straight_through();
  pp.entropy_coeff = p.entropy_coeff();
  pp.aggregation = static_cast<PolicyAggregation>(p.aggregation());
  pp.loss_scale_factor = p.loss_scale_factor();
  pp.kl_cov_ratio = p.has_kl_cov_ratio() ? p.kl_cov_ratio() : defaults.kl_cov_ratio;
  pp.ppo_kl_coef = p.has_ppo_kl_coef() ? p.ppo_kl_coef() : defaults.ppo_kl_coef;
  pp.vespo_k_pos = p.has_vespo_k_pos() ? p.vespo_k_pos() : defaults.vespo_k_pos;
  pp.vespo_lambda_pos = p.has_vespo_lambda_pos() ? p.vespo_lambda_pos() : defaults.vespo_lambda_pos;
  pp.vespo_k_neg = p.has_vespo_k_neg() ? p.vespo_k_neg() : defaults.vespo_k_neg;
  pp.vespo_lambda_neg = p.has_vespo_lambda_neg() ? p.vespo_lambda_neg() : defaults.vespo_lambda_neg;
  const v1::DistillOptions& d = h.distill();
  const DistillParams distill_defaults;
  spec->distill.jsd_beta = d.has_jsd_beta() ? d.jsd_beta() : distill_defaults.jsd_beta;
  spec->distill.weight_hard_loss =
      d.has_weight_hard_loss() ? d.weight_hard_loss() : distill_defaults.weight_hard_loss;
  spec->distill.weight_soft_loss =
      d.has_weight_soft_loss() ? d.weight_soft_loss() : distill_defaults.weight_soft_loss;
  // Out of range: passed on for the one validation to refuse by its number.
  spec->distill.topk_tail = static_cast<DistillTopkTail>(d.topk_tail());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ComputeSpec> ComputeSpecFromWire(const v1::ComputeHeader& h) {
  ComputeSpec spec;
  struct Field {
    InputSlot slot;
    bool present;
    const v1::TensorSpec* spec;
    const char* name;
  };
  const Field fields[] = {
      {InputSlot::kX, h.has_x(), &h.x(), "header.x"},
      {InputSlot::kW, h.has_w(), &h.w(), "header.w"},
      {InputSlot::kBias, h.has_bias(), &h.bias(), "header.bias"},
      {InputSlot::kTargets, h.has_targets(), &h.targets(), "header.targets"},
      {InputSlot::kClassWeights, h.has_class_weights(), &h.class_weights(),
       "header.class_weights"},
      {InputSlot::kGradOutput, h.has_grad_output(), &h.grad_output(), "header.grad_output"},
      {InputSlot::kDlogp, h.has_dlogp(), &h.dlogp(), "header.dlogp"},
      {InputSlot::kDentropy, h.has_dentropy(), &h.dentropy(), "header.dentropy"},
      {InputSlot::kAdvantages, h.has_advantages(), &h.advantages(), "header.advantages"},
      {InputSlot::kOldLogp, h.has_old_logp(), &h.old_logp(), "header.old_logp"},
      {InputSlot::kRefLogp, h.has_ref_logp(), &h.ref_logp(), "header.ref_logp"},
      {InputSlot::kIsRatio, h.has_is_ratio(), &h.is_ratio(), "header.is_ratio"},
      {InputSlot::kTeacherX, h.has_teacher_x(), &h.teacher_x(), "header.teacher_x"},
      {InputSlot::kTeacherW, h.has_teacher_w(), &h.teacher_w(), "header.teacher_w"},
      {InputSlot::kTeacherBias, h.has_teacher_bias(), &h.teacher_bias(),
       "header.teacher_bias"},
      {InputSlot::kTeacherTopkIds, h.has_teacher_topk_ids(), &h.teacher_topk_ids(),
       "header.teacher_topk_ids"},
      {InputSlot::kTeacherTopkLogp, h.has_teacher_topk_logp(), &h.teacher_topk_logp(),
       "header.teacher_topk_logp"},
  };
  for (const Field& f : fields) {
    auto t = TensorDescFromWire(f.present, *f.spec, f.name);
    if (!t.ok()) return t.status();
    spec.inputs[static_cast<int>(f.slot)] = std::move(*t);
  }
  spec.weight_handle = h.weight_handle();
  spec.teacher_weight_handle = h.teacher_weight_handle();
  if (absl::Status k = KindFromWire(h, &spec); !k.ok()) return k;
  const v1::LossOptions& o = h.options();
  spec.options.ignore_index = o.has_ignore_index() ? o.ignore_index() : kDefaultIgnoreIndex;
  switch (o.reduction()) {
    case v1::REDUCTION_MEAN: spec.options.reduction = Reduction::kMean; break;
    case v1::REDUCTION_SUM: spec.options.reduction = Reduction::kSum; break;
    case v1::REDUCTION_NONE: spec.options.reduction = Reduction::kNone; break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "header.options.reduction ", static_cast<int>(o.reduction()), " is not known"));
  }
  spec.options.label_smoothing = o.label_smoothing();
  spec.options.z_loss_scale = o.lse_square_scale();
  spec.options.softcap = o.softcap();
  spec.options.grad_scale = o.has_grad_scale() ? o.grad_scale() : kDefaultGradScale;
  spec.options.chunk_rows = o.chunk_rows();
  spec.options.token_scaling = o.token_scaling();
  spec.options.temperature = o.has_temperature() ? o.temperature() : kDefaultTemperature;
  spec.temperature_set = o.has_temperature();
  spec.ignore_index_set = o.has_ignore_index();
  if (o.grad_dtype() == v1::DTYPE_FP32) {
    spec.grad_fp32 = true;
  } else if (o.grad_dtype() != v1::DTYPE_UNSPECIFIED) {
    // The input dtype itself is accepted too (it is the default).
    const TensorDesc& x = spec.inputs[static_cast<int>(InputSlot::kX)];
    if (!x.present || DTypeToWire(x.dtype) != o.grad_dtype()) {
      const std::string name = v1::DType_IsValid(o.grad_dtype())
                                   ? v1::DType_Name(o.grad_dtype())
                                   : absl::StrCat(static_cast<int>(o.grad_dtype()));
      return absl::InvalidArgumentError(
          absl::StrCat("header.options.grad_dtype ", name,
                       " must be DTYPE_UNSPECIFIED (the input dtype) or DTYPE_FP32"));
    }
  }
  const v1::Outputs& w = h.outputs();
  spec.wanted.dx = w.dx();
  spec.wanted.dw = w.dw();
  spec.wanted.db = w.db();
  spec.wanted.lse = w.lse();
  spec.wanted.z_loss = w.z_loss();
  spec.wanted.accuracy = w.accuracy();
  spec.wanted.predictions = w.predictions();
  spec.wanted.entropy = w.entropy();
  spec.accumulator = h.accumulator();
  spec.accumulator_instance = h.accumulator_instance();
  spec.head = h.head();
  spec.head_version = h.head_version();
  spec.rank = h.rank();
  spec.micro_batch = h.micro_batch();
  spec.head_instance = h.head_instance();
  spec.keep_ms = h.keep_ms();
  spec.ticket = h.ticket();
  spec.overlap = h.overlap();
  spec.allow_nonfinite_loss = h.allow_nonfinite_loss();
  return spec;
}

absl::StatusOr<InputSlot> InputSlotFromWire(v1::TensorId id) {
  switch (id) {
    case v1::TENSOR_X: return InputSlot::kX;
    case v1::TENSOR_W: return InputSlot::kW;
    case v1::TENSOR_BIAS: return InputSlot::kBias;
    case v1::TENSOR_TARGETS: return InputSlot::kTargets;
    case v1::TENSOR_CLASS_WEIGHTS: return InputSlot::kClassWeights;
    case v1::TENSOR_GRAD_OUTPUT: return InputSlot::kGradOutput;
    case v1::TENSOR_DLOGP: return InputSlot::kDlogp;
    case v1::TENSOR_DENTROPY: return InputSlot::kDentropy;
    case v1::TENSOR_ADVANTAGES: return InputSlot::kAdvantages;
    case v1::TENSOR_OLD_LOGP: return InputSlot::kOldLogp;
    case v1::TENSOR_REF_LOGP: return InputSlot::kRefLogp;
    case v1::TENSOR_IS_RATIO: return InputSlot::kIsRatio;
    case v1::TENSOR_TEACHER_TOPK_IDS: return InputSlot::kTeacherTopkIds;
    case v1::TENSOR_TEACHER_TOPK_LOGP: return InputSlot::kTeacherTopkLogp;
    case v1::TENSOR_TEACHER_X: return InputSlot::kTeacherX;
    case v1::TENSOR_TEACHER_W: return InputSlot::kTeacherW;
    case v1::TENSOR_TEACHER_BIAS: return InputSlot::kTeacherBias;
    default:
      break;
  }
  const std::string name = v1::TensorId_IsValid(id) ? v1::TensorId_Name(id)
                                                    : absl::StrCat(static_cast<int>(id));
  return absl::InvalidArgumentError(
      absl::StrCat("part.tensor ", name, " is not an input tensor of Compute"));
}

std::vector<v1::TensorId> NonFiniteToWire(uint32_t bits) {
  std::vector<v1::TensorId> ids;
  if ((bits & kNonFiniteDx) != 0) ids.push_back(v1::TENSOR_DX);
  if ((bits & kNonFiniteDw) != 0) ids.push_back(v1::TENSOR_DW);
  if ((bits & kNonFiniteDb) != 0) ids.push_back(v1::TENSOR_DB);
  return ids;
}

v1::TensorId OutputSlotToWire(OutputSlot s) {
  switch (s) {
    case OutputSlot::kLoss: return v1::TENSOR_LOSS;
    case OutputSlot::kZLoss: return v1::TENSOR_Z_LOSS;
    case OutputSlot::kLse: return v1::TENSOR_LSE;
    case OutputSlot::kPredictions: return v1::TENSOR_PREDICTIONS;
    case OutputSlot::kDx: return v1::TENSOR_DX;
    case OutputSlot::kDw: return v1::TENSOR_DW;
    case OutputSlot::kDb: return v1::TENSOR_DB;
    case OutputSlot::kLogp: return v1::TENSOR_LOGP;
    case OutputSlot::kEntropy: return v1::TENSOR_ENTROPY;
    case OutputSlot::kCount: break;
  }
  return v1::TENSOR_UNSPECIFIED;
}

}  // namespace lossd
