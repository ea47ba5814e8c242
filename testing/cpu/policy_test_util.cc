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

}  // namespace lossd
