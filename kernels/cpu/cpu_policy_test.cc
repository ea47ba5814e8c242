// SPDX-License-Identifier: Apache-2.0
// The CPU backend's policy kind against its float64 reference (kernels/cpu/policy_reference.h)
// over shapes x dtypes x loss types and options, with the tolerance table below; determinism
// and what the backend refuses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/kind_test_util.h"
#include "testing/cpu/policy_test_util.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

struct Shape {
  const char* name;
  int64_t bt, h, v, sequences;
};
const Shape kShapes[] = {{"tiny", 2, 3, 5, 2},
                         {"bt1", 1, 16, 37, 1},
                         {"odd", 47, 31, 123, 1},
                         {"medium", 256, 128, 1000, 4}};

struct Case {
  const char* name;
  PolicyLossType type = PolicyLossType::kDapo;
  float eps_low = 0.2f, eps_high = 0.2f, beta = 0.04f;
  float temperature = 1, cap = 0, grad_scale = 1;
  bool old_logp = true, ref_logp = true, bias = false, grad_f32 = false, accumulate = false;
  // r = e^12 with A < 0 (never clipped): G at the scale of its largest coefficient known before
  // the rows (|A| + beta) would pass fp16's range.
  bool huge_ratio = false;
  double ignore = 0.15, dapo_normalizer = 0;
  int64_t max_completion_length = 0, chunk_rows = 0;
  float sapo_pos = 1.0f, sapo_neg = 1.05f, delta = 0;
  bool bias_correction = false;
  bool sequence = false;  // sequence-level importance sampling (GSPO)
  bool is_ratio = false;  // the rollout correction, random in [0.2, 2)
  // verl's menu.
  KlEstimator kl = KlEstimator::kK3;
  bool kl_st = false;
  float entropy = 0;
  PolicyAggregation agg = PolicyAggregation::kLossType;
  double loss_scale_factor = 0;
  double kl_cov_ratio = 0.0002;  // kl_cov's
  float ppo_kl_coef = 1.0f;
  float vespo[4] = {2.0f, 3.0f, 3.0f, 2.0f};  // vespo's k_pos, lambda_pos, k_neg, lambda_neg
  // The old log-probs' log-ratios times this: vespo sums a sequence's, and at 1 a 64-token
  // sequence's sum would put its weight at 0 or its floor, where nothing is tested.
  float log_r_scale = 1.0f;
};

