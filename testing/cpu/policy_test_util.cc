// SPDX-License-Identifier: Apache-2.0
#include "testing/cpu/policy_test_util.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "testing/finite_difference.h"

namespace lossd {

void SetOldAndRefLogprobs(const std::vector<double>& logp, uint32_t seed, bool old, KlCase kl,
                          Inputs* in, PolicyProblem* p) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> shift(-0.5f, 0.5f);
  for (int64_t i = 0; i < in->bt; ++i) {
    in->old_logp[i] = static_cast<float>(logp[i] - std::log(kFdRatios[i]));
    in->ref_logp[i] = static_cast<float>(logp[i]) + shift(rng);
  }
  if (!old) p->old_logp = nullptr;
  if (kl == kBetaWithoutRef) p->ref_logp = nullptr;
}

FrozenProblem::FrozenProblem(const PolicyProblem& p, const std::vector<double>& logp)
    : frozen(logp.begin(), logp.end()), q(p) {
  if (q.old_logp == nullptr) q.old_logp = frozen.data();
  if (q.ref_logp == nullptr) q.ref_logp = frozen.data();
}

double ScaledLoss(const PolicyProblem& q) {
  PolicyReferenceOutputs f;
  EXPECT_TRUE(PolicyReference(q, &f).ok());
  return static_cast<double>(q.options.grad_scale) * f.loss;
}

void ExpectKlMetric(const PolicyReferenceOutputs& r, KlCase kl) {
  if (kl == kKlWithRef) {
    EXPECT_GT(r.kl, 1e-3);
  } else {
    EXPECT_EQ(r.kl, 0.0);
  }
}

void ExpectHeadGradientMatches(Inputs& in, const HeadGradients& g, bool bias,
                               const std::function<double()>& objective) {
  double largest = ExpectGradientMatches("dx", in.x.data(), g.dx, objective);
  largest = std::max(largest, ExpectGradientMatches("dw", in.w.data(), g.dw, objective));
  if (bias) ExpectGradientMatches("db", in.b.data(), g.db, objective);
  EXPECT_GT(largest, 100 * kFdAtol);  // the comparisons above were not of zeros
}

std::string OldKlName(bool old, KlCase kl) {
  std::string name = old ? "_old" : "_noold";
  return name + (kl == kNoKl ? "_beta0" : kl == kKlWithRef ? "_kl" : "_beta_noref");
}

std::string MaskHeadName(bool masked, bool bias) {
  return std::string(masked ? "_mask" : "") + (bias ? "_bias_softcap" : "");
}

void ExpectNearAll(const std::vector<double>& a, const std::vector<double>& b, double tol,
                   const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  double worst = 0, norm = 0;
  for (size_t k = 0; k < a.size(); ++k) {
    worst = std::max(worst, std::fabs(a[k] - b[k]));
    norm = std::max(norm, std::fabs(b[k]));
  }
  EXPECT_GT(norm, 0.0) << what;
  EXPECT_LE(worst, tol * norm) << what;
}

PolicyReferenceOutputs RunPolicyReference(const PolicyProblem& p) {
  PolicyReferenceOutputs r;
  const absl::Status st = PolicyReference(p, &r);
  EXPECT_TRUE(st.ok()) << st;
  return r;
}

void ExpectRefused(const PolicyProblem& p, const std::string& substring) {
  PolicyReferenceOutputs r;
  const absl::Status st = PolicyReference(p, &r);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << substring;
  EXPECT_NE(st.message().find(substring), std::string::npos) << st;
}

namespace {

double VespoPhi(double u, double k, double lambda) {
  const double lw = std::clamp(u, std::log(1e-8), 20.0);
  const double l = std::max(lambda, 1e-4);
  return std::exp(l + k * lw - l * std::exp(lw));
}

}  // namespace

VespoWeights VespoWeightsOf(const PolicyProblem& p, const std::vector<double>& logp,
                            const std::vector<double>& logp_bound) {
  const PolicyOptions& o = p.options;
  const int64_t bt = p.head.bt, s = bt / p.batch;
  VespoWeights out;
  out.phi.assign(bt, 0.0);
  out.dphi.assign(bt, 0.0);
  for (int64_t b = 0; b < p.batch; ++b) {
    double u = 0, e = 0;
    for (int64_t i = b * s; i < (b + 1) * s; ++i) {
      if (p.is_ratio != nullptr) {
        u += std::clamp(std::log(double{p.is_ratio[i]}), std::log(1e-8), 20.0);
      }
      if ((p.mask != nullptr && p.mask[i] == 0) || p.old_logp == nullptr) continue;
      u += std::clamp(logp[i] - p.old_logp[i], -20.0, 20.0);
      e += logp_bound.empty() ? 0.0 : logp_bound[i];
    }
    for (int64_t i = b * s; i < (b + 1) * s; ++i) {
      const bool pos = p.advantages[i] >= 0;
      const double k = pos ? o.vespo_k_pos : o.vespo_k_neg;
      const double l = pos ? o.vespo_lambda_pos : o.vespo_lambda_neg;
      const double at = VespoPhi(u, k, l);
      double d = std::max(std::fabs(VespoPhi(u - e, k, l) - at),
                          std::fabs(VespoPhi(u + e, k, l) - at));
      const double peak = std::log(k / std::max(l, 1e-4));
      if (k > 0 && std::fabs(peak - u) <= e) d = std::max(d, std::fabs(VespoPhi(peak, k, l) - at));
      out.phi[i] = at;
      out.dphi[i] = d;
    }
  }
  return out;
}

}  // namespace lossd
