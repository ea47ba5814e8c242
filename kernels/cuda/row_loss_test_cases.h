// What the GPU tests of the CUDA backend's logprob, policy and distill loss kinds share
// (row_loss_test, row_loss_paths_test): the cases, their problems, and the comparison with the
// float64 references (kernels/cpu/logprob_reference.h, policy_reference.h,
// distill_reference.h), which prints the largest errors. The bounds follow the cross-entropy
// tests' model (testing/test_util.h's MatchesReference): what rounding the
// stored logits (unit roundoff u of the input dtype) can change, first order, plus G's own
// storage and the gradient dtype's rounding, plus fp32 arithmetic:
//   logp_i, H_i: twice their first-order bounds (FirstOrderBounds: |dz_j| <= u |raw_j| / T
//     through the softmax), + fp32_rel (|ref| + 1);
//   the losses and metrics: the rows' bounds through their first derivatives, 4 times their
//     root sum of squares (independent rows), + fp32_rel (|ref| + 1);
//   dX, dW, db (relative norm): 2 ||dG|| / ||G|| + grad_u + fp32_rel + the GEMMs' rounding,
//     ||dG|| bounded element by element to first order (distill: a coarser bound from the
//     two heads' rms logits, and its loss from their per-row largest logits).
// Policy's ratios are drawn away from the clip bounds by more than logp's bound, so every
// clipping decision is stable and the clip fraction must match exactly.
// Test-only; never runs a Compute.
#ifndef LOSSD_KERNELS_CUDA_ROW_LOSS_TEST_CASES_H_
#define LOSSD_KERNELS_CUDA_ROW_LOSS_TEST_CASES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_test_fixture.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {

inline constexpr double kMargin = 2.0;

// One case of the matrix; the fields in this order, so a case reads as one initializer.
struct RowCase {
  const char* name;
  LossKind kind;
  float temperature = 1.0f, softcap = 0.0f;
  bool bias = false;
  double ignore = 0;  // share of ignored (policy: masked) rows
  int64_t chunk_rows = 0;
  bool grad_f32 = false, accumulate = false;
  bool dlogp = true, dentropy = false;      // logprob's upstream gradients
  PolicyLossType loss_type = PolicyLossType::kDapo;
  bool old_logp = true, ref_logp = true;    // policy's optional inputs
  float eps_low = 0.2f, eps_high = 0.2f, beta = 0.04f;
  double dapo_normalizer = 0;
  float grad_scale = 0.7f;
  float jsd_beta = 0.5f;        // distill
  int64_t teacher_extra_h = 0;  // distill: the teacher's hidden size is the student's + this
  bool teacher_bias = false;    // distill
  bool no_targets = false;      // distill: every row counts
  float sapo_pos = 1.0f, sapo_neg = 1.05f, delta = 0.0f;  // policy's other loss types
  bool bias_correction = false;
};

