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
#include "kernels/policy_rows.h"

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

// Row i counts (targets32[i] >= 0), as PolicyWeights takes it.
std::vector<uint8_t> CountedRows(const std::vector<int32_t>& targets32, int64_t* tokens) {
  std::vector<uint8_t> counted(targets32.size(), 0);
  *tokens = 0;
  for (size_t i = 0; i < targets32.size(); ++i) {
    counted[i] = targets32[i] >= 0 ? 1 : 0;
    *tokens += counted[i];
  }
  return counted;
}

// Each row's token-level ratio exp(logp_i - old_i) from the logp the device wrote (1 without
// old log-probs, and on ignored rows).
std::vector<double> PolicyRatios(const LossProblem& p, const std::vector<int32_t>& targets32,
                                 const std::vector<float>& logp) {
  std::vector<double> ratio(p.bt, 1.0);
  if (p.old_logp == nullptr) return ratio;
  for (int64_t i = 0; i < p.bt; ++i) {
    if (targets32[i] >= 0) {
      ratio[i] = std::exp(static_cast<double>(logp[i]) - static_cast<double>(p.old_logp[i]));
    }
  }
  return ratio;
}

// A policy Compute by sequence (PolicyBySequence): every row's PolicySequenceRows, from the
// logp (and entropy, where its bonus is on) the device wrote.
std::vector<PolicySequenceRow> SequenceRows(const LossProblem& p,
                                            const std::vector<int32_t>& targets32,
                                            const std::vector<float>& logp,
                                            const std::vector<float>* entropy) {
  int64_t tokens = 0;
  const std::vector<uint8_t> counted = CountedRows(targets32, &tokens);
  const std::vector<double> w = PolicyWeights(p, counted, tokens);
  const std::vector<double> lp(logp.begin(), logp.end());
  std::vector<double> h(p.bt, 0.0);
  if (entropy != nullptr) h.assign(entropy->begin(), entropy->end());
  std::vector<PolicySequenceRow> rows(p.bt);
  const int64_t s = PolicyGroupRows(p.policy, p.bt);
  for (int64_t b0 = 0; b0 < p.bt; b0 += s) {
    PolicySequenceRows(p, counted.data(), w.data(), lp.data(), h.data(), b0, rows.data() + b0);
  }
  return rows;
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
  // G = (grad_scale / n) (w_s (d - Q sum d) / T + w_h (softmax(u) - onehot)): the power of
  // two above the larger coefficient goes into the GEMMs' alpha.
  const double c = n > 0 ? static_cast<double>(p.options.grad_scale) / static_cast<double>(n)
                         : 0.0;
  const double soft = c * static_cast<double>(p.distill.weight_soft_loss);
  const double hard = c * static_cast<double>(p.distill.weight_hard_loss);
  const double alpha = PowerOfTwoAbove(std::max(std::fabs(soft), std::fabs(hard)));
  in->alpha = static_cast<float>(alpha);
  in->distill_coef = static_cast<float>(soft / alpha);
  in->hard_coef = static_cast<float>(hard / alpha);
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
  // The hard-label term reads each counted row's label (in [0, V): core's check); the
  // divergence alone only whether the row counts.
  const bool labels = p.distill.weight_hard_loss != 0.0f;
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t t = p.targets != nullptr ? LoadAsInt(p.targets, p.target_dtype, i) : 0;
    if (p.targets != nullptr && t == p.options.ignore_index) {
      (*targets32)[i] = -1;
    } else {
      if (labels) (*targets32)[i] = static_cast<int32_t>(t);
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

std::vector<double> PolicyRowWeights(const LossProblem& p,
                                     const std::vector<int32_t>& targets32, int64_t* tokens) {
  const std::vector<uint8_t> counted = CountedRows(targets32, tokens);
  return PolicyWeights(p, counted, *tokens);
}

std::vector<double> EntropyCoefficients(const LossProblem& p,
                                        const std::vector<int32_t>& targets32) {
  if (p.policy.entropy_coeff == 0.0f) return {};
  int64_t tokens = 0;
  std::vector<double> e = PolicyRowWeights(p, targets32, &tokens);
  const double k = -p.options.grad_scale * static_cast<double>(p.policy.entropy_coeff);
  for (double& x : e) x *= k;
  return e;
}

std::vector<double> SequenceCoefficients(const LossProblem& p,
                                         const std::vector<int32_t>& targets32,
                                         const std::vector<float>& logp) {
  // The entropy bonus's coefficient is EntropyCoefficients' (no entropy value needed here).
  const std::vector<PolicySequenceRow> rows = SequenceRows(p, targets32, logp, nullptr);
  const double gs = p.options.grad_scale;
  std::vector<double> c(p.bt, 0.0);
  for (int64_t i = 0; i < p.bt; ++i) {
    if (targets32[i] >= 0) c[i] = gs * rows[i].coef;
  }
  return c;
}

absl::Status UploadSequenceCoefficients(CallBuffers& m, const std::vector<double>& c,
                                        const std::vector<double>& e, RowLossInputs* in) {
  double largest = 0;
  for (double x : c) largest = std::max(largest, std::fabs(x));
  for (double x : e) largest = std::max(largest, std::fabs(x));
  const double alpha = PowerOfTwoAbove(largest);
  *in = RowLossInputs();
  in->alpha = static_cast<float>(alpha);
  LOSSD_RETURN_IF_ERROR(UploadScaled(m, c, alpha, &in->coef_logp));
  if (!e.empty()) LOSSD_RETURN_IF_ERROR(UploadScaled(m, e, alpha, &in->coef_entropy));
  return absl::OkStatus();
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
  if (p.kind == LossKind::kPolicy && PolicyBySequence(p.policy)) return absl::OkStatus();
  // The coefficients before alpha: grad_scale times dlogp / dentropy (logprob) or times the
  // row's weight (policy), 0 on ignored rows, so that the largest sets alpha.
  std::vector<double> c1(bt, 0.0), c2(bt, 0.0);
  double largest = 0;
  if (p.kind == LossKind::kPolicy) {
    int64_t tokens = 0;
    c1 = PolicyRowWeights(p, targets32, &tokens);
    for (double& w : c1) w *= gs;
    // The entropy bonus's e_i = -entropy_coeff grad_scale w_i (EntropyCoefficients'), from the
    // weights already here.
    const double ec = p.policy.entropy_coeff;
    for (int64_t i = 0; ec != 0 && i < bt; ++i) c2[i] = -ec * c1[i];
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
    in.policy = PolicyRowOptionsOf(p.policy);
    if (p.policy.entropy_coeff != 0.0f) {
      LOSSD_RETURN_IF_ERROR(UploadScaled(m, c2, alpha, &in.coef_entropy));
    }
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
  std::vector<PolicySequenceRow> by_sequence;
  if (p.kind == LossKind::kPolicy && PolicyBySequence(p.policy)) {
    by_sequence = SequenceRows(p, targets32, logp, &entropy);
  } else if (p.kind == LossKind::kPolicy) {
    weight = PolicyRowWeights(p, targets32, &tokens);
    ratio = PolicyRatios(p, targets32, logp);
  }
  tokens = 0;
  for (int64_t i = 0; i < bt; ++i) {
    if (targets32[i] < 0) continue;
    ++tokens;
    if (host.pred[i] == targets32[i]) ++correct;
    if (!by_sequence.empty()) {
      loss += by_sequence[i].loss;
      kl += by_sequence[i].terms.kl;
      clipped += by_sequence[i].terms.clipped ? 1 : 0;
    } else if (p.kind == LossKind::kPolicy) {
      const PolicyRowTerms t = PolicyTerms(p, i, logp[i], entropy[i], ratio[i], false);
      loss += weight[i] * t.loss;
      kl += t.kl;
      clipped += t.clipped ? 1 : 0;
    } else if (p.kind == LossKind::kDistill) {
      // The row's divergence and (with the hard term) its label's cross-entropy.
      loss += static_cast<double>(p.distill.weight_soft_loss) * logp[i];
      if (p.distill.weight_hard_loss != 0.0f) {
        loss += static_cast<double>(p.distill.weight_hard_loss) * entropy[i];
      }
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
