// SPDX-License-Identifier: Apache-2.0
// GPU tests of the CUDA backend's policy kind at sequence level (GSPO: a forward pass, the
// coefficients on the host, then the gradient pass as logprob; policy_sequence.h) and with
// is_ratio (the rollout correction on the surrogate's term, in the row kernel at token level),
// against the float64 reference (kernels/cpu/policy_reference.h) within the bounds of
// row_loss_test_bounds.h: the policy cases of row_loss_test_cases.h at either level, over
// tiny, odd and medium shapes in bf16, fp16 and fp32; a realistic vocabulary in chunks that
// cut sequences; no gradient wanted (one pass); a bit-identical rerun; streamed rows. Each
// comparison prints its largest errors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cpu/logprob_reference.h"
#include "kernels/cuda/cuda_backend.h"
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/cuda/row_loss_test_cases.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {
namespace {

// A policy case of kCases (by index) at token or sequence level, with or without is_ratio.
struct SequenceCase {
  int base;
  bool sequence, is_ratio;
};

// kCases: 3 dapo (bias), 4 grpo (masked, no old log-probs, T and softcap), 5 bnpo (no KL,
// chunks of 7, accumulated), 6 dr_grpo (fp32 gradients), 7 dapo (normaliser 1e4), 11 cispo,
// 12 sapo (bias-corrected KL), 13 luspo (delta, chunks of 7, accumulated), 14 grpo (delta,
// bias-corrected KL, fp32 gradients); verl's menu: 15 gpg (k1, entropy bonus), 16 dapo (k2,
// seq-mean-token-mean), 17 grpo (abs, token-mean, entropy, bias-corrected), 18 luspo
// (low_var_kl straight-through, seq-mean-token-sum-norm, entropy, chunks of 7); geo_mean, by
// sequence itself: 21 (bias), 22 (low_var_kl, token-mean, entropy, T and softcap, chunks of
// 7, accumulated). Sequence level is for the clipped types only.
constexpr SequenceCase kSequenceCases[] = {
    {3, true, false},  {4, true, false},  {5, true, true},   {6, true, false},
    {7, true, true},   {13, true, true},  {14, true, false}, {14, true, true},
    {3, false, true},  {11, false, true}, {12, false, true}, {13, false, true},
    {15, false, true}, {16, true, false}, {17, true, true},  {18, true, false},
    {21, false, true}, {22, false, false},
};
constexpr int kNumSequenceCases =
    static_cast<int>(sizeof(kSequenceCases) / sizeof(kSequenceCases[0]));

std::string CaseName(const SequenceCase& c) {
  return std::string(kCases[c.base].name) + (c.sequence ? "_sequence" : "_token") +
         (c.is_ratio ? "_is_ratio" : "");
}

// The row problem of the base case, and is_ratio's values.
struct SequenceProblem {
  RowProblem rp;
  std::vector<float> rho;
};

// MakeProblem's problem; at sequence level each sequence's old log-probs are shifted together
// so that the mean log-ratio of its counted rows (log R_b) lies a random kClipMargin or more
// from every kink (the clip bounds, delta), so no clip decision can flip on logp's error;
// rho_i in [0.2, 1.8] with some exact zeros.
SequenceProblem MakeSequenceProblem(const SequenceCase& c, const Shape& shape, DType dtype,
                                    uint64_t seed) {
  const RowCase& rc = kCases[c.base];
  SequenceProblem sp{MakeProblem(rc, shape, dtype, seed), {}};
  LossProblem& p = sp.rp.p;
  std::mt19937_64 rng(seed * 104729 + 3);
  std::uniform_real_distribution<double> uni(-1.0, 1.0);
  if (c.is_ratio) {
    for (int64_t i = 0; i < p.bt; ++i) {
      sp.rho.push_back(i % 11 == 5 ? 0.0f : static_cast<float>(1.0 + 0.8 * uni(rng)));
    }
    p.is_ratio = sp.rho.data();
  }
  if (!c.sequence) return sp;
  p.policy.importance_sampling = ImportanceSampling::kSequence;
  LogprobProblem lp;
  lp.head = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
  lp.targets = p.targets;
  lp.target_dtype = p.target_dtype;
  lp.options.temperature = p.options.temperature;
  lp.options.softcap = p.options.softcap;
  lp.options.ignore_index = p.options.ignore_index;
  LogprobReferenceOutputs lref;
  EXPECT_TRUE(LogprobReference(lp, &lref).ok());
  std::vector<double> kinks = {std::log(1.0 - rc.eps_low), std::log(1.0 + rc.eps_high)};
  if (rc.delta != 0) kinks.push_back(std::log(rc.delta));
  auto near_kink = [&](double d) {
    for (double k : kinks) {
      if (std::fabs(d - k) < kClipMargin) return true;
    }
    return false;
  };
  std::vector<float>& old = sp.rp.old_logp;  // p.old_logp views it (or is null)
  const int64_t s = p.bt / p.policy.sequences;
  for (int64_t b0 = 0; b0 < p.bt; b0 += s) {
    double sum = 0;
    int64_t n = 0;
    for (int64_t i = b0; i < b0 + s; ++i) {
      if (LoadAsInt(p.targets, p.target_dtype, i) == p.options.ignore_index) continue;
      sum += lref.logp[i] - old[i];
      ++n;
    }
    double target = 0;
    do {
      target = 0.7 * uni(rng);
    } while (near_kink(target));
    const double shift = target - (n > 0 ? sum / static_cast<double>(n) : 0.0);
    for (int64_t i = b0; i < b0 + s; ++i) old[i] = static_cast<float>(old[i] - shift);
  }
  return sp;
}

using MatrixParam = std::tuple<int, int, DType>;

class PolicySequenceMatrixTest : public CudaTest,
                                 public testing::WithParamInterface<MatrixParam> {};

TEST_P(PolicySequenceMatrixTest, MatchesReference) {
  const Shape& shape = kShapes[std::get<0>(GetParam())];
  const SequenceCase& sc = kSequenceCases[std::get<1>(GetParam())];
  const RowCase& c = kCases[sc.base];
  const DType dtype = std::get<2>(GetParam());
  SequenceProblem sp =
      MakeSequenceProblem(sc, shape, dtype, 71 + shape.v + std::get<1>(GetParam()));
  const LossProblem& p = sp.rp.p;
  const DType grad_dtype = c.grad_f32 ? DType::kF32 : dtype;
  const Tolerance tol = ToleranceFor(dtype, grad_dtype);
  const Expected e = ExpectOf(sp.rp, tol);
  RowOutputs out(p, grad_dtype, c.accumulate);
  LossStats stats;
  const absl::Status st = ValidateThenCompute(*backend_, p, out.outputs(c.kind), &stats);
  ASSERT_TRUE(st.ok()) << CaseName(sc) << ": " << st;
  if (c.chunk_rows > 0) {
    EXPECT_EQ(stats.chunk_rows, std::min(c.chunk_rows, shape.bt));
  }
  std::printf("  %s %s %s (%lld sequences):\n", shape.name, CaseName(sc).c_str(),
              std::string(DTypeName(dtype)).c_str(),
              static_cast<long long>(p.policy.sequences));
  ExpectMatches(p, e, out, c.accumulate);
}

std::string MatrixName(const testing::TestParamInfo<MatrixParam>& info) {
  return std::string(kShapes[std::get<0>(info.param)].name) + "_" +
         CaseName(kSequenceCases[std::get<1>(info.param)]) + "_" +
         std::string(DTypeName(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllCases, PolicySequenceMatrixTest,
                         testing::Combine(testing::Range(0, 3),
                                          testing::Range(0, kNumSequenceCases),
                                          testing::Values(DType::kBF16, DType::kF16,
                                                          DType::kF32)),
                         MatrixName);

// A realistic vocabulary in chunks of 96 rows over sequences of 64: chunks that cut
// sequences, so every sequence's ratio needs rows of two chunks.
TEST_F(CudaTest, PolicySequenceRealisticWidthMatchesReference) {
  for (const SequenceCase& sc : {kSequenceCases[0], kSequenceCases[7]}) {
    SequenceProblem sp = MakeSequenceProblem(sc, {"real", 256, 128, 32000}, DType::kBF16, 5);
    sp.rp.p.options.chunk_rows = 96;
    ASSERT_EQ(sp.rp.p.policy.sequences, 4);
    const RowCase& c = kCases[sc.base];
    const DType grad = c.grad_f32 ? DType::kF32 : DType::kBF16;
    const Expected e = ExpectOf(sp.rp, ToleranceFor(DType::kBF16, grad));
    RowOutputs out(sp.rp.p, grad, c.accumulate);
    const absl::Status st =
        ValidateThenCompute(*backend_, sp.rp.p, out.outputs(c.kind), nullptr);
    ASSERT_TRUE(st.ok()) << CaseName(sc) << ": " << st;
    std::printf("  real %s bf16:\n", CaseName(sc).c_str());
    ExpectMatches(sp.rp.p, e, out, c.accumulate);
  }
}

// Whether kl_cov's choice is decidable: its k-th and (k+1)-th covariances (A_i - mean A)(logp_i
// - mean logp) further apart than logp's bounds can move them (e.logp_bound, its mean for the
// mean); else the backend may choose either and the case tests nothing.
bool KlCovChoiceIsStable(const LossProblem& p, const Expected& e) {
  std::vector<int64_t> rows;
  double mean_a = 0, mean_l = 0, mean_b = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    if (LoadAsInt(p.targets, p.target_dtype, i) == p.options.ignore_index) continue;
    rows.push_back(i);
    mean_a += p.advantages[i], mean_l += e.logp[i], mean_b += e.logp_bound[i];
  }
  const double n = static_cast<double>(rows.size());
  const size_t k = std::max<size_t>(1, static_cast<size_t>(n * p.policy.kl_cov_ratio));
  if (rows.size() <= k) return true;
  mean_a /= n, mean_l /= n, mean_b /= n;
  std::vector<std::pair<double, double>> cov;  // (value, its bound)
  for (int64_t i : rows) {
    cov.push_back({(p.advantages[i] - mean_a) * (e.logp[i] - mean_l),
                   std::fabs(p.advantages[i] - mean_a) * (e.logp_bound[i] + mean_b)});
  }
  std::sort(cov.rbegin(), cov.rend());
  return cov[k - 1].first - cov[k].first > cov[k - 1].second + cov[k].second;
}

// kl_cov (verl's KL-Cov) by group, the whole call: a tenth of the tokens penalised, chunks of
// 24 rows (two passes), with and without the rollout weights; fp32 must be decidable, bf16 is
// skipped where it is not.
TEST_F(CudaTest, PolicyKlCovMatchesReference) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const bool is_ratio : {false, true}) {
      const RowCase& rc = kCases[3];  // policy_dapo, a bias: its loss type replaced below
      SequenceProblem sp = MakeSequenceProblem({3, false, is_ratio}, kShapes[2], dtype, 29);
      LossProblem& p = sp.rp.p;
      p.policy.loss_type = PolicyLossType::kKlCov;
      p.policy.kl_cov_ratio = 0.1;
      p.policy.ppo_kl_coef = 0.5f;
      p.options.chunk_rows = 24;
      const Expected e = ExpectOf(sp.rp, ToleranceFor(dtype, dtype));
      if (!KlCovChoiceIsStable(p, e)) {
        ASSERT_NE(dtype, DType::kF32) << "kl_cov's choice undecidable in fp32";
        std::printf("  kl_cov %s: the choice is undecidable, skipped\n",
                    std::string(DTypeName(dtype)).c_str());
        continue;
      }
      RowOutputs out(p, dtype, false);
      LossStats stats;
      const absl::Status st = ValidateThenCompute(*backend_, p, out.outputs(rc.kind), &stats);
      ASSERT_TRUE(st.ok()) << "kl_cov: " << st;
      EXPECT_EQ(stats.chunk_rows, 24);
      std::printf("  medium kl_cov %s%s:\n", std::string(DTypeName(dtype)).c_str(),
                  is_ratio ? " is_ratio" : "");
      ExpectMatches(p, e, out, false);
      EXPECT_GT(e.clip_fraction, 0.0);  // the penalised share
    }
  }
}

