// SPDX-License-Identifier: Apache-2.0
// What the GPU tests of the CUDA backend's logprob, policy and distill loss kinds share
// (row_loss_test, row_loss_paths_test): the cases, their problems, and the comparison with the
// float64 references (kernels/cpu/logprob_reference.h, policy_reference.h,
// distill_reference.h), which prints the largest errors, within the bounds of
// row_loss_test_bounds.h. The bounds follow the cross-entropy
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
#ifndef LOSSD_TESTING_CUDA_ROW_LOSS_TEST_CASES_H_
#define LOSSD_TESTING_CUDA_ROW_LOSS_TEST_CASES_H_

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
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/cuda/row_loss_test_bounds.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {

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
  // verl's menu (PolicyParams): the KL estimator, the entropy bonus, the aggregation.
  KlEstimator kl = KlEstimator::kK3;
  bool kl_st = false;
  float entropy_coeff = 0.0f;
  PolicyAggregation aggregation = PolicyAggregation::kLossType;
  double loss_scale_factor = 0;
  // Distill's hard-label term (LigerFusedLinearJSDLoss' weights).
  float w_hard = 0.0f, w_soft = 1.0f;
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
    // verl's menu (15-18): gpg, the KL estimators and straight-through, the entropy bonus and
    // the four aggregation modes.
    {"policy_gpg_k1_entropy", LossKind::kPolicy, 1.0f, 0.0f, true, 0.1, 0, false, false, true,
     false, PolicyLossType::kGpg, true, true, 0.2f, 0.2f, 0.1f, 0, 0.7f, 0.5f, 0, false, false,
     1.0f, 1.05f, 0.0f, false, KlEstimator::kK1, false, 0.05f},
    {"policy_dapo_k2_seq_mean_token_mean_temp_cap", LossKind::kPolicy, 0.8f, 4.0f, false, 0.25,
     0, false, false, true, false, PolicyLossType::kDapo, true, true, 0.2f, 0.28f, 0.1f, 0,
     0.7f, 0.5f, 0, false, false, 1.0f, 1.05f, 0.0f, false, KlEstimator::kK2, false, 0.0f,
     PolicyAggregation::kSeqMeanTokenMean},
    {"policy_grpo_abs_token_mean_entropy_bias_corrected_f32", LossKind::kPolicy, 1.0f, 0.0f,
     true, 0.1, 0, true, false, true, false, PolicyLossType::kGrpo, true, true, 0.2f, 0.2f,
     0.1f, 0, 0.7f, 0.5f, 0, false, false, 1.0f, 1.05f, 0.0f, true, KlEstimator::kAbs, false,
     0.02f, PolicyAggregation::kTokenMean},
    {"policy_luspo_low_var_kl_st_seq_mean_token_sum_norm_chunked_accum", LossKind::kPolicy,
     1.0f, 0.0f, true, 0.2, 7, false, true, true, false, PolicyLossType::kLuspo, true, true,
     0.2f, 0.2f, 0.1f, 0, 0.7f, 0.5f, 0, false, false, 1.0f, 1.05f, 1.5f, false,
     KlEstimator::kLowVarKl, true, -0.03f, PolicyAggregation::kSeqMeanTokenSumNorm, 48.0},
    // Distill with the hard-label term (19, 20): Liger's JSD-loss default weights at T 2, and
    // a hard-heavy forward KL.
    {"distill_hard_soft_half_temp2_biases_ignore", LossKind::kDistill, 2.0f, 0.0f, true, 0.1, 0,
     false, false, true, false, PolicyLossType::kDapo, true, true, 0.2f, 0.2f, 0.04f, 0, 0.7f,
     0.5f, 0, true, false, 1.0f, 1.05f, 0.0f, false, KlEstimator::kK3, false, 0.0f,
     PolicyAggregation::kLossType, 0, 0.5f, 0.5f},
    {"distill_hard_forward_kl_chunked_accum_f32", LossKind::kDistill, 1.0f, 0.0f, false, 0.2, 7,
     true, true, true, false, PolicyLossType::kDapo, true, true, 0.2f, 0.2f, 0.04f, 0, 0.7f,
     0.0f, 0, false, false, 1.0f, 1.05f, 0.0f, false, KlEstimator::kK3, false, 0.0f,
     PolicyAggregation::kLossType, 0, 1.0f, 0.25f},
    // verl's geo_mean (GMPO): the CUDA backend runs it by sequence (policy_sequence.h).
    {"policy_geo_mean_bias", LossKind::kPolicy, 1.0f, 0.0f, true, 0.1, 0, false, false, true,
     false, PolicyLossType::kGeoMean, true, true, 0.2f, 0.28f, 0.04f},
    {"policy_geo_mean_low_var_kl_token_mean_entropy_temp_cap_chunked_accum", LossKind::kPolicy,
     0.8f, 4.0f, false, 0.2, 7, false, true, true, false, PolicyLossType::kGeoMean, true, true,
     0.2f, 0.2f, 0.1f, 0, 0.7f, 0.5f, 0, false, false, 1.0f, 1.05f, 0.0f, false,
     KlEstimator::kLowVarKl, false, 0.03f, PolicyAggregation::kTokenMean},
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
    p.distill.weight_hard_loss = c.w_hard;
    p.distill.weight_soft_loss = c.w_soft;
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
  // The ratio's kinks: the clip bounds, cispo's own bound (eps_high) and delta's cap;
  // geo_mean's bounds are on the log-ratio itself.
  std::vector<double> kinks = {std::log(1.0 - c.eps_low), std::log(1.0 + c.eps_high)};
  if (c.loss_type == PolicyLossType::kGeoMean) kinks = {-c.eps_low, c.eps_high};
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
    // abs's kink at logp = ref is kept kClipMargin away, as the ratios' are.
    double k = 0;
    do {
      k = 0.3 * normal(rng);
    } while (c.kl == KlEstimator::kAbs && std::fabs(k) < kClipMargin);
    r.ref_logp.push_back(static_cast<float>(lref.logp[i] + k));
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
  p.policy.kl_estimator = c.kl;
  p.policy.kl_straight_through = c.kl_st;
  p.policy.entropy_coeff = c.entropy_coeff;
  p.policy.aggregation = c.aggregation;
  p.policy.loss_scale_factor = c.loss_scale_factor;
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

#endif  // LOSSD_TESTING_CUDA_ROW_LOSS_TEST_CASES_H_