// The cases of verl's menu: every KL estimator (and straight-through), the entropy bonus, the
// four aggregations and gpg, at token and sequence level, chunked and not.
void AddVerlCases(std::vector<Case>* cs) {
  Case c;
  c.name = "gpg_k1_entropy";
  c.type = PolicyLossType::kGpg;
  c.kl = KlEstimator::kK1;
  c.beta = 0.1f;
  c.entropy = 0.05f;
  cs->push_back(c);
  c = Case();
  c.name = "k2_seq_mean_token_mean_bias";
  c.kl = KlEstimator::kK2;
  c.beta = 0.2f;
  c.agg = PolicyAggregation::kSeqMeanTokenMean;
  c.bias = true;
  cs->push_back(c);
  c = Case();
  c.name = "abs_seq_mean_token_sum_chunk7";
  c.kl = KlEstimator::kAbs;
  c.agg = PolicyAggregation::kSeqMeanTokenSum;
  c.chunk_rows = 7;
  cs->push_back(c);
  c = Case();
  c.name = "low_var_kl_st_bias_corrected_sum_norm";
  c.kl = KlEstimator::kLowVarKl;
  c.kl_st = c.bias_correction = true;
  c.beta = 0.3f;
  c.agg = PolicyAggregation::kSeqMeanTokenSumNorm;
  c.loss_scale_factor = 3;
  cs->push_back(c);
  c = Case();
  c.name = "seq_grpo_k3_st_entropy_token_mean_chunk32";
  c.sequence = c.kl_st = true;
  c.type = PolicyLossType::kGrpo;
  c.entropy = 0.02f;
  c.agg = PolicyAggregation::kTokenMean;
  c.dapo_normalizer = 50;
  c.chunk_rows = 32;
  cs->push_back(c);
  c = Case();
  c.name = "sapo_entropy_softcap_t08_f32";
  c.type = PolicyLossType::kSapo;
  c.entropy = 0.05f;
  c.cap = 5;
  c.temperature = 0.8f;
  c.grad_f32 = true;
  cs->push_back(c);
  // geo_mean (verl's GMPO): the token log-ratios (PolicySetup: -0.7, -0.05, 0.05, 0.6) sit
  // 0.15 and more from its bounds -0.2 and 0.2, clipped on their advantage's side.
  c = Case();
  c.name = "geo_mean";
  c.type = PolicyLossType::kGeoMean;
  cs->push_back(c);
  c = Case();
  c.name = "geo_mean_is_ratio_entropy_token_mean_chunk7";
  c.type = PolicyLossType::kGeoMean;
  c.is_ratio = true;
  c.entropy = 0.05f;
  c.agg = PolicyAggregation::kTokenMean;
  c.chunk_rows = 7;
  cs->push_back(c);
  c = Case();
  c.name = "geo_mean_no_old_low_var_kl_f32";
  c.type = PolicyLossType::kGeoMean;
  c.old_logp = false;
  c.kl = KlEstimator::kLowVarKl;
  c.beta = 0.2f;
  c.grad_f32 = true;
  cs->push_back(c);
  // kl_cov (verl's KL-Cov): a tenth of the tokens penalised, chunks that cut the call (two
  // passes), the rollout correction.
  c = Case();
  c.name = "kl_cov";
  c.type = PolicyLossType::kKlCov;
  c.kl_cov_ratio = 0.1;
  c.ppo_kl_coef = 0.5f;
  cs->push_back(c);
  c = Case();
  c.name = "kl_cov_is_ratio_entropy_seq_mean_token_mean_chunk9";
  c.type = PolicyLossType::kKlCov;
  c.kl_cov_ratio = 0.05;
  c.is_ratio = true;
  c.entropy = 0.03f;
  c.agg = PolicyAggregation::kSeqMeanTokenMean;
  c.chunk_rows = 9;
  cs->push_back(c);
  // cispo_clamp (verl's cispo): the weight clamped on both sides, the rollout correction, KL.
  c = Case();
  c.name = "cispo_clamp_is_ratio_k2_chunk9";
  c.type = PolicyLossType::kCispoClamp;
  c.is_ratio = true;
  c.kl = KlEstimator::kK2;
  c.beta = 0.1f;
  c.chunk_rows = 9;
  cs->push_back(c);
  // vespo: log-ratios a twentieth of the others' (a sequence's sum within a few units of 0);
  // the rollout correction (summed into the weight, not applied again), the bias-corrected KL
  // and chunks; without old log-probs phi = 1.
  c = Case();
  c.name = "vespo";
  c.type = PolicyLossType::kVespo;
  c.log_r_scale = 0.05f;
  cs->push_back(c);
  c = Case();
  c.name = "vespo_is_ratio_bias_corrected_kl_entropy_chunk7";
  c.type = PolicyLossType::kVespo;
  c.log_r_scale = 0.05f;
  c.is_ratio = c.bias_correction = true;
  c.beta = 0.2f;
  c.entropy = 0.03f;
  c.chunk_rows = 7;
  c.vespo[0] = 1.5f;
  c.vespo[3] = 2.5f;
  cs->push_back(c);
  c = Case();
  c.name = "vespo_no_old_seq_mean_token_sum_f32";
  c.type = PolicyLossType::kVespo;
  c.old_logp = false;
  c.agg = PolicyAggregation::kSeqMeanTokenSum;
  c.grad_f32 = true;
  cs->push_back(c);
}