inline const RowCase kCases[] = {
    {"logprob_plain", LossKind::kLogprob},
    {"logprob_temp_cap_entropy_bias_ignore", LossKind::kLogprob, 0.7f, 5.0f, true, 0.2, 0,
     false, false, true, true},
    {"logprob_entropy_only_chunked_accum_f32", LossKind::kLogprob, 1.3f, 0.0f, true, 0.1, 7,
     true, true, false, true},
    {"policy_dapo", LossKind::kPolicy, 1.0f, 0.0f, true},
    {"policy_grpo_masked_no_old_temp_cap", LossKind::kPolicy, 0.8f, 4.0f, false, 0.25, 0,
     false, false, true, false, PolicyLossType::kGrpo, false, true},
    {"policy_bnpo_no_kl_chunked_accum", LossKind::kPolicy, 1.0f, 0.0f, true, 0.1, 7, false,
     true, true, false, PolicyLossType::kBnpo, true, false, 0.1f, 0.3f, 0.0f},
    {"policy_dr_grpo_f32", LossKind::kPolicy, 1.0f, 0.0f, false, 0.1, 0, true, false, true,
     false, PolicyLossType::kDrGrpo},
    // A large normaliser: tiny per-row coefficients, which the power of two taken out of G
    // keeps inside fp16's normal range.
    {"policy_dapo_normalizer_1e4", LossKind::kPolicy, 1.0f, 0.0f, true, 0.0, 0, false, false,
     true, false, PolicyLossType::kDapo, true, true, 0.2f, 0.2f, 0.04f, 1e4, 0.5f},
    {"distill_jsd_half_biases_ignore", LossKind::kDistill, 1.0f, 0.0f, true, 0.1, 0, false,
     false, true, false, PolicyLossType::kDapo, true, true, 0.2f, 0.2f, 0.04f, 0, 0.7f, 0.5f,
     8, true},
    {"distill_forward_kl_temp_no_targets_chunked_accum", LossKind::kDistill, 2.0f, 0.0f,
     false, 0.0, 7, false, true, true, false, PolicyLossType::kDapo, true, true, 0.2f, 0.2f,
     0.04f, 0, 0.7f, 0.0f, 0, false, true},
    {"distill_reverse_kl_f32", LossKind::kDistill, 1.0f, 0.0f, true, 0.2, 0, true, false,
     true, false, PolicyLossType::kDapo, true, true, 0.2f, 0.2f, 0.04f, 0, 1.0f, 1.0f, -3},
    // The loss types beyond Liger's first four, delta and the bias-corrected KL (last: the
    // tests name the cases above by index; row_loss_paths_test names luspo's, 13).
    {"policy_cispo", LossKind::kPolicy, 1.0f, 0.0f, true, 0.1, 0, false, false, true, false,
     PolicyLossType::kCispo, true, true, 0.2f, 1.3f, 0.04f, 0, 0.7f, 0.5f, 0, false, false},
    {"policy_sapo_temp_cap_bias_corrected_kl", LossKind::kPolicy, 0.8f, 4.0f, false, 0.2, 0,
     false, false, true, false, PolicyLossType::kSapo, true, true, 0.2f, 0.2f, 0.3f, 0, 0.7f,
     0.5f, 0, false, false, 1.7f, 0.6f, 0.0f, true},
    {"policy_luspo_delta_chunked_accum", LossKind::kPolicy, 1.0f, 0.0f, true, 0.25, 7, false,
     true, true, false, PolicyLossType::kLuspo, true, true, 0.2f, 0.28f, 0.04f, 0, 0.7f, 0.5f,
     0, false, false, 1.0f, 1.05f, 1.5f},
    {"policy_grpo_delta_bias_corrected_kl_f32", LossKind::kPolicy, 1.0f, 0.0f, false, 0.1, 0,
     true, false, true, false, PolicyLossType::kGrpo, true, true, 0.2f, 0.2f, 0.1f, 0, 0.7f,
     0.5f, 0, false, false, 1.0f, 1.05f, 1.4f, true},
};
inline constexpr int kNumCases = static_cast<int>(sizeof(kCases) / sizeof(kCases[0]));

// A problem of `c` at `shape`: the head from RandomProblem, the kind's per-row inputs drawn
// here. Owns every buffer its LossProblem views.
struct RowProblem {
  RandomProblem head;
  std::optional<RandomProblem> teacher;  // distill
  std::vector<float> dlogp, dentropy, advantages, old_logp, ref_logp;
  LossProblem p;
};

// |log r - log bound| > this for every row, so that logp's error never flips a clip.
inline constexpr double kClipMargin = 0.15;