// vespo (Liger's) by sequence: each sequence's weight from its summed log-ratios, here a
// twentieth of policy_dapo's (a sequence's sum within a few units of 0, where phi is neither
// 0 nor its floor), chunks of 24 rows that cut the sequences, with and without rollout
// weights in [0.74, 1.25] (summed into the weight, every row's), the bias-corrected KL.
TEST_F(CudaTest, PolicyVespoMatchesReference) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    for (const bool is_ratio : {false, true}) {
      const RowCase& rc = kCases[3];  // policy_dapo, a bias: its loss type replaced below
      SequenceProblem sp = MakeSequenceProblem({3, false, is_ratio}, kShapes[2], dtype, 37);
      LossProblem& p = sp.rp.p;
      p.policy.loss_type = PolicyLossType::kVespo;
      p.policy.use_bias_correction_kl = true;
      p.policy.vespo_k_pos = 1.5f;
      p.policy.vespo_lambda_neg = 2.5f;
      p.options.chunk_rows = 24;
      for (float& r : sp.rho) r = 0.8f + 0.45f * (r - 0.2f) / 1.6f;  // 0 and [0.2, 1.8]: 0.74..1.25
      LogprobProblem lp;
      lp.head = HeadInputs{p.bt, p.h, p.v, p.dtype, p.x, p.w, p.bias};
      lp.targets = p.targets;
      lp.target_dtype = p.target_dtype;
      lp.options = {p.options.temperature, p.options.softcap, p.options.ignore_index};
      LogprobReferenceOutputs cur;
      ASSERT_TRUE(LogprobReference(lp, &cur).ok());
      for (int64_t i = 0; i < p.bt; ++i) {
        float& old = sp.rp.old_logp[i];
        old = static_cast<float>(cur.logp[i] - 0.05 * (cur.logp[i] - old));
      }
      const Expected e = ExpectOf(sp.rp, ToleranceFor(dtype, dtype));
      RowOutputs out(p, dtype, false);
      LossStats stats;
      const absl::Status st = ValidateThenCompute(*backend_, p, out.outputs(rc.kind), &stats);
      ASSERT_TRUE(st.ok()) << "vespo: " << st;
      EXPECT_EQ(stats.chunk_rows, 24);
      std::printf("  medium vespo %s%s:\n", std::string(DTypeName(dtype)).c_str(),
                  is_ratio ? " is_ratio" : "");
      ExpectMatches(p, e, out, false);
      EXPECT_EQ(e.clip_fraction, 0.0);  // vespo never clips
    }
  }
}