std::vector<Case> Cases() {
  std::vector<Case> cs;
  Case c;
  c.name = "dapo";
  cs.push_back(c);
  c = Case();
  c.name = "grpo_t07";
  c.type = PolicyLossType::kGrpo;
  c.temperature = 0.7f;
  c.ignore = 0.3;
  c.eps_high = 0.28f;
  cs.push_back(c);
  c = Case();
  c.name = "bnpo_no_old";  // ratio 1
  c.type = PolicyLossType::kBnpo;
  c.old_logp = false;
  c.beta = 0.1f;
  cs.push_back(c);
  c = Case();
  c.name = "dr_grpo_softcap_bias";
  c.type = PolicyLossType::kDrGrpo;
  c.max_completion_length = 64;
  c.cap = 5;
  c.bias = true;
  cs.push_back(c);
  c = Case();
  c.name = "dapo_normalizer_no_kl";
  c.dapo_normalizer = 100;
  c.beta = 0;
  c.ref_logp = false;
  cs.push_back(c);
  c = Case();
  c.name = "eps0_no_old";  // r = 1 sits on both bounds: half the gradient
  c.eps_low = c.eps_high = 0;
  c.old_logp = false;
  cs.push_back(c);
  c = Case();
  c.name = "huge_ratio";
  c.huge_ratio = true;
  c.grad_scale = 1e-5f;  // the gradients fit fp16; G stored at its own scale would not
  c.chunk_rows = 20;
  cs.push_back(c);
  c = Case();
  c.name = "accumulate_chunked_f32";
  c.type = PolicyLossType::kGrpo;
  c.accumulate = c.grad_f32 = c.bias = true;
  c.grad_scale = 0.5f;
  c.chunk_rows = 9;
  cs.push_back(c);
  // The loss types beyond Liger's first four. Ratios (PolicySetup) are at least 0.1 in log
  // from cispo's bound 1.3 and delta 1.5, as from the clip bounds.
  c = Case();
  c.name = "cispo";
  c.type = PolicyLossType::kCispo;
  c.eps_high = 1.3f;
  cs.push_back(c);
  c = Case();
  c.name = "cispo_no_old_bias_corrected_kl_f32";
  c.type = PolicyLossType::kCispo;
  c.eps_high = 0.5f;  // r = 1 above it: every row clipped, weight 0.5
  c.old_logp = false;
  c.bias_correction = c.grad_f32 = true;
  c.beta = 0.2f;
  cs.push_back(c);
  c = Case();
  c.name = "sapo_softcap_bias_t08";
  c.type = PolicyLossType::kSapo;
  c.sapo_pos = 1.7f;
  c.sapo_neg = 0.6f;
  c.cap = 5;
  c.bias = true;
  c.temperature = 0.8f;
  cs.push_back(c);
  c = Case();
  c.name = "sapo_bias_corrected_kl_chunked";
  c.type = PolicyLossType::kSapo;
  c.bias_correction = true;
  c.beta = 0.3f;
  c.chunk_rows = 7;
  cs.push_back(c);
  c = Case();
  c.name = "luspo";
  c.type = PolicyLossType::kLuspo;
  c.ignore = 0.3;
  c.eps_high = 0.28f;
  cs.push_back(c);
  c = Case();
  c.name = "luspo_delta_accumulate";
  c.type = PolicyLossType::kLuspo;
  c.delta = 1.5f;
  c.accumulate = true;
  cs.push_back(c);
  c = Case();
  c.name = "dapo_delta_bias_corrected_kl";
  c.delta = 1.5f;
  c.bias_correction = true;
  c.beta = 0.1f;
  cs.push_back(c);
  // Sequence level: one pass where the chunk holds whole sequences (the default chunk, 64 for
  // medium's S = 64), two passes where it does not (7 rows; 32 for medium).
  c = Case();
  c.name = "seq_dapo";
  c.sequence = true;
  cs.push_back(c);
  c = Case();
  c.name = "seq_grpo_t07_chunk7";
  c.sequence = true;
  c.type = PolicyLossType::kGrpo;
  c.temperature = 0.7f;
  c.eps_high = 0.28f;
  c.chunk_rows = 7;
  cs.push_back(c);
  c = Case();
  c.name = "seq_bnpo_no_old_chunk64";
  c.sequence = true;
  c.type = PolicyLossType::kBnpo;
  c.old_logp = false;
  c.chunk_rows = 64;
  cs.push_back(c);
  c = Case();
  c.name = "seq_luspo_bias_corrected_kl_chunk32_accumulate";
  c.sequence = true;
  c.type = PolicyLossType::kLuspo;
  c.bias_correction = c.accumulate = true;
  c.beta = 0.2f;
  c.chunk_rows = 32;
  cs.push_back(c);
  c = Case();
  c.name = "seq_dr_grpo_delta_softcap_bias_f32";
  c.sequence = true;
  c.type = PolicyLossType::kDrGrpo;
  c.max_completion_length = 64;
  c.delta = 1.6f;
  c.cap = 5;
  c.bias = c.grad_f32 = true;
  cs.push_back(c);
  c = Case();
  c.name = "is_ratio_sapo_chunk7";
  c.is_ratio = true;
  c.type = PolicyLossType::kSapo;
  c.chunk_rows = 7;
  cs.push_back(c);
  c = Case();
  c.name = "is_ratio_cispo_bias_corrected_kl";
  c.is_ratio = c.bias_correction = true;
  c.type = PolicyLossType::kCispo;
  c.eps_high = 1.3f;
  c.beta = 0.2f;
  cs.push_back(c);
  c = Case();
  c.name = "is_ratio_seq_grpo_chunk32";
  c.is_ratio = c.sequence = true;
  c.type = PolicyLossType::kGrpo;
  c.chunk_rows = 32;
  cs.push_back(c);
  AddVerlCases(&cs);
  return cs;
}

