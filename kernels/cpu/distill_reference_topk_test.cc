// SPDX-License-Identifier: Apache-2.0
// Tests of the distillation reference from the teacher's top-k log-probs (no teacher head):
// the student's gradients against central finite differences over jsd_beta x the tail's
// treatment x temperature x the hard-label term; every id of the vocabulary sent gives the
// teacher head's divergence; the bucket's forward KL computed here directly (and below the
// full KL), none's as verl writes it, renormalize's indifference to a shift of the log-probs;
// and the refusals, each naming the field, row and value.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "core/dtype.h"
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/finite_difference.h"

namespace lossd {
namespace {

// log softmax(z / T) of row i of a head (fp32 x (BT, H), w (V, H), no bias), in double.
std::vector<double> LogSoftmax(const std::vector<float>& x, const std::vector<float>& w,
                               int64_t h, int64_t v, int64_t i, double t) {
  std::vector<double> z(v);
  double m = -INFINITY;
  for (int64_t j = 0; j < v; ++j) {
    double u = 0;
    for (int64_t k = 0; k < h; ++k) u += double{x[i * h + k]} * w[j * h + k];
    m = std::max(m, z[j] = u / t);
  }
  double s = 0;
  for (double e : z) s += std::exp(e - m);
  for (double& e : z) e -= m + std::log(s);
  return z;
}

// A random student head, a random teacher head, and per row the teacher's k ids (distinct,
// random order) with their log-probs at temperature `teacher_t`, fp32; labels in [0, V) with
// row 1 ignored.
struct Inputs {
  int64_t bt, h, v, k;
  std::vector<float> x, w, b, xt, wt;
  std::vector<int64_t> labels, ids;
  std::vector<float> logp;

  Inputs(int64_t bt_, int64_t h_, int64_t v_, int64_t k_, uint32_t seed, double teacher_t = 1)
      : bt(bt_), h(h_), v(v_), k(k_) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    x.resize(bt * h);
    w.resize(v * h);
    b.resize(v);
    xt.resize(bt * h);
    wt.resize(v * h);
    for (auto* a : {&x, &w, &b, &xt, &wt}) {
      for (float& e : *a) e = u(rng);
    }
    for (float& e : wt) e *= 2;
    labels.resize(bt);
    std::uniform_int_distribution<int64_t> t(0, v - 1);
    for (int64_t& e : labels) e = t(rng);
    labels[1] = -100;
    std::vector<int64_t> perm(v);
    for (int64_t i = 0; i < bt; ++i) {
      const std::vector<double> lp = LogSoftmax(xt, wt, h, v, i, teacher_t);
      std::iota(perm.begin(), perm.end(), 0);
      std::shuffle(perm.begin(), perm.end(), rng);
      for (int64_t a = 0; a < k; ++a) {
        ids.push_back(perm[a]);
        logp.push_back(static_cast<float>(lp[perm[a]]));
      }
    }
  }

