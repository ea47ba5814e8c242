// SPDX-License-Identifier: Apache-2.0
// GPU tests of the CUDA backend's logprob, policy and distill loss kinds against the float64
// references (row_loss_test_cases.h says how they are bounded): every case over tiny, odd and
// medium shapes in bf16, fp16 and fp32, outputs poisoned before each run; a realistic
// vocabulary; one wider than a block's segment; a bit-identical rerun. Each comparison prints its largest errors.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <tuple>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/cuda/row_loss_test_cases.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {
namespace {

using MatrixParam = std::tuple<int, int, DType>;

class RowLossMatrixTest : public CudaTest, public testing::WithParamInterface<MatrixParam> {};

TEST_P(RowLossMatrixTest, MatchesReference) {
  const Shape& shape = kShapes[std::get<0>(GetParam())];
  const RowCase& c = kCases[std::get<1>(GetParam())];
  const DType dtype = std::get<2>(GetParam());
  ASSERT_NE(backend_->Info().loss_kinds & LossKindBit(c.kind), 0u);
  RowProblem rp = MakeProblem(c, shape, dtype, 31 + shape.v + std::get<1>(GetParam()));
  const LossProblem& p = rp.p;
  const DType grad_dtype = c.grad_f32 ? DType::kF32 : dtype;
  const Tolerance tol = ToleranceFor(dtype, grad_dtype);
  const Expected e = ExpectOf(rp, tol);
  RowOutputs out(p, grad_dtype, c.accumulate);
  LossStats stats;
  const absl::Status st = ValidateThenCompute(*backend_, p, out.outputs(c.kind), &stats);
  if (c.no_targets && absl::IsInvalidArgument(st) && p.targets == nullptr) {
    GTEST_SKIP() << "this build's validation refuses distill without targets: " << st;
  }
  ASSERT_TRUE(st.ok()) << st;
  if (c.chunk_rows > 0) {
    EXPECT_EQ(stats.chunk_rows, std::min(c.chunk_rows, shape.bt));
  }
  std::printf("  %s %s %s:\n", shape.name, c.name, std::string(DTypeName(dtype)).c_str());
  ExpectMatches(p, e, out, c.accumulate);
}

std::string MatrixName(const testing::TestParamInfo<MatrixParam>& info) {
  return std::string(kShapes[std::get<0>(info.param)].name) + "_" +
         kCases[std::get<1>(info.param)].name + "_" +
         std::string(DTypeName(std::get<2>(info.param)));
}

INSTANTIATE_TEST_SUITE_P(AllCases, RowLossMatrixTest,
                         testing::Combine(testing::Range(0, 3), testing::Range(0, kNumCases),
                                          testing::Values(DType::kBF16, DType::kF16,
                                                          DType::kF32)),
                         MatrixName);

// A realistic vocabulary, several chunks: one case of each kind in bf16.
TEST_F(CudaTest, RealisticWidthMatchesReference) {
  for (int k : {1, 3, 8}) {
    const RowCase& c = kCases[k];
    RowProblem rp = MakeProblem(c, {"real", 256, 128, 32000}, DType::kBF16, 5);
    rp.p.options.chunk_rows = 96;
    const Tolerance tol = ToleranceFor(DType::kBF16, DType::kBF16);
    const Expected e = ExpectOf(rp, tol);
    RowOutputs out(rp.p, DType::kBF16, false);
    ASSERT_TRUE(ValidateThenCompute(*backend_, rp.p, out.outputs(c.kind), nullptr).ok());
    std::printf("  real %s bf16:\n", c.name);
    ExpectMatches(rp.p, e, out, false);
  }
}

// A vocabulary wider than one block's segment: the one-read kernels split each row over a
// cluster of blocks (4 for logprob and policy, 7 for distill) where the GPU has clusters, so
// the exchange of the blocks' statistics is checked against the references too. One case of
// each kind in bf16, with a bias and (logprob) a softcap and the entropy's gradient.
TEST_F(CudaTest, WideVocabularyMatchesReference) {
  for (int k : {1, 3, 8, 19}) {  // 19: distill's hard-label term (the two-pass kernel)
    const RowCase& c = kCases[k];
    RowProblem rp = MakeProblem(c, {"wide", 48, 64, 100000}, DType::kBF16, 13);
    rp.p.options.chunk_rows = 32;
    const Tolerance tol = ToleranceFor(DType::kBF16, DType::kBF16);
    const Expected e = ExpectOf(rp, tol);
    RowOutputs out(rp.p, DType::kBF16, false);
    ASSERT_TRUE(ValidateThenCompute(*backend_, rp.p, out.outputs(c.kind), nullptr).ok());
    std::printf("  wide %s bf16:\n", c.name);
    ExpectMatches(rp.p, e, out, false);
  }
}

// Two identical requests of each kind, every output byte for byte: rows of one block, and rows
// split over a cluster of blocks (the wide vocabulary).
TEST_F(CudaTest, RowLossSameRequestTwiceIsBitIdentical) {
  for (const Shape& shape : {Shape{"d", 300, 96, 1000}, Shape{"dwide", 40, 48, 100000}}) {
    for (int k : {1, 3, 8}) {
      const RowCase& c = kCases[k];
      RowProblem rp = MakeProblem(c, shape, DType::kBF16, 9);
      RowOutputs a(rp.p, DType::kBF16, false), b(rp.p, DType::kBF16, false);
      ASSERT_TRUE(ValidateThenCompute(*backend_, rp.p, a.outputs(c.kind), nullptr).ok());
      ASSERT_TRUE(ValidateThenCompute(*backend_, rp.p, b.outputs(c.kind), nullptr).ok());
      EXPECT_TRUE(BitIdentical(a.base, b.base)) << shape.name << " " << c.name;
      EXPECT_EQ(0, std::memcmp(a.logp.data(), b.logp.data(), a.logp.size() * 4)) << c.name;
      EXPECT_EQ(0, std::memcmp(a.entropy.data(), b.entropy.data(), a.entropy.size() * 4));
      EXPECT_EQ(0, std::memcmp(&a.kl, &b.kl, 4));
      EXPECT_EQ(0, std::memcmp(&a.clip_fraction, &b.clip_fraction, 4));
    }
  }
}

TEST_F(CudaTest, EveryKindIsComputed) {
  for (LossKind k : {LossKind::kCrossEntropy, LossKind::kLogprob, LossKind::kPolicy,
                     LossKind::kDistill}) {
    EXPECT_NE(backend_->Info().loss_kinds & LossKindBit(k), 0u) << LossKindName(k);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