// One random policy problem and its reference. The old log-probs put log r_i at one of
// -0.7, -0.05, 0.05, 0.6 (+- 0.02): at least 0.1 from either clip bound, further than the
// 16-bit logits' rounding moves log p, so clipping is decided alike.
struct PolicySetup {
  PolicySetup(const Shape& s, DType dtype, const Case& c, uint64_t seed)
      : random(RandomProblem::Make(Spec(s, dtype, c, seed))) {
    problem = random.problem();
    head = HeadInputs{s.bt, s.h, s.v, dtype, problem.x, problem.w, problem.bias};
    advantages = RandomFloats(s.bt, -1.5f, 1.5f, seed + 1);
    mask.assign(s.bt, 1);
    for (int64_t i = 0; i < s.bt; ++i) {
      mask[i] = LoadAsInt(problem.targets, problem.target_dtype, i) != problem.options.ignore_index;
    }
    // The current log-probs, for old and reference ones near them.
    LogprobProblem lp;
    lp.head = head;
    lp.targets = problem.targets;
    lp.target_dtype = problem.target_dtype;
    lp.options = {c.temperature, c.cap, problem.options.ignore_index};
    LogprobReferenceOutputs cur;
    status = LogprobReference(lp, &cur);
    const std::vector<float> pick = RandomFloats(s.bt, 0.0f, 4.0f, seed + 2);
    const std::vector<float> jitter = RandomFloats(s.bt, -0.02f, 0.02f, seed + 3);
    const std::vector<float> ref_d = RandomFloats(s.bt, -0.5f, 0.5f, seed + 4);
    const float log_r[4] = {-0.7f, -0.05f, 0.05f, 0.6f};
    // Sequence level: each sequence's mean log-ratio shifted by -0.45, 0 or +0.75 (in turn),
    // so some sequences are clipped (about 0.25 beyond a bound, delta's log 0.47 too) and
    // some not; a mean of S draws of log_r moves by ~0.46 / sqrt(S) around -0.025.
    const int64_t seq_len = s.bt / s.sequences;
    const float seq_shift[3] = {-0.45f, 0.0f, 0.75f};
    for (int64_t i = 0; i < s.bt; ++i) {
      if (c.huge_ratio) {
        advantages[i] = -0.1f - std::abs(advantages[i]);
        old_logp.push_back(static_cast<float>(cur.logp[i]) - 12.0f - jitter[i]);
        ref_logp.push_back(static_cast<float>(cur.logp[i]) + ref_d[i]);
        continue;
      }
      const float shift = c.sequence ? seq_shift[(i / seq_len) % 3] : 0.0f;
      old_logp.push_back(static_cast<float>(cur.logp[i]) -
                         c.log_r_scale * (log_r[static_cast<int>(pick[i])] + jitter[i]) - shift);
      ref_logp.push_back(static_cast<float>(cur.logp[i]) + ref_d[i]);
    }
    problem.kind = LossKind::kPolicy;
    problem.options.temperature = c.temperature;
    problem.options.grad_scale = c.grad_scale;
    problem.options.chunk_rows = c.chunk_rows;
    problem.advantages = advantages.data();
    problem.old_logp = c.old_logp ? old_logp.data() : nullptr;
    problem.ref_logp = c.ref_logp ? ref_logp.data() : nullptr;
    problem.policy = {c.type,           c.eps_low,   c.eps_high,
                      c.beta,           s.sequences, c.max_completion_length,
                      c.dapo_normalizer, c.sapo_pos, c.sapo_neg,
                      c.delta,          c.bias_correction};
    const ImportanceSampling level =
        c.sequence ? ImportanceSampling::kSequence : ImportanceSampling::kToken;
    problem.policy.importance_sampling = level;
    problem.policy.kl_estimator = c.kl;
    problem.policy.kl_straight_through = c.kl_st;
    problem.policy.entropy_coeff = c.entropy;
    problem.policy.aggregation = c.agg;
    problem.policy.loss_scale_factor = c.loss_scale_factor;
    problem.policy.kl_cov_ratio = c.kl_cov_ratio;
    problem.policy.ppo_kl_coef = c.ppo_kl_coef;
    problem.policy.vespo_k_pos = c.vespo[0];
    problem.policy.vespo_lambda_pos = c.vespo[1];
    problem.policy.vespo_k_neg = c.vespo[2];
    problem.policy.vespo_lambda_neg = c.vespo[3];
    if (c.is_ratio) {
      is_ratio = RandomFloats(s.bt, 0.2f, 2.0f, seed + 5);
      problem.is_ratio = is_ratio.data();
    }
    pp.head = head;
    pp.batch = s.sequences;
    pp.targets = problem.targets;
    pp.target_dtype = problem.target_dtype;
    pp.mask = mask.data();
    pp.advantages = problem.advantages;
    pp.old_logp = problem.old_logp;
    pp.ref_logp = problem.ref_logp;
    pp.is_ratio = problem.is_ratio;
    pp.options = {c.type,
                  c.eps_low,
                  c.eps_high,
                  c.beta,
                  c.temperature,
                  c.cap,
                  c.max_completion_length,
                  c.dapo_normalizer,
                  c.grad_scale,
                  c.sapo_pos,
                  c.sapo_neg,
                  c.delta,
                  c.bias_correction,
                  level,
                  c.kl,
                  c.kl_st,
                  c.entropy,
                  c.agg,
                  c.loss_scale_factor};
    pp.options.kl_cov_ratio = c.kl_cov_ratio;
    pp.options.ppo_kl_coef = c.ppo_kl_coef;
    pp.options.vespo_k_pos = c.vespo[0];
    pp.options.vespo_lambda_pos = c.vespo[1];
    pp.options.vespo_k_neg = c.vespo[2];
    pp.options.vespo_lambda_neg = c.vespo[3];
    if (status.ok()) status = PolicyReference(pp, &ref);
    logits = ComputeRawLogits(head);
  }
  static RandomProblemSpec Spec(const Shape& s, DType dtype, const Case& c, uint64_t seed) {
    RandomProblemSpec spec = HeadSpec(s.bt, s.h, s.v, dtype, seed);
    spec.bias = c.bias;
    spec.options.softcap = c.cap;
    spec.ignore_fraction = s.bt > 1 ? c.ignore : 0;
    return spec;
  }
  RandomProblem random;
  LossProblem problem;
  HeadInputs head;
  std::vector<float> advantages, old_logp, ref_logp, is_ratio;
  std::vector<uint8_t> mask;
  PolicyProblem pp;  // the reference's problem, on the vectors above
  PolicyReferenceOutputs ref;
  absl::Status status;
  RawLogits logits;
};