inline RowProblem MakeProblem(const RowCase& c, const Shape& shape, DType dtype,
                              uint64_t seed) {
  OptionCase o{c.name};
  o.cap = c.softcap;
  o.bias = c.bias;
  o.ignore = c.ignore;
  o.chunk_rows = c.chunk_rows;
  RandomProblemSpec spec = SpecOf(shape.bt, shape.h, shape.v, dtype, o, c.grad_scale, seed);
  spec.options.temperature = c.temperature;
  RowProblem r{RandomProblem::Make(spec)};
  LossProblem& p = r.p;
  p = r.head.problem();
  p.kind = c.kind;
  std::mt19937_64 rng(seed * 7919 + 1);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t bt = shape.bt;
  if (c.kind == LossKind::kLogprob) {
    if (c.dlogp) {
      for (int64_t i = 0; i < bt; ++i) r.dlogp.push_back(uni(rng));
      p.dlogp = r.dlogp.data();
    }
    if (c.dentropy) {
      for (int64_t i = 0; i < bt; ++i) r.dentropy.push_back(uni(rng));
      p.dentropy = r.dentropy.data();
    }
    return r;
  }
  if (c.kind == LossKind::kDistill) {
    RandomProblemSpec ts = ShapeSpec(shape.bt, shape.h + c.teacher_extra_h, shape.v, dtype);
    ts.bias = c.teacher_bias;
    ts.seed = seed + 101;
    r.teacher.emplace(RandomProblem::Make(ts));
    p.teacher_h = ts.h;
    p.teacher_x = r.teacher->x.data();
    p.teacher_w = r.teacher->w.data();
    p.teacher_bias = c.teacher_bias ? r.teacher->bias.data() : nullptr;
    p.distill.jsd_beta = c.jsd_beta;
    if (c.no_targets) p.targets = nullptr;
    return r;
  }
  // Policy: the reference's log-probs place the old and reference log-probs.
  LogprobProblem lp;
  lp.head = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  lp.targets = p.targets;
  lp.target_dtype = p.target_dtype;
  lp.options.temperature = c.temperature;
  lp.options.softcap = c.softcap;
  lp.options.ignore_index = p.options.ignore_index;
  LogprobReferenceOutputs lref;
  EXPECT_TRUE(LogprobReference(lp, &lref).ok());
  // The ratio's kinks: the clip bounds, cispo's own bound (eps_high) and delta's cap.
  std::vector<double> kinks = {std::log(1.0 - c.eps_low), std::log(1.0 + c.eps_high)};
  if (c.loss_type == PolicyLossType::kCispo) kinks.push_back(std::log(c.eps_high));
  if (c.delta != 0) kinks.push_back(std::log(c.delta));
  auto near_kink = [&](double d) {
    for (double k : kinks) {
      if (std::fabs(d - k) < kClipMargin) return true;
    }
    return false;
  };
  for (int64_t i = 0; i < bt; ++i) {
    r.advantages.push_back(normal(rng));
    double d = 0;  // log r_i
    do {
      d = 0.7 * uni(rng);
    } while (near_kink(d));
    r.old_logp.push_back(static_cast<float>(lref.logp[i] - d));
    r.ref_logp.push_back(static_cast<float>(lref.logp[i] + 0.3 * normal(rng)));
  }
  p.advantages = r.advantages.data();
  if (c.old_logp) p.old_logp = r.old_logp.data();
  if (c.ref_logp) p.ref_logp = r.ref_logp.data();
  p.policy.loss_type = c.loss_type;
  p.policy.epsilon_low = c.eps_low;
  p.policy.epsilon_high = c.eps_high;
  p.policy.beta = c.beta;
  p.policy.sequences = bt % 4 == 0 ? 4 : 1;
  p.policy.max_completion_length = c.loss_type == PolicyLossType::kDrGrpo ? 64 : 0;
  p.policy.dapo_normalizer = c.dapo_normalizer;
  p.policy.sapo_temperature_pos = c.sapo_pos;
  p.policy.sapo_temperature_neg = c.sapo_neg;
  p.policy.delta = c.delta;
  p.policy.use_bias_correction_kl = c.bias_correction;
  return r;
}

// The outputs these kinds add to HostOutputs', NaN-poisoned.
struct RowOutputs {
  RowOutputs(const LossProblem& p, DType grad_dtype, bool accumulate)
      : base(p, grad_dtype, true, accumulate),
        logp(p.bt, kNaN),
        entropy(p.bt, kNaN) {}
  LossOutputs outputs(LossKind kind) {
    LossOutputs o = base.outputs();
    // Cross-entropy's own outputs are not asked for (the validation refuses them).
    o.lse = nullptr;
    o.z_loss = nullptr;
    o.predictions = nullptr;
    o.accuracy = nullptr;
    if (kind != LossKind::kDistill) o.logp = logp.data();
    if (kind == LossKind::kLogprob) o.entropy = entropy.data();
    if (kind == LossKind::kPolicy) {
      o.kl = &kl;
      o.clip_fraction = &clip_fraction;
    }
    return o;
  }
  static constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  HostOutputs base;
  std::vector<float> logp, entropy;
  float kl = kNaN, clip_fraction = kNaN;
};