  DistillProblem Problem(bool bias) {
    DistillProblem p;
    p.student = HeadInputs{bt, h, v, DType::kF32, x.data(), w.data(), bias ? b.data() : nullptr};
    p.topk = k;
    p.topk_ids = ids.data();
    p.topk_logp = logp.data();
    p.labels = labels.data();
    return p;
  }
};

using FdParam = std::tuple<float /*jsd_beta*/, DistillTopkTail, float /*temperature*/,
                           bool /*hard term*/>;

class DistillTopkFiniteDifferenceTest : public ::testing::TestWithParam<FdParam> {};

TEST_P(DistillTopkFiniteDifferenceTest, GradientsMatchFiniteDifferences) {
  const auto [beta, tail, temperature, hard] = GetParam();
  Inputs in(4, 3, 7, 3, 17);
  DistillProblem p = in.Problem(true);
  p.options.jsd_beta = beta;
  p.options.topk_tail = tail;
  p.options.temperature = temperature;
  p.options.grad_scale = 1.25f;
  if (hard) {
    p.options.weight_hard_loss = 0.4f;
    p.options.weight_soft_loss = 0.8f;
  }
  DistillReferenceOutputs r;
  const absl::Status st = DistillReference(p, &r);
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_EQ(r.tokens, 3);
  EXPECT_GT(std::fabs(r.soft_loss), 1e-3);
  auto objective = [&]() {
    DistillReferenceOutputs f;
    EXPECT_TRUE(DistillReference(p, &f).ok());
    return 1.25 * f.loss;
  };
  double largest = ExpectGradientMatches("dx", in.x.data(), r.grad.dx, objective);
  largest = std::max(largest, ExpectGradientMatches("dw", in.w.data(), r.grad.dw, objective));
  ExpectGradientMatches("db", in.b.data(), r.grad.db, objective);
  EXPECT_GT(largest, 100 * kFdAtol);
  for (int64_t c = 0; c < in.h; ++c) EXPECT_EQ(r.grad.dx[1 * in.h + c], 0.0);
}

std::string FdName(const ::testing::TestParamInfo<FdParam>& info) {
  const auto [beta, tail, temperature, hard] = info.param;
  return "beta" + std::to_string(static_cast<int>(beta * 100)) + "_" +
         DistillTopkTailName(tail) + "_T" + std::to_string(static_cast<int>(temperature * 10)) +
         (hard ? "_hard" : "");
}

INSTANTIATE_TEST_SUITE_P(
    AllOptions, DistillTopkFiniteDifferenceTest,
    ::testing::Combine(::testing::Values(0.0f, 0.3f, 1.0f),
                       ::testing::Values(DistillTopkTail::kBucket, DistillTopkTail::kRenormalize,
                                         DistillTopkTail::kNone),
                       ::testing::Values(1.0f, 1.6f), ::testing::Bool()),
    FdName);

// Every id sent (k = V, the teacher's log-probs at T): the teacher head's divergence, under
// every treatment of the (then empty) tail.
TEST(DistillReferenceTopkTest, TheWholeVocabularyIsTheTeacherHeadsDivergence) {
  const double t = 1.5;
  Inputs in(3, 4, 6, 6, 5, t);
  for (float beta : {0.0f, 0.4f, 1.0f}) {
    DistillProblem head = in.Problem(false);
    head.topk = 0;
    head.teacher = HeadInputs{in.bt, in.h, in.v, DType::kF32, in.xt.data(), in.wt.data(), nullptr};
    head.options.jsd_beta = beta;
    head.options.temperature = static_cast<float>(t);
    DistillReferenceOutputs want;
    ASSERT_TRUE(DistillReference(head, &want).ok());
    for (DistillTopkTail tail : {DistillTopkTail::kBucket, DistillTopkTail::kRenormalize,
                                 DistillTopkTail::kNone}) {
      DistillProblem p = in.Problem(false);
      p.options = head.options;
      p.options.topk_tail = tail;
      DistillReferenceOutputs got;
      ASSERT_TRUE(DistillReference(p, &got).ok());
      // The log-probs were rounded to fp32 (relative 6e-8).
      EXPECT_NEAR(got.loss, want.loss, 1e-6 * (1 + want.loss)) << beta << " " << int(tail);
      for (size_t c = 0; c < want.grad.dw.size(); ++c) {
        ASSERT_NEAR(got.grad.dw[c], want.grad.dw[c], 1e-6) << beta << " " << int(tail) << c;
      }
    }
  }
}

// The forward KL of each treatment computed here from the student's log-softmax: the bucket's
// sum_a p_a (lp_a - log q_a) + p_tail log(p_tail / q_tail), below the full KL (coarsening
// loses information); none's without the tail term (verl's forward_kl_topk); renormalize's
// over the k ids, unchanged by a constant added to the log-probs.
TEST(DistillReferenceTopkTest, ForwardKlOfEachTreatmentComputedDirectly) {
  Inputs in(3, 4, 9, 4, 23);
  in.labels[1] = 2;  // every row counts
  double bucket = 0, none = 0, renorm = 0, full = 0;
  for (int64_t i = 0; i < in.bt; ++i) {
    const std::vector<double> lq = LogSoftmax(in.x, in.w, in.h, in.v, i, 1.0);
    const std::vector<double> lpt = LogSoftmax(in.xt, in.wt, in.h, in.v, i, 1.0);
    double p_sum = 0, q_sum = 0;
    for (int64_t a = 0; a < in.k; ++a) {
      const double lp = in.logp[i * in.k + a], l = lq[in.ids[i * in.k + a]];
      none += std::exp(lp) * (lp - l);
      p_sum += std::exp(lp);
      q_sum += std::exp(l);
    }
    bucket += (1 - p_sum) * std::log((1 - p_sum) / (1 - q_sum));
    for (int64_t a = 0; a < in.k; ++a) {
      const double lp = in.logp[i * in.k + a] - std::log(p_sum);
      const double l = lq[in.ids[i * in.k + a]] - std::log(q_sum);
      renorm += std::exp(lp) * (lp - l);
    }
    for (int64_t j = 0; j < in.v; ++j) full += std::exp(lpt[j]) * (lpt[j] - lq[j]);
  }
  bucket += none;
  DistillProblem p = in.Problem(false);
  p.options.jsd_beta = 0.0f;
  DistillReferenceOutputs r;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_NEAR(r.loss, bucket / 3, 1e-12);
  EXPECT_LT(r.loss, full / 3 - 1e-3);  // coarsening to k + 1 events loses information
  p.options.topk_tail = DistillTopkTail::kNone;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_NEAR(r.loss, none / 3, 1e-12);
  p.options.topk_tail = DistillTopkTail::kRenormalize;
  ASSERT_TRUE(DistillReference(p, &r).ok());
  EXPECT_NEAR(r.loss, renorm / 3, 1e-12);
  for (float& lp : in.logp) lp -= 3.0f;  // a shift, rounded to fp32 (relative 6e-8)
  DistillReferenceOutputs shifted;
  ASSERT_TRUE(DistillReference(p, &shifted).ok());
  EXPECT_NEAR(shifted.loss, r.loss, 1e-6);
}

TEST(DistillReferenceTopkTest, RejectsBadTopkNamingRowAndValue) {
  auto expect_refused = [](const DistillProblem& p, const std::string& substring) {
    DistillReferenceOutputs r;
    const absl::Status st = DistillReference(p, &r);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << substring;
    EXPECT_NE(st.message().find(substring), std::string::npos) << st;
  };
  Inputs in(3, 3, 5, 2, 8);
  DistillProblem p = in.Problem(false);
  DistillReferenceOutputs ok;
  ASSERT_TRUE(DistillReference(p, &ok).ok());
  in.ids[2 * 2 + 1] = 5;
  expect_refused(p, "teacher_topk_ids[2, 1] = 5 is outside [0, V=5)");
  in.ids[2 * 2 + 1] = in.ids[2 * 2];
  expect_refused(p, "teacher_topk_ids row 2 repeats id");
  in.ids[2 * 2 + 1] = -7;
  in.labels[2] = -100;  // an ignored row is never read
  EXPECT_TRUE(DistillReference(p, &ok).ok());
  in = Inputs(3, 3, 5, 2, 8);
  p = in.Problem(false);
  in.logp[1] = NAN;
  expect_refused(p, "teacher_topk_logp[0, 1] = nan is not finite");
  in.logp[1] = 0.0f;  // with logp[0] < 0 the row sums above 1
  expect_refused(p, "teacher_topk_logp row 0: its probabilities sum to");
  p.options.topk_tail = DistillTopkTail::kRenormalize;  // any log-probs
  EXPECT_TRUE(DistillReference(p, &ok).ok());
  in.logp[0] = -30.0f;  // 1 + e^-30: no mass left for the tail
  in.logp[1] = 0.0f;
  p.options.topk_tail = DistillTopkTail::kBucket;
  p.options.jsd_beta = 1.0f;
  expect_refused(p, "leaving the tail bucket empty, where the reverse KL (jsd_beta 1) is infinite");
  p.options.jsd_beta = 0.5f;  // the JSD and forward KL take an empty tail
  EXPECT_TRUE(DistillReference(p, &ok).ok());
  p.topk = 6;
  expect_refused(p, "teacher_topk_ids: k = 6 ids per row must be in [1, 5]");
  p.topk = 2;
  p.options.topk_tail = static_cast<DistillTopkTail>(3);
  expect_refused(p, "distill.topk_tail 3 is unknown");
}

}  // namespace
}  // namespace lossd