// Upper bounds on how fast row i's loss term l_i and its coefficient dl_i/dlogp_i move with
// logp_i (r = the ratio, e_d = exp(ref - logp), 1 without a KL term), by loss type.
struct RowSlopes {
  double loss = 0, coef = 0;
};
RowSlopes PolicyRowSlopes(const Case& c, double a, double r, double logp, double e_d) {
  RowSlopes s;
  const double abs_a = std::abs(a);
  if (c.type == PolicyLossType::kGpg) {  // -A logp; its coefficient -A, a constant
    s.loss = abs_a;
  } else if (c.type == PolicyLossType::kKlCov) {  // -A r (+ c |d| on the penalised rows)
    s.loss = abs_a * r + c.ppo_kl_coef;
    s.coef = abs_a * r;
  } else if (c.type == PolicyLossType::kGeoMean) {
    // (1/B) -mean(A) R rho, R's slope in each logp_i R / n_b; a is the sequence's bound
    s.loss = abs_a * r;
    s.coef = abs_a * r;
  } else if (c.type == PolicyLossType::kCispoClamp) {  // -clamp(r) A logp; coefficient -clamp(r) A
    const bool inside = r > 1 - c.eps_low && r < 1 + c.eps_high;
    s.loss = abs_a * std::max(r, std::clamp(r, 1.0 - c.eps_low, 1.0 + c.eps_high)) *
             (1 + std::abs(logp));
    s.coef = inside ? abs_a * r : 0.0;
  } else if (c.type == PolicyLossType::kCispo) {  // -min(r, eh) A logp; coefficient -min(r, eh) A
    s.loss = abs_a * r * (1 + std::abs(logp));
    s.coef = r < c.eps_high ? abs_a * r : 0.0;
  } else if (c.type == PolicyLossType::kSapo) {  // |d^2 sigmoid| <= |d sigmoid| <= 1/4
    const double tau = a > 0 ? c.sapo_pos : c.sapo_neg;
    s.loss = abs_a * r;
    s.coef = abs_a * r * (1 + tau * r);
  } else {
    const double lo = 1 - c.eps_low, hi = 1 + c.eps_high;
    const bool clipped = (r < lo && a < 0) || (r > hi && a > 0);
    const bool capped = c.delta != 0 && r >= c.delta && a < 0;
    const double share = clipped || capped ? 0.0 : (r == lo || r == hi) ? 0.5 : 1.0;
    s.loss = abs_a * r;
    s.coef = abs_a * r * share;
  }
  const double k3 = e_d - std::log(e_d) - 1;
  if (c.kl == KlEstimator::kK3 && !c.kl_st) {
    if (c.bias_correction) {  // k3 r: slope (|1 - e_d| + k3) r; coefficient's (2 + e_d + k3) r
      s.loss += c.beta * (std::abs(1 - e_d) + k3) * r;
      s.coef += c.beta * (2 + e_d + k3) * r;
    } else {
      s.loss += c.beta * std::abs(1 - e_d);
      s.coef += c.beta * e_d;
    }
    return s;
  }
  // The estimator K at d = -log e_d: its value kv, slope kp; the gradient g it passes (k2's d
  // with straight-through) and g's slope gp.
  const double d = -std::log(e_d);
  double kv = k3, kp = std::abs(1 - e_d), g = kp, gp = e_d;  // k3, low_var_kl (unclamped here)
  if (c.kl == KlEstimator::kK1) kv = std::abs(d), kp = g = 1, gp = 0;
  if (c.kl == KlEstimator::kK2) kv = d * d / 2, kp = g = std::abs(d), gp = 1;
  if (c.kl == KlEstimator::kAbs) kv = std::abs(d), kp = g = 1, gp = 0;
  if (c.kl_st) g = std::abs(d), gp = 1;
  if (c.bias_correction) {  // K r: slope (kp + kv) r; coefficient g r + K r: (gp + g + kp + kv) r
    s.loss += c.beta * (kp + kv) * r;
    s.coef += c.beta * (gp + g + kp + kv) * r;
  } else {
    s.loss += c.beta * kp;
    s.coef += c.beta * gp;
  }
  return s;
}