// The reference's results in one form for every kind.
struct Expected {
  std::vector<double> logp, entropy, logp_bound, entropy_bound;
  double loss = 0, loss_bound = 0, kl = 0, kl_bound = 0, clip_fraction = 0;
  HeadGradients grad;
  double grad_tol = 0;
};

// Each row's gradient coefficients (row_loss_kernels.h: G_j = c ([j = t] - p_j) -
// e p_j (log p_j + H)) and the bound of c's error per unit of logp's error (policy's c
// depends on logp; 0 for logprob).
struct RowCoefficients {
  std::vector<double> c, e, c_slope;  // (BT), 0 on ignored rows
};

// First-order bounds of what the stored logits' rounding changes (relative u of each raw
// logit, as the cross-entropy tests' ComputeErrorBounds). Per row that counts, with
// d_j = u |raw_j| dz_j/du_j bounding |dz_j| and D = sum_k p_k d_k:
//   |d logp| <= d_t + D,   |dH| <= sum_k p_k |log p_k + H| (d_k + D),   |dp_j| <= p_j (d_j + D);
// and ||dG|| / ||G|| over the batch from each element's bound (c's own error c_slope |d logp|
// included), times the softcap's slope, plus G's storage rounding u |G_j|.
struct HeadBounds {
  std::vector<double> logp, entropy;  // (BT); 0 on ignored rows
  double grad_rel = 0;
};

inline HeadBounds FirstOrderBounds(const LossProblem& p, const RowCoefficients& k, double u) {
  const ReferenceHead head(HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias},
                           p.options.softcap, p.options.temperature);
  const double temp = p.options.temperature, cap = p.options.softcap;
  HeadBounds out;
  out.logp.assign(p.bt, 0.0);
  out.entropy.assign(p.bt, 0.0);
  HeadRow row;
  std::vector<double> prob, d(p.v);
  double err2 = 0, norm2 = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    if (t == p.options.ignore_index) continue;
    head.Row(i, &row);
    Softmax(row, &prob);
    double pz = 0, big_d = 0;
    for (int64_t j = 0; j < p.v; ++j) {
      const double zc = row.z[j] * temp;  // the softcapped logit: raw through atanh
      const double raw = cap > 0 ? cap * std::atanh(std::min(0.999999999, std::fabs(zc) / cap))
                                 : std::fabs(zc);
      d[j] = u * raw * row.dz_du[j];
      big_d += prob[j] * d[j];
      pz += prob[j] * row.z[j];
    }
    const double h = row.lse - pz;
    double dh = 0;
    for (int64_t j = 0; j < p.v; ++j) {
      dh += prob[j] * std::fabs(row.z[j] - row.lse + h) * (d[j] + big_d);
    }
    const double dlogp = d[t] + big_d;
    out.logp[i] = dlogp;
    out.entropy[i] = dh;
    if (k.c[i] == 0 && k.e[i] == 0) continue;
    for (int64_t j = 0; j < p.v; ++j) {
      const double pj = prob[j], lp = row.z[j] - row.lse, hot = j == t ? 1.0 : 0.0;
      const double g = k.c[i] * (hot - pj) - k.e[i] * pj * (lp + h);
      const double dpj = pj * (d[j] + big_d);
      double dg = std::fabs(k.c[i]) * dpj + k.c_slope[i] * dlogp * std::fabs(hot - pj) +
                  std::fabs(k.e[i]) * (dpj * (std::fabs(lp + h) + 1) + pj * dh);
      dg += u * std::fabs(g);
      const double chain = row.dz_du[j] * temp;  // the softcap's slope (the 1/T is common)
      err2 += dg * dg * chain * chain;
      norm2 += g * g * chain * chain;
    }
  }
  out.grad_rel = norm2 > 0 ? std::sqrt(err2 / norm2) : 0.0;
  std::printf("    G's first-order relative error bound %.2e\n", out.grad_rel);
  return out;
}