// No gradient wanted: the forward pass alone gives the loss, logp and metrics.
TEST_F(CudaTest, PolicySequenceWithoutGradientsMatchesReference) {
  const SequenceCase& sc = kSequenceCases[7];
  SequenceProblem sp = MakeSequenceProblem(sc, kShapes[2], DType::kBF16, 17);
  const Expected e = ExpectOf(sp.rp, ToleranceFor(DType::kBF16, DType::kBF16));
  RowOutputs out(sp.rp.p, DType::kBF16, false);
  LossOutputs o = out.outputs(LossKind::kPolicy);
  o.dx = nullptr;
  o.dw = nullptr;
  o.db = nullptr;
  const absl::Status st = ValidateThenCompute(*backend_, sp.rp.p, o, nullptr);
  ASSERT_TRUE(st.ok()) << CaseName(sc) << " without gradients: " << st;
  std::printf("  medium %s bf16, no gradients:\n", CaseName(sc).c_str());
  ExpectScalar("loss", e.loss, out.base.loss[0], e.loss_bound);
  ExpectRows("logp", e.logp, out.logp.data(), e.logp_bound);
  ExpectScalar("kl", e.kl, out.kl, e.kl_bound);
  const double half_ulp =
      e.clip_fraction > 0 ? std::ldexp(1.0, std::ilogb(e.clip_fraction) - 24) : 0.0;
  ExpectScalar("clip_fraction", e.clip_fraction, out.clip_fraction, half_ulp);
}