// The case's KL term alone (gpg's surrogate, whose slope is |A|, at A = 0 adds nothing).
Case KlPart(const Case& c) {
  Case k = c;
  k.type = PolicyLossType::kGpg;
  return k;
}

// Every output against the reference. Per row, b_i = 4 u a_i / T bounds the error of logp_i
// (as for logprob: a_i = max_j |u_ij|, 2x margin on 2 u a_i / T). The loss moves by
// w_i |dl_i/dlogp_i| b_i per row (PolicyRowSlopes bounds the slope; every w_i is at most 1
// but dr_grpo's, known); the KL metric by its slope b_i / N; clipping is decided alike
// (PolicySetup), so clip_fraction matches to fp32. Gradients: relative norm
// GradientTolerance(g_rel = 4 u rms(a) / T + the coefficients' relative error): the softmax's
// error, and each row's coefficient moving by its slope times logp's error (where its two
// terms nearly cancel, far more than logp's relative error).
::testing::AssertionResult MatchesPolicyReference(const PolicySetup& s, const Case& c,
                                                  const KindOutputs& got) {
  const LossProblem& p = s.problem;
  const PolicyReferenceOutputs& ref = s.ref;
  const double u = UnitRoundoff(p.dtype), inv_t = 1.0 / c.temperature;
  std::string err;
  auto check = [&](const std::string& what, double g, double r, double bound) {
    if (!(std::abs(g - r) <= bound + 1e-5 * (1 + std::abs(r)))) {
      absl::StrAppend(&err, what, " = ", g, " vs ", r, " (bound ", bound, ")\n");
    }
  };
  if (got.tokens != ref.tokens) absl::StrAppend(&err, "tokens ", got.tokens, "\n");
  const double n = std::max<double>(1, ref.tokens);
  double loss_bound = 0, kl_bound = 0, coef_err = 0, coef_sum = 0;
  // Sequence level and geo_mean: a row's loss and coefficient move with every logp of its
  // sequence through R_b, at most as fast as with the sequence's largest |A| (geo_mean's
  // times its largest rho, bounding |mean(A)| times rho's geometric mean) and logp error
  // (either sign of A).
  const bool by_sequence = c.sequence || c.type == PolicyLossType::kGeoMean;
  const int64_t seq_len = p.bt / p.policy.sequences;
  std::vector<double> seq_a(p.policy.sequences, 0.0), seq_b(p.policy.sequences, 0.0),
      seq_rho(p.policy.sequences, 0.0);
  for (int64_t i = 0; i < p.bt && by_sequence; ++i) {
    if (!s.mask[i]) continue;
    const double rho = p.is_ratio != nullptr ? p.is_ratio[i] : 1.0;
    const int64_t b = i / seq_len;
    seq_a[b] = std::max(seq_a[b], std::abs(p.advantages[i] * (c.sequence ? rho : 1.0)));
    seq_rho[b] = std::max(seq_rho[b], rho);
    seq_b[b] = std::max(seq_b[b], 4 * u * s.logits.abs_max[i] * inv_t);
  }
  for (int64_t b = 0; b < p.policy.sequences && !c.sequence && by_sequence; ++b) {
    seq_a[b] *= seq_rho[b];
  }
  // vespo: its policy term -phi A logp apart (the rows' slopes below are its KL term's).
  const bool vespo = c.type == PolicyLossType::kVespo;
  std::vector<double> row_b(p.bt, 0.0), phi, dphi;
  for (int64_t i = 0; i < p.bt && vespo; ++i) row_b[i] = 4 * u * s.logits.abs_max[i] * inv_t;
  if (vespo) {
    const VespoWeights vw = VespoWeightsOf(s.pp, ref.logp, row_b);
    phi = vw.phi;
    dphi = vw.dphi;
  }
  for (int64_t i = 0; i < p.bt; ++i) {
    const double b = by_sequence ? seq_b[i / seq_len] : 4 * u * s.logits.abs_max[i] * inv_t;
    if (!ArgmaxAcceptable(s.logits, p.v, i, got.predictions[i], u)) {
      absl::StrAppend(&err, "predictions[", i, "] = ", got.predictions[i], "\n");
    }
    if (!s.mask[i]) {
      check(absl::StrCat("logp[", i, "] (masked)"), got.logp[i], 0.0, 0.0);
      continue;
    }
    check(absl::StrCat("logp[", i, "]"), got.logp[i], ref.logp[i], b);
    // The rollout correction scales the policy term's slopes as it scales A.
    const double a = p.advantages[i] * (p.is_ratio != nullptr ? p.is_ratio[i] : 1.0);
    const double r = ref.ratio[i];
    const double e_d =
        p.ref_logp != nullptr && c.beta != 0 ? std::exp(p.ref_logp[i] - ref.logp[i]) : 1.0;
    RowSlopes slope = PolicyRowSlopes(vespo ? KlPart(c) : c, vespo ? 0.0 : a, r, ref.logp[i], e_d);
    if (by_sequence) {
      for (double sign : {-1.0, 1.0}) {
        const RowSlopes other = PolicyRowSlopes(c, sign * seq_a[i / seq_len], r, ref.logp[i], e_d);
        slope.loss = std::max(slope.loss, other.loss);
        slope.coef = std::max(slope.coef, other.coef);
      }
    }
    const double w = c.type == PolicyLossType::kDrGrpo
                         ? 1.0 / (p.policy.sequences * c.max_completion_length)
                         : 1.0;  // the others' weights are at most 1
    // The entropy bonus: H_i moves with the logits' error by at most (1 + 2 log V) b_i.
    const double h_slope = std::abs(c.entropy) * (1 + 2 * std::log(static_cast<double>(p.v)));
    loss_bound += w * (slope.loss + h_slope) * b;
    if (vespo) {  // -phi A logp: logp's error times phi, and phi's times |logp|
      const double abs_a = std::abs(p.advantages[i]);
      loss_bound += abs_a * (phi[i] * b + std::abs(ref.logp[i]) * dphi[i]);
      coef_err += abs_a * dphi[i];
    }
    // The KL metric's row term K (times r when bias-corrected) moves as the loss's KL part.
    const RowSlopes kl_only = PolicyRowSlopes(KlPart(c), 0.0, r, ref.logp[i], e_d);
    kl_bound += kl_only.loss / std::max(1e-30, double{c.beta}) * b / n;
    // The row's coefficient dl/dlogp (the reference's) and its error from logp's (b_i, and
    // fp32's on lse): where its terms nearly cancel, its relative error is far above logp's.
    coef_sum += std::abs(ref.dl_dlogp[i]);
    coef_err += slope.coef * (b + 1e-6 * (1 + std::abs(got.lse[i])));
  }
  check("loss", got.loss[0], ref.loss, loss_bound);
  check("kl", got.kl, ref.kl, kl_bound);
  check("clip_fraction", got.clip_fraction, ref.clip_fraction, 0.0);
  const double coef_rel = coef_sum > 0 ? coef_err / coef_sum : 0.0;
  const double tol =
      GradientTolerance(p, got.grad_dtype, 4 * u * Rms(s.logits.abs_max) * inv_t + coef_rel);
  return KindVerdict(err, GradientsMatch(p, got, ref.grad, 1.0, tol),
                     absl::StrCat("loss ", got.loss[0], " vs ", ref.loss, ", clip_fraction ",
                                  got.clip_fraction, ", kl ", got.kl, "\n"));
}