// The per-row bounds of logp and entropy: the first-order ones with a margin, and fp32
// arithmetic.
inline void RowBounds(const HeadBounds& b, const Tolerance& tol, Expected* e) {
  for (size_t i = 0; i < b.logp.size(); ++i) {
    const double h = e->entropy.empty() ? 0.0 : e->entropy[i];
    e->logp_bound.push_back(kMargin * b.logp[i] + tol.fp32_rel * (std::fabs(e->logp[i]) + 1));
    e->entropy_bound.push_back(kMargin * b.entropy[i] + tol.fp32_rel * (h + 1));
  }
}

// The gradients' relative-norm tolerance, as the cross-entropy tests': twice the bound on G's
// relative error (the GEMMs with random X and W carry it over about unchanged), the gradient
// dtype's rounding, fp32 arithmetic, and the GEMMs' own fp32 rounding.
inline double GradTolerance(const LossProblem& p, const Tolerance& tol, double grad_rel) {
  return kMargin * grad_rel + tol.grad_u + tol.fp32_rel +
         4 * std::sqrt(static_cast<double>(std::max(p.v, p.bt))) * std::ldexp(1.0, -24);
}

// A scalar's bound from its rows' (independent) first-order errors: 4 times their root sum of
// squares, as the cross-entropy tests' scalar losses, plus fp32 arithmetic.
inline double ScalarBound(const std::vector<double>& row_errors, double value,
                          const Tolerance& tol) {
  double sq = 0;
  for (double x : row_errors) sq += x * x;
  return 4 * std::sqrt(sq) + tol.fp32_rel * (std::fabs(value) + 1);
}

inline Expected ExpectLogprob(const LossProblem& p, const Tolerance& tol) {
  LogprobProblem lp;
  lp.head = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  lp.targets = p.targets;
  lp.target_dtype = p.target_dtype;
  lp.dlogp = p.dlogp;
  lp.dentropy = p.dentropy;
  lp.options.temperature = p.options.temperature;
  lp.options.softcap = p.options.softcap;
  lp.options.ignore_index = p.options.ignore_index;
  LogprobReferenceOutputs ref;
  EXPECT_TRUE(LogprobReference(lp, &ref).ok());
  Expected e;
  e.logp = ref.logp;
  e.entropy = ref.entropy;
  const double gs = p.options.grad_scale;
  RowCoefficients k;
  for (int64_t i = 0; i < p.bt; ++i) {
    const bool counts = LoadAsInt(p.targets, p.target_dtype, i) != p.options.ignore_index;
    k.c.push_back(counts && p.dlogp != nullptr ? gs * p.dlogp[i] : 0.0);
    k.e.push_back(counts && p.dentropy != nullptr ? gs * p.dentropy[i] : 0.0);
    k.c_slope.push_back(0.0);
  }
  const HeadBounds b = FirstOrderBounds(p, k, tol.logit_u);
  RowBounds(b, tol, &e);
  std::vector<double> row_errors;
  for (int64_t i = 0; i < p.bt; ++i) {
    e.loss += k.c[i] * ref.logp[i] + k.e[i] * ref.entropy[i];
    row_errors.push_back(std::fabs(k.c[i]) * b.logp[i] + std::fabs(k.e[i]) * b.entropy[i]);
  }
  e.loss_bound = ScalarBound(row_errors, e.loss, tol);
  e.grad_tol = GradTolerance(p, tol, b.grad_rel);
  // The reference scales its gradients by nothing: F's gradient is grad_scale times it.
  e.grad = ref.grad;
  for (std::vector<double>* g : {&e.grad.dx, &e.grad.dw, &e.grad.db}) {
    for (double& x : *g) x *= gs;
  }
  return e;
}