// The same request twice gives the same bits (two passes, a host step between them).
TEST_F(CudaTest, PolicySequenceSameRequestTwiceIsBitIdentical) {
  for (const SequenceCase& sc : {kSequenceCases[0], kSequenceCases[5]}) {
    SequenceProblem sp = MakeSequenceProblem(sc, kShapes[2], DType::kBF16, 9);
    sp.rp.p.options.chunk_rows = 64;
    const RowCase& c = kCases[sc.base];
    RowOutputs a(sp.rp.p, DType::kBF16, c.accumulate), b(sp.rp.p, DType::kBF16, c.accumulate);
    ASSERT_TRUE(ValidateThenCompute(*backend_, sp.rp.p, a.outputs(c.kind), nullptr).ok());
    ASSERT_TRUE(ValidateThenCompute(*backend_, sp.rp.p, b.outputs(c.kind), nullptr).ok());
    EXPECT_TRUE(BitIdentical(a.base, b.base)) << CaseName(sc);
    EXPECT_EQ(0, std::memcmp(a.logp.data(), b.logp.data(), a.logp.size() * 4)) << CaseName(sc);
    EXPECT_EQ(0, std::memcmp(&a.kl, &b.kl, 4)) << CaseName(sc);
    EXPECT_EQ(0, std::memcmp(&a.clip_fraction, &b.clip_fraction, 4)) << CaseName(sc);
  }
}

