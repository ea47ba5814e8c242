// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/row_loss_io.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"
#include "kernels/backend.h"
#include "kernels/cuda/chunk_plan.h"
#include "kernels/cuda/device_io.h"
#include "kernels/cuda/fused_loss.h"

namespace lossd {
namespace cuda {
namespace {

// Uploads n floats, or leaves *dst null when there are none.
absl::Status UploadRow(CallBuffers& m, const float* src, int64_t n, const float** dst) {
  if (src == nullptr) return absl::OkStatus();
  void* ptr = nullptr;
  LOSSD_RETURN_IF_ERROR(m.Upload(src, static_cast<uint64_t>(n) * 4, &ptr));
  *dst = static_cast<const float*>(ptr);
  return absl::OkStatus();
}

// x_i / alpha in fp32, uploaded (alpha: a power of two, so the division is exact).
absl::Status UploadScaled(CallBuffers& m, const std::vector<double>& x, double alpha,
                          const float** dst) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = static_cast<float>(x[i] / alpha);
  return UploadRow(m, f.data(), static_cast<int64_t>(f.size()), dst);
}

// One policy row's loss terms from its logp at ratio r (its own, or its sequence's):
// policy_reference.h's PolicyRow. At token level the row kernel computes the gradient on the
// device; at sequence level (clipped types only) the host needs its two parts: `own`, the
// derivative in logp_i apart from the ratio (the KL term's), and `via_ratio`, dl_i/dr times r,
// which reaches every row of the sequence through the mean of its log-ratios.
struct PolicyTerms {
  double loss = 0, kl = 0;
  bool clipped = false;
  double own = 0, via_ratio = 0;
};

PolicyTerms PolicyRowTerms(const LossProblem& p, int64_t i, double logp, double r) {
  const PolicyParams& o = p.policy;
  const double a = p.advantages[i];
  PolicyTerms t;
  if (o.loss_type == PolicyLossType::kCispo) {  // -sg(min(r, eps_high)) A logp
    const double bound = static_cast<double>(o.epsilon_high);
    t.loss = -std::min(r, bound) * a * logp;
    t.clipped = r > bound && a > 0;
  } else if (o.loss_type == PolicyLossType::kSapo) {  // -A (4 / tau) sigmoid(tau (r - 1))
    const double tau =
        static_cast<double>(a > 0 ? o.sapo_temperature_pos : o.sapo_temperature_neg);
    t.loss = -a * 4.0 / tau / (1.0 + std::exp(-tau * (r - 1.0)));
  } else {
    const double lo = 1.0 - static_cast<double>(o.epsilon_low);
    const double hi = 1.0 + static_cast<double>(o.epsilon_high);
    const double q = o.delta != 0.0f ? std::min(r, static_cast<double>(o.delta)) : r;
    t.loss = -std::min(q * a, std::clamp(r, lo, hi) * a);
    t.clipped = (r < lo && a < 0) || (r > hi && a > 0);
    // torch's gradient (row_loss_device.cuh's PolicyCoefficient): none where clipped or where
    // delta caps r with A < 0, half on a bound.
    const bool capped = o.delta != 0.0f && r >= static_cast<double>(o.delta) && a < 0;
    const double share = t.clipped || capped ? 0.0 : (r == lo || r == hi) ? 0.5 : 1.0;
    t.via_ratio = -share * a * r;
  }
  if (p.is_ratio != nullptr) {  // the rollout correction, on the surrogate's term only
    t.loss *= p.is_ratio[i];
    t.via_ratio *= p.is_ratio[i];
  }
  if (o.beta != 0.0f && p.ref_logp != nullptr) {
    const double d = p.ref_logp[i] - logp;
    const double k3 = std::exp(d) - d - 1.0;
    t.kl = k3;
    t.own = o.beta * (1.0 - std::exp(d));
    if (o.use_bias_correction_kl) {  // k3 r: (k3 r)' = k3' r + k3 r'
      t.kl = k3 * r;
      t.own *= r;
      t.via_ratio += o.beta * k3 * r;
    }
    t.loss += o.beta * t.kl;
  }
  return t;
}

// Each row's ratio from the logp the device wrote: exp(logp_i - old_i) at token level, its
// sequence's exp(sum of the counted rows' logp_j - old_j / max(1, n_b)) at sequence level
// (1 without old log-probs); 1 on ignored rows.
std::vector<double> PolicyRatios(const LossProblem& p, const std::vector<int32_t>& targets32,
                                 const std::vector<float>& logp) {
  const int64_t bt = p.bt;
  std::vector<double> ratio(bt, 1.0);
  if (p.old_logp == nullptr) return ratio;
  auto log_ratio = [&](int64_t i) {
    return static_cast<double>(logp[i]) - static_cast<double>(p.old_logp[i]);
  };
  if (p.policy.importance_sampling != ImportanceSampling::kSequence) {
    for (int64_t i = 0; i < bt; ++i) {
      if (targets32[i] >= 0) ratio[i] = std::exp(log_ratio(i));
    }
    return ratio;
  }
  const int64_t s = bt / std::max<int64_t>(1, p.policy.sequences);
  for (int64_t b0 = 0; b0 < bt; b0 += s) {
    double sum = 0;
    int64_t n = 0;
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (targets32[i] < 0) continue;
      sum += log_ratio(i);
      ++n;
    }
    const double r = std::exp(sum / std::max<double>(1.0, static_cast<double>(n)));
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (targets32[i] >= 0) ratio[i] = r;
    }
  }
  return ratio;
}