// kl_cov penalises the k rows of largest covariance (A_i - mean A)(logp_i - mean logp): where
// the k-th and (k+1)-th are closer than logp's error can move them (b_i = 4 u a_i / T each,
// and the mean's), the backend may choose either; such a case tests nothing and is skipped.
// Two counted rows always tie (their covariances are equal), so the tiny shape is one.
bool KlCovChoiceIsStable(const PolicySetup& s) {
  const LossProblem& p = s.problem;
  const double u = UnitRoundoff(p.dtype), inv_t = 1.0 / p.options.temperature;
  std::vector<int64_t> rows;
  double mean_a = 0, mean_l = 0, mean_b = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    if (!s.mask[i]) continue;
    rows.push_back(i);
    mean_a += p.advantages[i];
    mean_l += s.ref.logp[i];
    mean_b += 4 * u * s.logits.abs_max[i] * inv_t;
  }
  const double n = static_cast<double>(rows.size());
  const size_t k = std::max<size_t>(1, static_cast<size_t>(n * p.policy.kl_cov_ratio));
  if (rows.size() <= k) return true;  // every row penalised
  mean_a /= n, mean_l /= n, mean_b /= n;
  std::vector<std::pair<double, double>> cov;  // (value, its error bound)
  for (int64_t i : rows) {
    const double da = std::abs(p.advantages[i] - mean_a);
    cov.push_back({(p.advantages[i] - mean_a) * (s.ref.logp[i] - mean_l),
                   da * (4 * u * s.logits.abs_max[i] * inv_t + mean_b)});
  }
  std::sort(cov.rbegin(), cov.rend());
  return cov[k - 1].first - cov[k].first > cov[k - 1].second + cov[k].second;
}

