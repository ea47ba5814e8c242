// SPDX-License-Identifier: Apache-2.0
// The host side of the CUDA backend's logprob, policy and distill kinds, without a GPU: the
// reductions from per-row results (fed the float64 references' own per-row values, rounded to
// fp32 as the device writes them) against the references' losses and metrics; policy's row
// weights; policy's coefficients at sequence level and is_ratio; distill's rows; the kinds'
// device bytes.
#include "kernels/cuda/row_loss_io.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cpu/policy_reference.h"
#include "kernels/cpu/reference_head.h"
#include "kernels/cuda/device_io.h"

namespace lossd {
namespace cuda {
namespace {

constexpr int64_t kBt = 24, kH = 6, kV = 11;

// A random fp32 head and targets (a quarter ignored), owning its buffers.
struct Head {
  explicit Head(uint64_t seed) : x(kBt * kH), w(kV * kH), targets(kBt) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : x) v = normal(rng);
    for (float& v : w) v = normal(rng);
    for (int64_t i = 0; i < kBt; ++i) targets[i] = i % 4 == 1 ? -100 : (i * 7) % kV;
  }
  HeadInputs inputs() const { return HeadInputs{kBt, kH, kV, DType::kF32, x.data(), w.data()}; }
  LossProblem problem(LossKind kind) const {
    LossProblem p;
    p.bt = kBt;
    p.h = kH;
    p.v = kV;
    p.dtype = DType::kF32;
    p.x = x.data();
    p.w = w.data();
    p.targets = targets.data();
    p.kind = kind;
    p.options.grad_scale = 0.7f;
    return p;
  }
  std::vector<int32_t> targets32() const {
    std::vector<int32_t> t(kBt);
    for (int64_t i = 0; i < kBt; ++i) t[i] = targets[i] == -100 ? -1 : targets[i];
    return t;
  }
  std::vector<float> x, w;
  std::vector<int64_t> targets;
};

// The host reductions' outputs.
struct Outputs {
  Outputs() : logp(kBt, NAN), entropy(kBt, NAN), lse(kBt, NAN) {}
  LossOutputs view() {
    LossOutputs o;
    o.loss = &loss;
    o.logp = logp.data();
    o.entropy = entropy.data();
    o.lse = lse.data();
    o.kl = &kl;
    o.clip_fraction = &clip_fraction;
    o.tokens = &tokens;
    return o;
  }
  float loss = NAN, kl = NAN, clip_fraction = NAN;
  int64_t tokens = -1;
  std::vector<float> logp, entropy, lse;
};

// logp, entropy and lse as the device writes them: fp32.
HostRows RowsOf(const std::vector<double>& logp, const std::vector<double>& entropy,
                const std::vector<double>& lse) {
  HostRows rows(kBt);
  for (int64_t i = 0; i < kBt; ++i) {
    rows.ce[i] = static_cast<float>(logp[i]);
    rows.zl[i] = entropy.empty() ? 0.0f : static_cast<float>(entropy[i]);
    rows.lse[i] = static_cast<float>(lse[i]);
    rows.pred[i] = 0;
  }
  return rows;
}

// Relative to fp32 rounding of the per-row values, with room for the sums over 24 rows.
void ExpectClose(double ref, double got, const char* what) {
  EXPECT_NEAR(got, ref, 1e-5 * (std::fabs(ref) + 1e-3)) << what;
}

// The policy problem of `pp` on `head` as the backend takes it (grad_scale stays the head's).
LossProblem PolicyProblemOf(const Head& head, const PolicyProblem& pp) {
  LossProblem p = head.problem(LossKind::kPolicy);
  p.advantages = pp.advantages;
  p.old_logp = pp.old_logp;
  p.ref_logp = pp.ref_logp;
  p.is_ratio = pp.is_ratio;
  const PolicyOptions& o = pp.options;
  PolicyParams& q = p.policy;
  q.loss_type = o.loss_type;
  q.epsilon_low = o.epsilon_low;
  q.epsilon_high = o.epsilon_high;
  q.beta = o.beta;
  q.sequences = pp.batch;
  q.max_completion_length = o.max_completion_length;
  q.dapo_normalizer = o.dapo_normalizer;
  q.sapo_temperature_pos = o.sapo_temperature_pos;
  q.sapo_temperature_neg = o.sapo_temperature_neg;
  q.delta = o.delta;
  q.use_bias_correction_kl = o.use_bias_correction_kl;
  q.importance_sampling = o.importance_sampling;
  q.kl_estimator = o.kl_estimator;
  q.kl_straight_through = o.kl_straight_through;
  q.entropy_coeff = o.entropy_coeff;
  q.aggregation = o.aggregation;
  q.loss_scale_factor = o.loss_scale_factor;
  q.kl_cov_ratio = o.kl_cov_ratio;
  q.ppo_kl_coef = o.ppo_kl_coef;
  q.vespo_k_pos = o.vespo_k_pos;
  q.vespo_lambda_pos = o.vespo_lambda_pos;
  q.vespo_k_neg = o.vespo_k_neg;
  q.vespo_lambda_neg = o.vespo_lambda_neg;
  return p;
}

TEST(RowLossIoTest, LogprobLossIsTheUpstreamGradientsDotTheRows) {
  const Head head(1);
  std::vector<float> dlogp(kBt), dentropy(kBt);
  for (int64_t i = 0; i < kBt; ++i) {
    dlogp[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
    dentropy[i] = 0.05f * static_cast<float>(i % 5) - 0.1f;
  }
  LogprobProblem lp;
  lp.head = head.inputs();
  lp.targets = head.targets.data();
  LogprobReferenceOutputs ref;
  ASSERT_TRUE(LogprobReference(lp, &ref).ok());
  LossProblem p = head.problem(LossKind::kLogprob);
  p.dlogp = dlogp.data();
  p.dentropy = dentropy.data();
  Outputs out;
  WriteRowLossOutputs(p, out.view(), head.targets32(), RowsOf(ref.logp, ref.entropy, ref.lse));
  double want = 0;
  for (int64_t i = 0; i < kBt; ++i) want += dlogp[i] * ref.logp[i] + dentropy[i] * ref.entropy[i];
  ExpectClose(0.7 * want, out.loss, "loss");
  EXPECT_EQ(out.tokens, ref.tokens);
  for (int64_t i = 0; i < kBt; ++i) {
    EXPECT_EQ(out.logp[i], static_cast<float>(ref.logp[i])) << i;
    EXPECT_EQ(out.entropy[i], static_cast<float>(ref.entropy[i])) << i;
    EXPECT_EQ(out.lse[i], static_cast<float>(ref.lse[i])) << i;
  }
}

// Every loss type, with and without old and reference log-probs: the loss and both metrics.
TEST(RowLossIoTest, PolicyLossAndMetricsMatchTheReference) {
  const Head head(2);
  std::vector<float> adv(kBt), old_logp(kBt), ref_logp(kBt);
  LogprobProblem lp;
  lp.head = head.inputs();
  lp.targets = head.targets.data();
  LogprobReferenceOutputs lref;
  ASSERT_TRUE(LogprobReference(lp, &lref).ok());
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  for (int64_t i = 0; i < kBt; ++i) {
    adv[i] = static_cast<float>(uni(rng));
    // log r in [-0.5, 0.5], away from log 0.8 and log 1.2, cispo's bound 1.3 and delta 1.45
    // below, so that no clip flips on rounding.
    double d = 0;
    auto near = [&d](double x) { return std::fabs(d - std::log(x)) < 0.01; };
    do {
      d = 0.5 * uni(rng);
    } while (near(0.8) || near(1.2) || near(1.3) || near(1.45));
    old_logp[i] = static_cast<float>(lref.logp[i] - d);
    ref_logp[i] = static_cast<float>(lref.logp[i] + 0.3 * uni(rng));
  }
  std::vector<uint8_t> mask(kBt);
  for (int64_t i = 0; i < kBt; ++i) mask[i] = head.targets[i] != -100;
  // The types with the options their formulas take (cispo's bound is eps_high itself).
  const struct {
    PolicyLossType type;
    float eps_high, delta;
    bool bias_correction;
  } configs[] = {{PolicyLossType::kDapo, 0.2f, 0, false},
                 {PolicyLossType::kGrpo, 0.2f, 0, false},
                 {PolicyLossType::kBnpo, 0.2f, 0, false},
                 {PolicyLossType::kDrGrpo, 0.2f, 0, false},
                 {PolicyLossType::kCispo, 1.3f, 0, false},
                 {PolicyLossType::kSapo, 0.2f, 0, true},
                 {PolicyLossType::kLuspo, 0.2f, 0, false},
                 {PolicyLossType::kLuspo, 0.2f, 1.45f, true},
                 {PolicyLossType::kDapo, 0.2f, 1.45f, true}};
  int checked = 0;
  for (const auto& config : configs) {
    const PolicyLossType type = config.type;
    for (int inputs = 0; inputs < 4; ++inputs) {
      PolicyProblem pp;
      pp.head = head.inputs();
      pp.batch = 3;
      pp.targets = head.targets.data();
      pp.mask = mask.data();
      pp.advantages = adv.data();
      pp.old_logp = inputs & 1 ? old_logp.data() : nullptr;
      pp.ref_logp = inputs & 2 ? ref_logp.data() : nullptr;
      pp.options.loss_type = type;
      pp.options.max_completion_length = type == PolicyLossType::kDrGrpo ? 16 : 0;
      pp.options.dapo_normalizer = type == PolicyLossType::kDapo && inputs == 3 ? 40.0 : 0.0;
      pp.options.beta = 0.2f;
      pp.options.epsilon_high = config.eps_high;
      pp.options.sapo_temperature_pos = 1.7f;
      pp.options.sapo_temperature_neg = 0.6f;
      pp.options.delta = config.delta;
      pp.options.use_bias_correction_kl = config.bias_correction;
      PolicyReferenceOutputs ref;
      ASSERT_TRUE(PolicyReference(pp, &ref).ok());
      const LossProblem p = PolicyProblemOf(head, pp);
      Outputs out;
      WriteRowLossOutputs(p, out.view(), head.targets32(), RowsOf(ref.logp, {}, lref.lse));
      const char* name = PolicyLossTypeName(type);
      SCOPED_TRACE(testing::Message() << name << " inputs " << inputs);
      ExpectClose(ref.loss, out.loss, "loss");
      ExpectClose(ref.kl, out.kl, "kl");
      EXPECT_EQ(out.clip_fraction, static_cast<float>(ref.clip_fraction));
      EXPECT_EQ(out.tokens, ref.tokens);
      // bnpo's weights are a mean's: they sum to 1.
      int64_t tokens = 0;
      const std::vector<double> w = PolicyRowWeights(p, head.targets32(), &tokens);
      EXPECT_EQ(tokens, ref.tokens);
      double w_sum = 0;
      for (double x : w) w_sum += x;
      if (type == PolicyLossType::kBnpo) EXPECT_NEAR(w_sum, 1.0, 1e-12);
      ++checked;
      if (inputs == 1 && type != PolicyLossType::kSapo) {
        EXPECT_GT(ref.clip_fraction, 0.0) << "no row clipped: a weak case";
      }
    }
  }
  EXPECT_EQ(checked, 36);
}

// Policy with is_ratio at token level (every type) and at sequence level (the clipped types,
// with and without is_ratio): the loss and metrics, and at sequence level every row's
// coefficient grad_scale dloss/dlogp_i (SequenceCoefficients, what the gradient pass runs
// with), against the reference. The three sequences' mean log-ratios sit below 1 - eps_low,
// above 1 + eps_high and between, so each clip branch is taken.
TEST(RowLossIoTest, PolicySequenceLevelAndIsRatioMatchTheReference) {
  const Head head(6);
  LogprobProblem lp;
  lp.head = head.inputs();
  lp.targets = head.targets.data();
  LogprobReferenceOutputs lref;
  ASSERT_TRUE(LogprobReference(lp, &lref).ok());
  std::vector<uint8_t> mask(kBt);
  for (int64_t i = 0; i < kBt; ++i) mask[i] = head.targets[i] != -100;
  constexpr int64_t kSeqs = 3, kS = kBt / kSeqs;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  std::vector<float> adv(kBt), old_logp(kBt), ref_logp(kBt), rho(kBt);
  const double mean_log_ratio[kSeqs] = {-0.4, 0.35, 0.05};
  for (int64_t b = 0; b < kSeqs; ++b) {
    std::vector<double> d(kS);
    double sum = 0;
    int64_t n = 0;
    for (int64_t s = 0; s < kS; ++s) {
      d[s] = 0.3 * uni(rng);
      if (!mask[b * kS + s]) continue;
      sum += d[s];
      ++n;
    }
    for (int64_t s = 0; s < kS; ++s) {
      const int64_t i = b * kS + s;
      d[s] += mean_log_ratio[b] - sum / static_cast<double>(n);  // the counted rows' mean
      old_logp[i] = static_cast<float>(lref.logp[i] - d[s]);
    }
  }
  for (int64_t i = 0; i < kBt; ++i) {
    adv[i] = static_cast<float>(uni(rng));
    ref_logp[i] = static_cast<float>(lref.logp[i] + 0.3 * uni(rng));
    rho[i] = static_cast<float>(1.0 + 0.8 * uni(rng));  // in [0.2, 1.8]
  }
  const struct {
    PolicyLossType type;
    float eps_high, delta;
    bool bias_correction;
  } configs[] = {{PolicyLossType::kDapo, 0.2f, 0, false},
                 {PolicyLossType::kGrpo, 0.2f, 0, false},
                 {PolicyLossType::kBnpo, 0.2f, 0, false},
                 {PolicyLossType::kDrGrpo, 0.2f, 0, false},
                 {PolicyLossType::kCispo, 1.3f, 0, false},
                 {PolicyLossType::kSapo, 0.2f, 0, true},
                 {PolicyLossType::kLuspo, 0.2f, 0, false},
                 {PolicyLossType::kLuspo, 0.2f, 1.45f, true},
                 {PolicyLossType::kDapo, 0.2f, 1.45f, true}};
  int checked = 0, clipped_cases = 0;
  for (const bool sequence : {false, true}) {
    for (const auto& config : configs) {
      const PolicyLossType type = config.type;
      const bool clips = type != PolicyLossType::kCispo && type != PolicyLossType::kSapo;
      if (sequence && !clips) continue;  // refused, as Liger refuses it
      for (int inputs = 0; inputs < 8; ++inputs) {
        const bool with_rho = (inputs & 4) != 0;
        if (!sequence && !with_rho) continue;  // the token level's own test above
        PolicyProblem pp;
        pp.head = head.inputs();
        pp.batch = kSeqs;
        pp.targets = head.targets.data();
        pp.mask = mask.data();
        pp.advantages = adv.data();
        pp.old_logp = inputs & 1 ? old_logp.data() : nullptr;
        pp.ref_logp = inputs & 2 ? ref_logp.data() : nullptr;
        pp.is_ratio = with_rho ? rho.data() : nullptr;
        PolicyOptions& o = pp.options;
        o.loss_type = type;
        o.max_completion_length = type == PolicyLossType::kDrGrpo ? 16 : 0;
        o.beta = 0.2f;
        o.epsilon_high = config.eps_high;
        o.sapo_temperature_pos = 1.7f;
        o.sapo_temperature_neg = 0.6f;
        o.delta = config.delta;
        o.use_bias_correction_kl = config.bias_correction;
        o.grad_scale = 0.7f;
        o.importance_sampling =
            sequence ? ImportanceSampling::kSequence : ImportanceSampling::kToken;
        PolicyReferenceOutputs ref;
        const absl::Status st = PolicyReference(pp, &ref);
        ASSERT_TRUE(st.ok()) << st;
        const LossProblem p = PolicyProblemOf(head, pp);
        SCOPED_TRACE(testing::Message()
                     << PolicyLossTypeName(type) << (sequence ? " sequence" : " token")
                     << " old " << (inputs & 1) << " ref " << (inputs & 2) / 2 << " is_ratio "
                     << with_rho << " delta " << config.delta << " bias-corrected KL "
                     << config.bias_correction);
        Outputs out;
        WriteRowLossOutputs(p, out.view(), head.targets32(), RowsOf(ref.logp, {}, lref.lse));
        ExpectClose(ref.loss, out.loss, "loss");
        ExpectClose(ref.kl, out.kl, "kl");
        EXPECT_EQ(out.clip_fraction, static_cast<float>(ref.clip_fraction));
        clipped_cases += ref.clip_fraction > 0 ? 1 : 0;
        ++checked;
        if (!sequence) continue;
        // The coefficients from logp as the device writes it (fp32), against grad_scale w_i
        // times the reference's dloss/dlogp_i / w_i.
        std::vector<float> logp(kBt);
        for (int64_t i = 0; i < kBt; ++i) logp[i] = static_cast<float>(ref.logp[i]);
        const std::vector<double> c = SequenceCoefficients(p, head.targets32(), logp);
        int64_t tokens = 0;
        const std::vector<double> w = PolicyRowWeights(p, head.targets32(), &tokens);
        ASSERT_EQ(c.size(), static_cast<size_t>(kBt));
        double scale = 0;
        for (int64_t i = 0; i < kBt; ++i) {
          scale = std::max(scale, std::fabs(w[i] * ref.dl_dlogp[i]));
        }
        EXPECT_GT(scale, 0.0) << "every coefficient is 0: a weak case";
        for (int64_t i = 0; i < kBt; ++i) {
          const double want = 0.7 * w[i] * ref.dl_dlogp[i];
          EXPECT_NEAR(c[i], want, 1e-5 * (std::fabs(want) + 0.7 * scale))
              << "row " << i << " (sequence " << i / kS << ", masked " << !mask[i] << ")";
        }
      }
    }
  }
  // token: 9 types x 4 inputs with is_ratio; sequence: 7 clipped configs x 8 inputs.
  EXPECT_EQ(checked, 36 + 56);
  EXPECT_GT(clipped_cases, 40) << "few cases clip a row: the clip branches are weakly covered";
}

// A policy problem's per-row inputs over `head`: the current log-probs (the logprob
// reference's), advantages in (-1, 1), old log-probs within `spread` of the current ones,
// reference ones within 0.5, rollout weights in (0.2, 2), and the counted rows' mask.
struct PolicyRows {
  LogprobReferenceOutputs lref;
  std::vector<float> adv, old_logp, ref_logp, rho;
  std::vector<uint8_t> mask;

  PolicyRows(const Head& head, uint64_t seed, double spread) {
    LogprobProblem lp;
    lp.head = head.inputs();
    lp.targets = head.targets.data();
    EXPECT_TRUE(LogprobReference(lp, &lref).ok());
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    for (int64_t i = 0; i < kBt; ++i) {
      adv.push_back(static_cast<float>(uni(rng)));
      old_logp.push_back(static_cast<float>(lref.logp[i] - spread * uni(rng)));
      ref_logp.push_back(static_cast<float>(lref.logp[i] + 0.5 * uni(rng)));
      rho.push_back(static_cast<float>(1.1 + 0.9 * uni(rng)));
      mask.push_back(head.targets[i] != -100);
    }
  }

  // A problem of `batch` sequences over these rows (with the rollout weights if `with_rho`);
  // its options the reference's defaults.
  PolicyProblem Problem(const Head& head, int64_t batch, bool with_rho) const {
    PolicyProblem pp;
    pp.head = head.inputs();
    pp.batch = batch;
    pp.targets = head.targets.data();
    pp.mask = mask.data();
    pp.advantages = adv.data();
    pp.old_logp = old_logp.data();
    pp.ref_logp = ref_logp.data();
    pp.is_ratio = with_rho ? rho.data() : nullptr;
    return pp;
  }
};

// verl's menu (the KL estimators and straight-through, the entropy bonus, the aggregation
// modes, gpg) at token level and, for the clipped types, at sequence level: the loss and the
// kl metric from the rows' logp and entropy; every row's entropy coefficient
// -grad_scale w_i entropy_coeff; at sequence level every row's logp coefficient (what the
// gradient pass runs with), each against the reference.
TEST(RowLossIoTest, PolicyVerlMenuMatchesTheReference) {
  const Head head(8);
  const PolicyRows rows(head, 11, 0.4);
  const LogprobReferenceOutputs& lref = rows.lref;
  const struct {
    PolicyLossType type;
    KlEstimator kl;
    bool st;
    float entropy;
    PolicyAggregation agg;
  } configs[] = {
      {PolicyLossType::kGpg, KlEstimator::kK1, false, 0.05f, PolicyAggregation::kLossType},
      {PolicyLossType::kDapo, KlEstimator::kK2, false, 0.0f, PolicyAggregation::kSeqMeanTokenMean},
      {PolicyLossType::kGrpo, KlEstimator::kAbs, false, 0.02f, PolicyAggregation::kTokenMean},
      {PolicyLossType::kLuspo, KlEstimator::kLowVarKl, true, -0.03f,
       PolicyAggregation::kSeqMeanTokenSumNorm},
      {PolicyLossType::kBnpo, KlEstimator::kK3, true, 0.01f, PolicyAggregation::kSeqMeanTokenSum},
  };
  constexpr int64_t kSeqs = 3;
  int checked = 0;
  for (const bool sequence : {false, true}) {
    for (const auto& config : configs) {
      if (sequence && !PolicyLossTypeClips(config.type)) continue;  // refused
      for (const bool bias_correction : {false, true}) {
        PolicyProblem pp = rows.Problem(head, kSeqs, false);
        PolicyOptions& o = pp.options;
        o.loss_type = config.type;
        o.beta = 0.2f;
        o.use_bias_correction_kl = bias_correction;
        o.kl_estimator = config.kl;
        o.kl_straight_through = config.st;
        o.entropy_coeff = config.entropy;
        o.aggregation = config.agg;
        o.loss_scale_factor = config.agg == PolicyAggregation::kSeqMeanTokenSumNorm ? 5.0 : 0.0;
        o.grad_scale = 0.7f;
        o.importance_sampling =
            sequence ? ImportanceSampling::kSequence : ImportanceSampling::kToken;
        PolicyReferenceOutputs ref;
        const absl::Status st = PolicyReference(pp, &ref);
        ASSERT_TRUE(st.ok()) << st;
        const LossProblem p = PolicyProblemOf(head, pp);
        SCOPED_TRACE(testing::Message()
                     << PolicyLossTypeName(o.loss_type) << (sequence ? " sequence " : " token ")
                     << KlEstimatorName(o.kl_estimator) << (o.kl_straight_through ? "+" : "")
                     << " entropy " << o.entropy_coeff << " "
                     << PolicyAggregationName(o.aggregation) << " bias-corrected "
                     << bias_correction);
        Outputs out;
        WriteRowLossOutputs(p, out.view(), head.targets32(),
                            RowsOf(ref.logp, lref.entropy, lref.lse));
        ExpectClose(ref.loss, out.loss, "loss");
        // k1's terms have either sign: the metric's error is relative to the mean of |kl_i|.
        double kl_scale = 0;
        for (double k : ref.kl_token) kl_scale += std::fabs(k);
        kl_scale /= std::max<double>(1.0, static_cast<double>(ref.tokens));
        EXPECT_NEAR(out.kl, ref.kl, 1e-5 * (kl_scale + 1e-3)) << "kl";
        EXPECT_EQ(out.clip_fraction, static_cast<float>(ref.clip_fraction));
        int64_t tokens = 0;
        const std::vector<double> w = PolicyRowWeights(p, head.targets32(), &tokens);
        const std::vector<double> e = EntropyCoefficients(p, head.targets32());
        ASSERT_EQ(e.size(), config.entropy != 0.0f ? static_cast<size_t>(kBt) : 0u);
        for (size_t i = 0; i < e.size(); ++i) {
          const double want = -static_cast<double>(p.options.grad_scale) * w[i] * config.entropy;
          EXPECT_NEAR(e[i], want, 1e-15) << "row " << i;
        }
        ++checked;
        if (!sequence) continue;
        std::vector<float> logp(kBt);
        for (int64_t i = 0; i < kBt; ++i) logp[i] = static_cast<float>(ref.logp[i]);
        const std::vector<double> c = SequenceCoefficients(p, head.targets32(), logp);
        ASSERT_EQ(c.size(), static_cast<size_t>(kBt));
        double scale = 0;
        for (int64_t i = 0; i < kBt; ++i) scale = std::max(scale, std::fabs(w[i] * ref.dl_dlogp[i]));
        EXPECT_GT(scale, 0.0) << "every coefficient is 0: a weak case";
        for (int64_t i = 0; i < kBt; ++i) {
          const double want = 0.7 * w[i] * ref.dl_dlogp[i];
          EXPECT_NEAR(c[i], want, 1e-5 * (std::fabs(want) + 0.7 * scale)) << "row " << i;
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 5 + 2 * 4);  // token: every config; sequence: the clipped four
}

// geo_mean (verl's GMPO), kl_cov (verl's KL-Cov) and vespo (Liger's) through the host code a
// CUDA Compute runs by group: the loss, kl and clip fraction from the rows' logp and entropy, and every row's logp
// coefficient (what the gradient pass runs with), against the reference; with the KL term, the
// entropy bonus, an aggregation and the rollout weights.
TEST(RowLossIoTest, PolicyGeoMeanKlCovAndVespoMatchTheReference) {
  const Head head(9);
  const PolicyRows rows(head, 13, 0.5);  // log-ratios past both clip bounds
  const LogprobReferenceOutputs& lref = rows.lref;
  const struct {
    PolicyLossType type;
    KlEstimator kl;
    float beta, entropy;
    PolicyAggregation agg;
    bool is_ratio;
  } configs[] = {
      {PolicyLossType::kGeoMean, KlEstimator::kK3, 0.2f, 0.0f, PolicyAggregation::kLossType,
       false},
      {PolicyLossType::kGeoMean, KlEstimator::kLowVarKl, 0.1f, 0.05f,
       PolicyAggregation::kTokenMean, true},
      {PolicyLossType::kGeoMean, KlEstimator::kK2, 0.0f, 0.0f,
       PolicyAggregation::kSeqMeanTokenMean, true},
      {PolicyLossType::kKlCov, KlEstimator::kK3, 0.2f, 0.0f, PolicyAggregation::kLossType, false},
      {PolicyLossType::kKlCov, KlEstimator::kK1, 0.1f, 0.05f, PolicyAggregation::kSeqMeanTokenSum,
       true},
      {PolicyLossType::kVespo, KlEstimator::kK3, 0.2f, 0.0f, PolicyAggregation::kLossType, true},
      {PolicyLossType::kVespo, KlEstimator::kAbs, 0.1f, 0.05f,
       PolicyAggregation::kSeqMeanTokenMean, false},
  };
  for (const auto& config : configs) {
    PolicyProblem pp = rows.Problem(head, 3, config.is_ratio);
    PolicyOptions& o = pp.options;
    o.loss_type = config.type;
    o.epsilon_high = 0.28f;
    o.kl_cov_ratio = 0.2;
    o.ppo_kl_coef = 0.6f;
    o.vespo_k_pos = 1.5f;  // not the defaults, so a swapped pair shows
    o.vespo_lambda_neg = 2.5f;
    o.beta = config.beta;
    o.kl_estimator = config.kl;
    o.entropy_coeff = config.entropy;
    o.aggregation = config.agg;
    o.grad_scale = 0.7f;
    PolicyReferenceOutputs ref;
    const absl::Status st = PolicyReference(pp, &ref);
    ASSERT_TRUE(st.ok()) << st;
    const LossProblem p = PolicyProblemOf(head, pp);
    SCOPED_TRACE(testing::Message() << PolicyLossTypeName(o.loss_type) << " "
                                    << KlEstimatorName(o.kl_estimator) << " beta " << o.beta
                                    << " entropy " << o.entropy_coeff << " "
                                    << PolicyAggregationName(o.aggregation) << " is_ratio "
                                    << config.is_ratio);
    if (config.type == PolicyLossType::kVespo) {
      EXPECT_EQ(ref.clip_fraction, 0.0);  // it never clips
    } else {
      EXPECT_GT(ref.clip_fraction, 0.0) << "no row clipped: a weak case";
    }
    Outputs out;
    WriteRowLossOutputs(p, out.view(), head.targets32(),
                        RowsOf(ref.logp, lref.entropy, lref.lse));
    ExpectClose(ref.loss, out.loss, "loss");
    if (config.beta != 0.0f) ExpectClose(ref.kl, out.kl, "kl");
    EXPECT_EQ(out.clip_fraction, static_cast<float>(ref.clip_fraction));
    std::vector<float> logp(kBt);
    for (int64_t i = 0; i < kBt; ++i) logp[i] = static_cast<float>(ref.logp[i]);
    int64_t tokens = 0;
    const std::vector<double> w = PolicyRowWeights(p, head.targets32(), &tokens);
    const std::vector<double> c = SequenceCoefficients(p, head.targets32(), logp);
    ASSERT_EQ(c.size(), static_cast<size_t>(kBt));
    double scale = 0;
    for (int64_t i = 0; i < kBt; ++i) scale = std::max(scale, std::fabs(w[i] * ref.dl_dlogp[i]));
    EXPECT_GT(scale, 0.0) << "every coefficient is 0: a weak case";
    for (int64_t i = 0; i < kBt; ++i) {
      const double want = 0.7 * w[i] * ref.dl_dlogp[i];
      EXPECT_NEAR(c[i], want, 1e-5 * (std::fabs(want) + 0.7 * scale)) << "row " << i;
    }
  }
}

TEST(RowLossIoTest, DistillLossIsTheMeanOfTheRowsThatCount) {
  const Head student(4), teacher(5);
  DistillProblem dp;
  dp.student = student.inputs();
  dp.teacher = teacher.inputs();
  dp.labels = student.targets.data();
  DistillReferenceOutputs ref;
  ASSERT_TRUE(DistillReference(dp, &ref).ok());
  LossProblem p = student.problem(LossKind::kDistill);
  std::vector<int32_t> rows32;
  absl::StatusOr<TargetSummary> s = DistillRows(p, &rows32);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->tokens, ref.tokens);
  Outputs out;
  WriteRowLossOutputs(p, out.view(), rows32,
                      RowsOf(ref.row_loss, {}, std::vector<double>(kBt, 1.0)));
  ExpectClose(ref.loss, out.loss, "loss");
  EXPECT_EQ(out.tokens, ref.tokens);
  // Distill has no logp or entropy output: left as they were.
  EXPECT_TRUE(std::isnan(out.logp[0]));
  EXPECT_TRUE(std::isnan(out.entropy[0]));
}

// The hard-label term (weight_hard_loss != 0): DistillRows hands each counted row's label to
// the kernel, and the loss is (w_h sum ce_i + w_s sum row_i) / n, ce_i the label's
// cross-entropy at temperature 1 (the kernel writes it where logprob's entropy goes), the
// divergence at T = 2, against the reference.
TEST(RowLossIoTest, DistillHardTermTakesTheLabelsAndWeighsBothTerms) {
  const Head student(4), teacher(5);
  LogprobProblem lp;
  lp.head = student.inputs();
  lp.targets = student.targets.data();
  LogprobReferenceOutputs lref;  // at temperature 1: ce_i = -logp_i
  ASSERT_TRUE(LogprobReference(lp, &lref).ok());
  std::vector<double> ce(kBt);
  for (int64_t i = 0; i < kBt; ++i) ce[i] = -lref.logp[i];
  for (const auto& w : {std::pair<float, float>{0.5f, 0.5f}, {1.0f, 0.25f}}) {
    DistillProblem dp;
    dp.student = student.inputs();
    dp.teacher = teacher.inputs();
    dp.labels = student.targets.data();
    dp.options.temperature = 2.0f;
    dp.options.weight_hard_loss = w.first;
    dp.options.weight_soft_loss = w.second;
    DistillReferenceOutputs ref;
    ASSERT_TRUE(DistillReference(dp, &ref).ok());
    EXPECT_GT(ref.hard_loss, 0.0) << "no hard term: a weak case";
    LossProblem p = student.problem(LossKind::kDistill);
    p.options.temperature = 2.0f;
    p.distill.weight_hard_loss = w.first;
    p.distill.weight_soft_loss = w.second;
    std::vector<int32_t> rows32;
    absl::StatusOr<TargetSummary> s = DistillRows(p, &rows32);
    ASSERT_TRUE(s.ok()) << s.status();
    for (int64_t i = 0; i < kBt; ++i) {
      EXPECT_EQ(rows32[i], student.targets[i] == -100 ? -1 : student.targets[i]) << i;
    }
    Outputs out;
    WriteRowLossOutputs(p, out.view(), rows32,
                        RowsOf(ref.row_loss, ce, std::vector<double>(kBt, 1.0)));
    ExpectClose(ref.loss, out.loss, "loss");
    EXPECT_EQ(out.tokens, ref.tokens);
  }
}

// Targets only mark ignored rows: any other value counts, out of range or negative; none:
// every row counts.
TEST(RowLossIoTest, DistillRowsOnlyCompareWithIgnoreIndex) {
  LossProblem p;
  p.bt = 4;
  p.v = 3;
  p.kind = LossKind::kDistill;
  const int32_t targets[4] = {7, -100, -5, 1};
  p.targets = targets;
  p.target_dtype = DType::kI32;
  std::vector<int32_t> rows;
  absl::StatusOr<TargetSummary> s = DistillRows(p, &rows);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(rows, (std::vector<int32_t>{0, -1, 0, 0}));
  EXPECT_EQ(s->tokens, 3);
  p.targets = nullptr;
  s = DistillRows(p, &rows);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(rows, (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(s->tokens, 4);
}

TEST(RowLossIoTest, DeviceBytesOfEachKind) {
  WorkspaceShape s;
  s.bt = 1000;
  s.h = 64;
  s.v = 500;
  s.dtype = DType::kBF16;
  EXPECT_EQ(RowLossInputBytes(s), 0u);  // cross-entropy
  s.kind = LossKind::kLogprob;
  EXPECT_EQ(RowLossInputBytes(s), 2 * Align(4000));
  s.kind = LossKind::kPolicy;
  EXPECT_EQ(RowLossInputBytes(s), 5 * Align(4000));
  s.kind = LossKind::kDistill;
  s.teacher_h = 96;
  s.teacher_w_memory = Memory::kHost;
  EXPECT_EQ(RowLossInputBytes(s), Align(1000 * 96 * 2) + Align(500 * 96 * 2) + Align(500 * 2));
  s.teacher_w_memory = Memory::kBackend;
  EXPECT_EQ(RowLossInputBytes(s), Align(1000 * 96 * 2));
  for (LossKind k : {LossKind::kCrossEntropy, LossKind::kLogprob, LossKind::kPolicy,
                     LossKind::kDistill}) {
    EXPECT_TRUE(RowLossKindComputed(k)) << LossKindName(k);
  }
  EXPECT_FALSE(RowLossKindComputed(static_cast<LossKind>(4)));
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