// Distill's teacher (X; W and bias unless in backend memory) and its coefficients.
absl::Status UploadTeacher(CallBuffers& m, const LossProblem& p,
                           const std::vector<int32_t>& targets32, RowLossInputs* in) {
  const size_t elem = DTypeSize(p.dtype);
  const uint64_t th = static_cast<uint64_t>(p.teacher_h), v = static_cast<uint64_t>(p.v);
  void* ptr = nullptr;
  LOSSD_RETURN_IF_ERROR(m.Upload(p.teacher_x, static_cast<uint64_t>(p.bt) * th * elem, &ptr));
  in->teacher_x = ptr;
  in->teacher_h = p.teacher_h;
  if (p.teacher_w_memory == Memory::kHost) {
    LOSSD_RETURN_IF_ERROR(m.Upload(p.teacher_w, v * th * elem, &ptr));
    in->teacher_w = ptr;
    if (p.teacher_bias != nullptr) {
      LOSSD_RETURN_IF_ERROR(m.Upload(p.teacher_bias, v * elem, &ptr));
      in->teacher_bias = ptr;
    }
  } else {
    in->teacher_w = p.teacher_w;
    in->teacher_bias = p.teacher_bias;
  }
  int64_t n = 0;
  for (int32_t t : targets32) n += t >= 0 ? 1 : 0;
  // G = (grad_scale / n) (d - Q sum d) / T: the power of two above grad_scale / n goes into
  // the GEMMs' alpha.
  const double c = n > 0 ? static_cast<double>(p.options.grad_scale) / static_cast<double>(n)
                         : 0.0;
  const double alpha = PowerOfTwoAbove(std::fabs(c));
  in->alpha = static_cast<float>(alpha);
  in->distill_coef = static_cast<float>(c / alpha);
  in->jsd_beta = p.distill.jsd_beta;
  return absl::OkStatus();
}

}  // namespace

bool RowLossKindComputed(LossKind kind) {
  return kind == LossKind::kCrossEntropy || kind == LossKind::kLogprob ||
         kind == LossKind::kPolicy || kind == LossKind::kDistill;
}

absl::StatusOr<TargetSummary> DistillRows(const LossProblem& p,
                                          std::vector<int32_t>* targets32) {
  if (p.target_dtype != DType::kI32 && p.target_dtype != DType::kI64) {
    return absl::InvalidArgumentError("cuda: targets must be int32 or int64");
  }
  TargetSummary s;
  targets32->assign(p.bt, 0);
  for (int64_t i = 0; i < p.bt; ++i) {
    if (p.targets != nullptr &&
        LoadAsInt(p.targets, p.target_dtype, i) == p.options.ignore_index) {
      (*targets32)[i] = -1;
    } else {
      ++s.tokens;
    }
  }
  s.weight_sum = static_cast<double>(s.tokens);
  return s;
}

uint64_t RowLossInputBytes(const WorkspaceShape& s) {
  const uint64_t row = Align(static_cast<uint64_t>(s.bt) * 4);
  switch (s.kind) {
    case LossKind::kLogprob:
      return 2 * row;  // the two coefficients
    case LossKind::kPolicy:
      // weights, advantages, old and reference log-probs, is_ratio (at sequence level only
      // the coefficients: policy_sequence.h)
      return 5 * row;
    case LossKind::kDistill: {
      const uint64_t th = static_cast<uint64_t>(s.teacher_h), v = static_cast<uint64_t>(s.v);
      const uint64_t elem = DTypeSize(s.dtype);
      uint64_t bytes = Align(static_cast<uint64_t>(s.bt) * th * elem);  // teacher X
      if (s.teacher_w_memory == Memory::kHost) bytes += Align(v * th * elem) + Align(v * elem);
      return bytes;
    }
    default:
      return 0;
  }
}