// Rows of X that arrive while the Compute runs (the forward pass waits for them; the gradient
// pass finds them on the device) give the bits of the whole X; WaitX is asked non-decreasing
// rows and dX leaves chunk by chunk, as at token level.
TEST_F(CudaTest, PolicySequenceStreamedRowsGiveTheSameBits) {
  for (const SequenceCase& sc : {kSequenceCases[0], kSequenceCases[5]}) {
    SequenceProblem sp = MakeSequenceProblem(sc, kShapes[2], DType::kBF16, 61);
    sp.rp.p.options.chunk_rows = 64;
    const RowCase& c = kCases[sc.base];
    RowOutputs want(sp.rp.p, DType::kBF16, c.accumulate);
    RowOutputs got(sp.rp.p, DType::kBF16, c.accumulate);
    ASSERT_TRUE(ValidateThenCompute(*backend_, sp.rp.p, want.outputs(c.kind), nullptr).ok());
    TrickleRows rows(sp.rp.p, TrickleRows::Spec{});
    const LossProblem streamed = rows.Streamed(sp.rp.p);
    const absl::Status st =
        ValidateThenCompute(*backend_, streamed, got.outputs(c.kind), nullptr);
    ASSERT_TRUE(st.ok()) << CaseName(sc) << ": " << st;
    EXPECT_TRUE(BitIdentical(want.base, got.base)) << CaseName(sc);
    EXPECT_EQ(0, std::memcmp(want.logp.data(), got.logp.data(), want.logp.size() * 4));
    EXPECT_EQ(0, std::memcmp(&want.kl, &got.kl, 4));
    EXPECT_EQ(0, std::memcmp(&want.clip_fraction, &got.clip_fraction, 4));
    EXPECT_TRUE(rows.CallsAreValid(sp.rp.p.bt, 5)) << CaseName(sc);  // one DxReady per chunk
  }
}

// Called directly the backend announces both; served through a plugin ABI older than 6.3, which
// carries neither input, it announces neither (the server then refuses them), nor verl's menu.
TEST_F(CudaTest, PolicySequenceAndIsRatioAreAnnouncedOnlyWhereTheyArrive) {
  EXPECT_NE(backend_->Info().loss_kinds & kPolicySequenceBit, 0u)
      << "the backend does not announce sequence-level importance sampling";
  EXPECT_NE(backend_->Info().loss_kinds & kPolicyIsRatioBit, 0u)
      << "the backend does not announce is_ratio";
  CudaBackendOptions o;
  o.plugin_abi_minor = 2;
  absl::StatusOr<std::unique_ptr<CudaBackend>> served = CudaBackend::Create(o);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ((*served)->Info().loss_kinds & (kPolicySequenceBit | kPolicyIsRatioBit), 0u)
      << "announced over the plugin ABI, which does not carry is_ratio or importance_sampling";
  const uint32_t menu =
      kPolicyKlEstimatorBit | kPolicyEntropyBit | kPolicyAggregationBit | kPolicyGpgBit;
  EXPECT_EQ(backend_->Info().loss_kinds & menu, menu) << "verl's menu not announced";
  EXPECT_EQ((*served)->Info().loss_kinds & menu, 0u) << "verl's menu announced before ABI 6.3";
  EXPECT_NE((*served)->Info().loss_kinds & LossKindBit(LossKind::kPolicy), 0u);
  EXPECT_NE(backend_->Info().loss_kinds & kPolicyGeoMeanBit, 0u) << "geo_mean not announced";
  EXPECT_NE(backend_->Info().loss_kinds & kPolicyKlCovBit, 0u) << "kl_cov not announced";
  o.plugin_abi_minor = 3;
  served = CudaBackend::Create(o);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ((*served)->Info().loss_kinds & menu, menu) << "verl's menu not announced at ABI 6.3";
  EXPECT_EQ((*served)->Info().loss_kinds & (kPolicyGeoMeanBit | kPolicyKlCovBit), 0u)
      << "geo_mean or kl_cov announced before ABI 6.4";
  EXPECT_NE(backend_->Info().loss_kinds & kPolicyVespoBit, 0u) << "vespo not announced";
  o.plugin_abi_minor = 4;
  served = CudaBackend::Create(o);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ((*served)->Info().loss_kinds & (kPolicyGeoMeanBit | kPolicyKlCovBit),
            kPolicyGeoMeanBit | kPolicyKlCovBit);
  EXPECT_EQ((*served)->Info().loss_kinds & kPolicyVespoBit, 0u) << "vespo announced before 6.5";
  EXPECT_NE(backend_->Info().loss_kinds & kPolicyCispoClampBit, 0u) << "cispo_clamp not announced";
  o.plugin_abi_minor = 5;
  served = CudaBackend::Create(o);
  ASSERT_TRUE(served.ok()) << served.status();
  EXPECT_EQ((*served)->Info().loss_kinds & (kPolicyVespoBit | kPolicyCispoClampBit),
            kPolicyVespoBit)
      << "vespo not announced at 6.5, or cispo_clamp before 6.6";
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