// Policy's row weights w_i (policy_reference.h's normalisers; 0 where masked).
inline std::vector<double> PolicyWeights(const PolicyProblem& pp, const std::vector<uint8_t>& mask,
                                         double n) {
  const PolicyOptions& o = pp.options;
  const int64_t bt = static_cast<int64_t>(mask.size()), seq = bt / pp.batch;
  const double b = static_cast<double>(pp.batch);
  std::vector<double> per_seq(pp.batch, 0.0), w(bt, 0.0);
  for (int64_t i = 0; i < bt; ++i) per_seq[i / seq] += mask[i];
  for (int64_t i = 0; i < bt; ++i) {
    if (!mask[i]) continue;
    const PolicyLossType t = o.loss_type;
    w[i] = 1.0 / n;  // bnpo
    if (t == PolicyLossType::kGrpo || t == PolicyLossType::kSapo) {
      w[i] = 1.0 / (b * std::max(1.0, per_seq[i / seq]));
    }
    if (t == PolicyLossType::kLuspo) w[i] = per_seq[i / seq] / static_cast<double>(bt);
    if (t == PolicyLossType::kDrGrpo) w[i] = 1.0 / (b * o.max_completion_length);
    if (t == PolicyLossType::kDapo || t == PolicyLossType::kCispo) {
      w[i] = 1.0 / std::max(1.0, o.dapo_normalizer > 0 ? o.dapo_normalizer : n);
    }
  }
  return w;
}

inline Expected ExpectPolicy(const LossProblem& p, const Tolerance& tol) {
  std::vector<uint8_t> mask(p.bt);
  for (int64_t i = 0; i < p.bt; ++i) {
    mask[i] = LoadAsInt(p.targets, p.target_dtype, i) != p.options.ignore_index;
  }
  PolicyProblem pp;
  pp.head = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  pp.batch = p.policy.sequences;
  pp.targets = p.targets;
  pp.target_dtype = p.target_dtype;
  pp.mask = mask.data();
  pp.advantages = p.advantages;
  pp.old_logp = p.old_logp;
  pp.ref_logp = p.ref_logp;
  PolicyOptions& o = pp.options;
  o.loss_type = p.policy.loss_type;
  o.epsilon_low = p.policy.epsilon_low;
  o.epsilon_high = p.policy.epsilon_high;
  o.beta = p.policy.beta;
  o.temperature = p.options.temperature;
  o.softcap = p.options.softcap;
  o.max_completion_length = p.policy.max_completion_length;
  o.dapo_normalizer = p.policy.dapo_normalizer;
  o.grad_scale = p.options.grad_scale;
  o.sapo_temperature_pos = p.policy.sapo_temperature_pos;
  o.sapo_temperature_neg = p.policy.sapo_temperature_neg;
  o.delta = p.policy.delta;
  o.use_bias_correction_kl = p.policy.use_bias_correction_kl;
  PolicyReferenceOutputs ref;
  EXPECT_TRUE(PolicyReference(pp, &ref).ok());
  Expected e;
  e.logp = ref.logp;
  e.loss = ref.loss;
  e.kl = ref.kl;
  e.clip_fraction = ref.clip_fraction;
  e.grad = ref.grad;
  // Each row's c_i = grad_scale w_i dl_i/dlogp_i, and the slopes in logp of c_i, of its loss
  // term and of its KL term.
  const double n = std::max<double>(1.0, static_cast<double>(ref.tokens));
  const std::vector<double> weight = PolicyWeights(pp, mask, n);
  const double gs = p.options.grad_scale;
  const double lo = 1.0 - static_cast<double>(o.epsilon_low);
  const double hi = 1.0 + static_cast<double>(o.epsilon_high);
  RowCoefficients k;
  std::vector<double> loss_slope(p.bt, 0.0), kl_slope(p.bt, 0.0);
  for (int64_t i = 0; i < p.bt; ++i) {
    k.e.push_back(0.0);
    if (!mask[i]) {
      k.c.push_back(0.0);
      k.c_slope.push_back(0.0);
      continue;
    }
    // dl_i/dlogp_i is the reference's, and the slope of l_i itself but for cispo, whose
    // detached weight min(r, eh) moves its loss -min(r, eh) A logp by r A logp more.
    const double a = p.advantages[i], r = ref.ratio[i], dl = ref.dl_dlogp[i];
    double slope = 0, value_slope = std::fabs(dl);
    if (o.loss_type == PolicyLossType::kCispo) {  // its coefficient -min(r, eh) A
      slope = r < o.epsilon_high ? std::fabs(a) * r : 0.0;
      value_slope += slope * std::fabs(ref.logp[i]);
    } else if (o.loss_type == PolicyLossType::kSapo) {  // sigmoid's first two derivatives <= 1/4
      const double tau = a > 0 ? o.sapo_temperature_pos : o.sapo_temperature_neg;
      slope = std::fabs(a) * r * (1.0 + tau * r);
    } else {
      const bool clipped = (r < lo && a < 0) || (r > hi && a > 0);
      const bool capped = o.delta != 0.0f && r >= o.delta && a < 0;
      const double share = clipped || capped ? 0.0 : (r == lo || r == hi) ? 0.5 : 1.0;
      slope = share * std::fabs(a) * r;
    }
    if (p.ref_logp != nullptr) {
      const double ek = std::exp(p.ref_logp[i] - ref.logp[i]);
      const double k3 = ek - std::log(ek) - 1.0;
      // The KL term k3 (times r when bias-corrected) and its coefficient 1 - ek (or
      // (1 - ek + k3) r): their slopes in logp.
      kl_slope[i] = o.use_bias_correction_kl ? (std::fabs(1.0 - ek) + k3) * r
                                             : std::fabs(1.0 - ek);
      if (o.beta != 0.0f) {
        slope += o.beta * (o.use_bias_correction_kl ? (2.0 + ek + k3) * r : ek);
      }
    }
    k.c.push_back(gs * weight[i] * dl);
    k.c_slope.push_back(std::fabs(gs) * weight[i] * slope);
    loss_slope[i] = weight[i] * value_slope;
  }
  const HeadBounds b = FirstOrderBounds(p, k, tol.logit_u);
  RowBounds(b, tol, &e);
  std::vector<double> loss_errors, kl_errors;
  for (int64_t i = 0; i < p.bt; ++i) {
    loss_errors.push_back(loss_slope[i] * b.logp[i]);
    kl_errors.push_back(kl_slope[i] * b.logp[i] / n);
  }
  e.loss_bound = ScalarBound(loss_errors, e.loss, tol);
  e.kl_bound = ScalarBound(kl_errors, e.kl, tol);
  // The clip decisions are stable only where logp's error stays inside the ratios' distance
  // from the bounds (MakeProblem).
  for (int64_t i = 0; i < p.bt; ++i) {
    EXPECT_LT(e.logp_bound[i], kClipMargin) << "row " << i << ": a clip decision may flip";
  }
  e.grad_tol = GradTolerance(p, tol, b.grad_rel);
  return e;
}