std::vector<double> PolicyRowWeights(const PolicyParams& o,
                                     const std::vector<int32_t>& targets32, int64_t* tokens) {
  const int64_t bt = static_cast<int64_t>(targets32.size());
  const int64_t sequences = std::max<int64_t>(1, o.sequences);
  const int64_t seq = std::max<int64_t>(1, bt / sequences);
  const double b = static_cast<double>(sequences);
  std::vector<int64_t> per_seq(sequences, 0);
  int64_t n = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (targets32[i] < 0) continue;
    ++per_seq[std::min(i / seq, sequences - 1)];
    ++n;
  }
  *tokens = n;
  const double n_clamped = std::max(1.0, static_cast<double>(n));
  std::vector<double> w(bt, 0.0);
  for (int64_t i = 0; i < bt; ++i) {
    if (targets32[i] < 0) continue;
    switch (o.loss_type) {
      case PolicyLossType::kGrpo:
      case PolicyLossType::kSapo:
        w[i] = 1.0 / (b * std::max(1.0, static_cast<double>(per_seq[std::min(
                                            i / seq, sequences - 1)])));
        break;
      case PolicyLossType::kLuspo:  // its sequence's mask count over B S
        w[i] = static_cast<double>(per_seq[std::min(i / seq, sequences - 1)]) /
               static_cast<double>(bt);
        break;
      case PolicyLossType::kBnpo:
        w[i] = 1.0 / n_clamped;
        break;
      case PolicyLossType::kDrGrpo:
        w[i] = 1.0 / (b * static_cast<double>(o.max_completion_length));
        break;
      case PolicyLossType::kDapo:
      case PolicyLossType::kCispo:
        w[i] = 1.0 / std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer
                                                         : static_cast<double>(n));
        break;
    }
  }
  return w;
}

std::vector<double> SequenceCoefficients(const LossProblem& p,
                                         const std::vector<int32_t>& targets32,
                                         const std::vector<float>& logp) {
  const int64_t bt = p.bt;
  int64_t tokens = 0;
  const std::vector<double> w = PolicyRowWeights(p.policy, targets32, &tokens);
  const std::vector<double> ratio = PolicyRatios(p, targets32, logp);
  const double gs = p.options.grad_scale;
  std::vector<double> c(bt, 0.0);
  const int64_t s = bt / std::max<int64_t>(1, p.policy.sequences);
  for (int64_t b0 = 0; b0 < bt; b0 += s) {
    // dloss/dlogp_j = w_j own_j + m_j / max(1, n_b) sum_{i in b} w_i via_ratio_i
    double via = 0;
    int64_t n = 0;
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (targets32[i] < 0) continue;
      const PolicyTerms t = PolicyRowTerms(p, i, logp[i], ratio[i]);
      c[i] = w[i] * t.own;
      via += w[i] * t.via_ratio;
      ++n;
    }
    const double shared = via / std::max<double>(1.0, static_cast<double>(n));
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (targets32[i] >= 0) c[i] = gs * (c[i] + shared);
    }
  }
  return c;
}

absl::Status UploadSequenceCoefficients(CallBuffers& m, const std::vector<double>& c,
                                        RowLossInputs* in) {
  double largest = 0;
  for (double x : c) largest = std::max(largest, std::fabs(x));
  const double alpha = PowerOfTwoAbove(largest);
  *in = RowLossInputs();
  in->alpha = static_cast<float>(alpha);
  return UploadScaled(m, c, alpha, &in->coef_logp);
}