KindOutputs PolicyOutputs(const LossProblem& p, DType grad_dtype, bool accumulate = false) {
  KindOutputs out(p, grad_dtype, accumulate);
  out.want_entropy = false;  // logprob's only
  return out;
}

using Param = std::tuple<Shape, DType, Case>;
class CpuPolicyMatrixTest : public ::testing::TestWithParam<Param> {};

TEST_P(CpuPolicyMatrixTest, MatchesReference) {
  const auto& [shape, dtype, c] = GetParam();
  const PolicySetup s(shape, dtype, c, 5000 + shape.bt * 7 + static_cast<int>(dtype));
  ASSERT_TRUE(s.status.ok()) << s.status;
  if (c.type == PolicyLossType::kKlCov && !KlCovChoiceIsStable(s)) {
    ASSERT_FALSE(std::string(shape.name) == "medium" && dtype == DType::kF32)
        << "the medium shape in fp32 must check kl_cov";
    GTEST_SKIP() << "kl_cov's k-th and (k+1)-th covariances tie within logp's error";
  }
  KindOutputs got = PolicyOutputs(s.problem, c.grad_f32 ? DType::kF32 : dtype, c.accumulate);
  ExpectComputeMatches(s.problem, got,
                       [&](const KindOutputs& g) { return MatchesPolicyReference(s, c, g); });
}

INSTANTIATE_TEST_SUITE_P(Matrix, CpuPolicyMatrixTest,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::Values(DType::kBF16, DType::kF16,
                                                              DType::kF32),
                                            ::testing::ValuesIn(Cases())),
                         MatrixCaseName<Param>);

TEST(CpuPolicyTest, ClippingHappensOnBothSidesInTheMatrix) {
  // The matrix's data must exercise both clipped branches and the unclipped one, or the
  // clip-fraction comparison could pass with the clipping wrong.
  const PolicySetup s(kShapes[3], DType::kF32, Cases()[0], 5000 + 256 * 7 + 2);
  ASSERT_TRUE(s.status.ok());
  EXPECT_GT(s.ref.clip_fraction, 0.05);
  EXPECT_LT(s.ref.clip_fraction, 0.6);
}

TEST(CpuPolicyTest, BitIdenticalAtAnyThreadCountAndOnRerun) {
  const PolicySetup s(kShapes[3], DType::kBF16, Cases()[1], 21);
  ASSERT_TRUE(s.status.ok());
  ExpectBitIdenticalAcrossThreads(
      s.problem, [](const LossProblem& p) { return PolicyOutputs(p, DType::kBF16); });
}

TEST(CpuPolicyTest, RefusesWhatItCannotCompute) {
  const PolicySetup s(kShapes[3], DType::kF32, Cases()[0], 22);
  ASSERT_TRUE(s.status.ok());
  const std::vector<float> ones(s.problem.bt, 1.0f);
  const std::vector<Refusal> bad = {
      {"advantages", [](LossProblem& p) { p.advantages = nullptr; }},
      {"policy.sequences", [](LossProblem& p) { p.policy.sequences = 3; }},
      {"policy.sequences", [](LossProblem& p) { p.policy.sequences = 0; }},
      {"policy.loss_type",
       [](LossProblem& p) { p.policy.loss_type = static_cast<PolicyLossType>(12); }},
      {"policy.kl_estimator",
       [](LossProblem& p) { p.policy.kl_estimator = static_cast<KlEstimator>(5); }},
      {"policy.loss_scale_factor", [](LossProblem& p) { p.policy.loss_scale_factor = 2; }},
      {"policy.epsilon_low", [](LossProblem& p) { p.policy.epsilon_low = -0.1f; }},
      {"policy.beta", [](LossProblem& p) { p.policy.beta = INFINITY; }},
      {"policy.max_completion_length",
       [](LossProblem& p) { p.policy.loss_type = PolicyLossType::kDrGrpo; }},
      {"policy.dapo_normalizer", [](LossProblem& p) { p.policy.dapo_normalizer = -1; }},
      {"policy.importance_sampling", [](LossProblem& p) {
         p.policy.importance_sampling = ImportanceSampling::kSequence;
         p.policy.loss_type = PolicyLossType::kSapo;
       }},
      {"dlogp", [&](LossProblem& p) { p.dlogp = ones.data(); }},
      {"teacher_w", [&](LossProblem& p) { p.teacher_w = ones.data(); }},
      {"options.reduction", [](LossProblem& p) { p.options.reduction = Reduction::kNone; }},
      {"entropy", [](LossProblem&) {}, [](KindOutputs& o) { o.want_entropy = true; }},
  };
  ExpectRefusals(s.problem, bad,
                 [](const LossProblem& p) { return PolicyOutputs(p, DType::kF32); });
}

}  // namespace
}  // namespace lossd