// Distill's loss bound: per row, first order, |d row| <= (2 + 2 row) (|dz| + |dz_t|) (the
// student's and the teacher's logits' rounding; sum_j |d row / d z_j| <= 2 + 2 row for each
// side), over the rows' mean.
inline Expected ExpectDistill(const LossProblem& p, const LogitStats& stats,
                       const LogitStats& teacher_stats, const Tolerance& tol) {
  DistillProblem dp;
  dp.student = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  dp.teacher = HeadInputs{p.bt, p.teacher_h, p.v, p.dtype, p.teacher_x, p.teacher_w,
                          p.teacher_bias};
  dp.labels = p.targets;
  dp.label_dtype = p.target_dtype;
  dp.options.jsd_beta = p.distill.jsd_beta;
  dp.options.temperature = p.options.temperature;
  dp.options.ignore_index = p.options.ignore_index;
  dp.options.grad_scale = p.options.grad_scale;
  DistillReferenceOutputs ref;
  EXPECT_TRUE(DistillReference(dp, &ref).ok());
  Expected e;
  e.loss = ref.loss;
  const double inv_t = 1.0 / p.options.temperature;
  const double n = std::max<double>(1.0, static_cast<double>(ref.tokens));
  std::vector<double> row_errors;
  for (int64_t i = 0; i < p.bt; ++i) {
    const double zm = tol.logit_u * (stats.row_abs_max[i] + teacher_stats.row_abs_max[i] + 2) *
                      inv_t;
    row_errors.push_back((2 + 2 * ref.row_loss[i]) * zm / n);
  }
  e.loss_bound = ScalarBound(row_errors, e.loss, tol);
  e.grad = ref.grad;
  // A coarse bound of G's relative error (the JSD's gradient through both heads' rounding):
  // twice the two heads' rms logit rounding.
  const double grad_rel =
      2 * tol.logit_u * (stats.rms_row_abs_max + teacher_stats.rms_row_abs_max + 2) * inv_t +
      tol.logit_u;
  e.grad_tol = GradTolerance(p, tol, grad_rel);
  return e;
}