absl::Status UploadRowLossInputs(CallBuffers& m, const LossProblem& p,
                                 const std::vector<int32_t>& targets32, DeviceLossArgs* a) {
  a->kind = p.kind;
  if (p.kind == LossKind::kCrossEntropy) return absl::OkStatus();
  const int64_t bt = p.bt;
  const double gs = p.options.grad_scale;
  RowLossInputs& in = a->row_loss;
  if (p.kind == LossKind::kDistill) return UploadTeacher(m, p, targets32, &in);
  // Sequence level: the coefficients come after a forward pass (EnqueueSequenceForward).
  if (p.kind == LossKind::kPolicy &&
      p.policy.importance_sampling == ImportanceSampling::kSequence) {
    return absl::OkStatus();
  }
  // The coefficients before alpha: grad_scale times dlogp / dentropy (logprob) or times the
  // row's weight (policy), 0 on ignored rows, so that the largest sets alpha.
  std::vector<double> c1(bt, 0.0), c2(bt, 0.0);
  double largest = 0;
  if (p.kind == LossKind::kPolicy) {
    int64_t tokens = 0;
    c1 = PolicyRowWeights(p.policy, targets32, &tokens);
    for (double& w : c1) w *= gs;
  } else {
    for (int64_t i = 0; i < bt; ++i) {
      if (targets32[i] < 0) continue;
      if (p.dlogp != nullptr) c1[i] = gs * p.dlogp[i];
      if (p.dentropy != nullptr) c2[i] = gs * p.dentropy[i];
    }
  }
  for (int64_t i = 0; i < bt; ++i) {
    largest = std::max({largest, std::fabs(c1[i]), std::fabs(c2[i])});
  }
  const double alpha = PowerOfTwoAbove(largest);
  in.alpha = static_cast<float>(alpha);
  if (p.kind == LossKind::kPolicy) {
    LOSSD_RETURN_IF_ERROR(UploadScaled(m, c1, alpha, &in.row_weight));
    LOSSD_RETURN_IF_ERROR(UploadRow(m, p.advantages, bt, &in.advantages));
    LOSSD_RETURN_IF_ERROR(UploadRow(m, p.old_logp, bt, &in.old_logp));
    LOSSD_RETURN_IF_ERROR(UploadRow(m, p.ref_logp, bt, &in.ref_logp));
    LOSSD_RETURN_IF_ERROR(UploadRow(m, p.is_ratio, bt, &in.is_ratio));
    in.epsilon_low = p.policy.epsilon_low;
    in.epsilon_high = p.policy.epsilon_high;
    in.beta = p.policy.beta;
    in.loss_type = static_cast<int32_t>(p.policy.loss_type);
    in.sapo_temperature_pos = p.policy.sapo_temperature_pos;
    in.sapo_temperature_neg = p.policy.sapo_temperature_neg;
    in.delta = p.policy.delta;
    in.use_bias_correction_kl = p.policy.use_bias_correction_kl;
    return absl::OkStatus();
  }
  if (p.dlogp != nullptr) LOSSD_RETURN_IF_ERROR(UploadScaled(m, c1, alpha, &in.coef_logp));
  if (p.dentropy != nullptr) {
    LOSSD_RETURN_IF_ERROR(UploadScaled(m, c2, alpha, &in.coef_entropy));
  }
  return absl::OkStatus();
}

void WriteRowLossOutputs(const LossProblem& p, const LossOutputs& out,
                         const std::vector<int32_t>& targets32, const HostRows& host) {
  const int64_t bt = p.bt;
  const std::vector<float>& logp = host.ce;
  const std::vector<float>& entropy = host.zl;
  double loss = 0, kl = 0;
  int64_t tokens = 0, correct = 0, clipped = 0;
  std::vector<double> weight, ratio;
  if (p.kind == LossKind::kPolicy) {
    weight = PolicyRowWeights(p.policy, targets32, &tokens);
    ratio = PolicyRatios(p, targets32, logp);
  }
  tokens = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (targets32[i] < 0) continue;
    ++tokens;
    if (host.pred[i] == targets32[i]) ++correct;
    if (p.kind == LossKind::kPolicy) {
      const PolicyTerms t = PolicyRowTerms(p, i, logp[i], ratio[i]);
      loss += weight[i] * t.loss;
      kl += t.kl;
      clipped += t.clipped ? 1 : 0;
    } else if (p.kind == LossKind::kDistill) {
      loss += logp[i];  // the row's divergence
    } else {
      if (p.dlogp != nullptr) loss += static_cast<double>(p.dlogp[i]) * logp[i];
      if (p.dentropy != nullptr) loss += static_cast<double>(p.dentropy[i]) * entropy[i];
    }
  }
  if (p.kind == LossKind::kLogprob) loss *= p.options.grad_scale;
  if (p.kind == LossKind::kDistill) loss = tokens > 0 ? loss / static_cast<double>(tokens) : 0.0;
  const double n = std::max<double>(1.0, static_cast<double>(tokens));
  if (out.loss != nullptr) out.loss[0] = static_cast<float>(loss);
  if (out.z_loss != nullptr) out.z_loss[0] = 0.0f;
  if (out.kl != nullptr) out.kl[0] = p.policy.beta != 0.0f ? static_cast<float>(kl / n) : 0.0f;
  if (out.clip_fraction != nullptr) {
    out.clip_fraction[0] = static_cast<float>(static_cast<double>(clipped) / n);
  }
  // Distill has neither output (its rows' divergences sit where logp does).
  if (p.kind != LossKind::kDistill) {
    if (out.logp != nullptr) std::memcpy(out.logp, logp.data(), bt * sizeof(float));
    if (out.entropy != nullptr) std::memcpy(out.entropy, entropy.data(), bt * sizeof(float));
  }
  if (out.lse != nullptr) std::memcpy(out.lse, host.lse.data(), bt * sizeof(float));
  if (out.predictions != nullptr) {
    for (int64_t i = 0; i < bt; ++i) out.predictions[i] = host.pred[i];
  }
  if (out.accuracy != nullptr) {
    *out.accuracy = tokens != 0 ? static_cast<float>(static_cast<double>(correct) /
                                                     static_cast<double>(tokens))
                                : 0.0f;
  }
  if (out.tokens != nullptr) *out.tokens = tokens;
}

}  // namespace cuda
}  // namespace lossd