// One scalar against its bound, printed.
inline void ExpectScalar(const std::string& what, double ref, double got, double bound) {
  std::printf("    %-14s ref %+.6e got %+.6e err %.2e bound %.2e\n", what.c_str(), ref, got,
              std::fabs(got - ref), bound);
  EXPECT_LE(std::fabs(got - ref), bound) << what << " ref " << ref << " got " << got;
}

inline void ExpectRows(const std::string& what, const std::vector<double>& ref,
                       const float* got,
                const std::vector<double>& bound) {
  const std::vector<double> g(got, got + ref.size());
  const CompareResult r = CompareElementwise(what, ref, g, bound);
  std::printf("    %-14s max abs err %.2e (worst row %lld)\n", what.c_str(), r.max_abs,
              static_cast<long long>(r.worst_index));
  EXPECT_TRUE(r.ok()) << r.ToString();
}

inline void ExpectGrad(const std::string& what, const std::vector<double>& ref,
                       const void* got,
                DType t, double tol) {
  const CompareResult r = CompareRelNorm(what, ref, Widen(got, t, ref.size()), tol);
  std::printf("    %-14s rel norm err %.2e (tolerance %.2e), max abs err %.2e\n",
              what.c_str(), r.rel_norm, tol, r.max_abs);
  EXPECT_TRUE(r.ok()) << r.ToString();
}

inline void ExpectMatches(const LossProblem& p, const Expected& e, RowOutputs& out,
                          bool accumulate) {
  const LossOutputs o = out.outputs(p.kind);
  ExpectScalar("loss", e.loss, out.base.loss[0], e.loss_bound);
  // Distill has no logp output (nor, as these kinds all, an lse one).
  if (p.kind != LossKind::kDistill) ExpectRows("logp", e.logp, out.logp.data(), e.logp_bound);
  if (p.kind == LossKind::kLogprob) {
    ExpectRows("entropy", e.entropy, out.entropy.data(), e.entropy_bound);
  } else if (p.kind == LossKind::kPolicy) {
    ExpectScalar("kl", e.kl, out.kl, e.kl_bound);
    // A count over N, exact but reported in fp32: the only error allowed is that rounding
    // (half an fp32 ulp of the value); one token counted differently moves it by 1/N.
    const double half_ulp =
        e.clip_fraction > 0 ? std::ldexp(1.0, std::ilogb(e.clip_fraction) - 24) : 0.0;
    ExpectScalar("clip_fraction", e.clip_fraction, out.clip_fraction, half_ulp);
  }
  int64_t tokens = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    tokens += p.targets == nullptr ||
              LoadAsInt(p.targets, p.target_dtype, i) != p.options.ignore_index;
  }
  EXPECT_EQ(out.base.tokens, tokens);
  ExpectGrad("dx", e.grad.dx, o.dx, o.grad_dtype, e.grad_tol);
  if (accumulate) {
    ExpectGrad("dw_accum", e.grad.dw, o.dw_accum, DType::kF32, e.grad_tol);
    if (p.bias != nullptr) ExpectGrad("db_accum", e.grad.db, o.db_accum, DType::kF32, e.grad_tol);
  } else {
    ExpectGrad("dw", e.grad.dw, o.dw, o.grad_dtype, e.grad_tol);
    if (p.bias != nullptr) ExpectGrad("db", e.grad.db, o.db, o.grad_dtype, e.grad_tol);
  }
}

inline Expected ExpectOf(const RowProblem& rp, const Tolerance& tol) {
  switch (rp.p.kind) {
    case LossKind::kLogprob:
      return ExpectLogprob(rp.p, tol);
    case LossKind::kPolicy:
      return ExpectPolicy(rp.p, tol);
    default:
      return ExpectDistill(rp.p, rp.head.stats(), rp.teacher->stats(), tol);
  }
}

}  // namespace cuda
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_ROW_LOSS_TEST_CASES_H_
