// SPDX-License-Identifier: Apache-2.0
// Edge cases of the CPU backend's loss kinds beyond cross-entropy: every row ignored, no rows
// at all, and the kinds listed in BackendInfo.
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/cpu/kind_test_util.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

// A random problem of `kind` whose rows are all ignored (ignore_fraction 1), with every input
// the kind takes; owns its buffers.
struct KindProblem {
  KindProblem(LossKind kind, int64_t bt, DType dtype, double ignore, double logit_scale = 2)
      : random(RandomProblem::Make([&] {
          RandomProblemSpec spec = ShapeSpec(bt, 24, 70, dtype);
          spec.bias = true;
          spec.ignore_fraction = ignore;
          spec.logit_scale = logit_scale;
          spec.seed = 41 + bt;
          return spec;
        }())) {
    per_token = RandomFloats(std::max<int64_t>(bt, 1), -1.0f, 1.0f, 42);
    teacher_x = RandomStored(std::max<int64_t>(bt, 1) * 13, 1.0, dtype, 43);
    teacher_w = RandomStored(70 * 13, logit_scale / std::sqrt(13.0), dtype, 44);
    problem = random.problem();
    problem.kind = kind;
    problem.options.temperature = 0.9f;
    if (kind == LossKind::kLogprob) problem.dlogp = problem.dentropy = per_token.data();
    if (kind == LossKind::kPolicy) {
      problem.advantages = problem.old_logp = problem.ref_logp = per_token.data();
    }
    if (kind == LossKind::kDistill) {
      problem.teacher_h = 13;
      problem.teacher_x = teacher_x.data();
      problem.teacher_w = teacher_w.data();
    }
  }
  RandomProblem random;
  std::vector<float> per_token;
  std::vector<uint8_t> teacher_x, teacher_w;
  LossProblem problem;
};

KindOutputs OutputsFor(const LossProblem& p) {
  KindOutputs out(p, DType::kF32);
  out.want_logp = p.kind != LossKind::kDistill;
  out.want_entropy = p.kind == LossKind::kLogprob;
  return out;
}

bool AllZero(const std::vector<uint8_t>& fp32_bytes) {
  for (size_t k = 0; k + 4 <= fp32_bytes.size(); k += 4) {
    if (LoadAsFloat(fp32_bytes.data(), DType::kF32, k / 4) != 0.0f) return false;
  }
  return true;
}

const LossKind kKinds[] = {LossKind::kLogprob, LossKind::kPolicy, LossKind::kDistill};

TEST(CpuKindsEdgeTest, EveryRowIgnoredGivesZerosNotNaN) {
  for (LossKind kind : kKinds) {
    const KindProblem k(kind, 9, DType::kBF16, 1.0);
    KindOutputs got = OutputsFor(k.problem);
    const absl::Status st = NewCpuBackend(2)->Compute(k.problem, got.outputs(), nullptr);
    ASSERT_TRUE(st.ok()) << LossKindName(kind) << ": " << st;
    EXPECT_EQ(got.tokens, 0) << LossKindName(kind);
    EXPECT_EQ(got.loss[0], 0.0f) << LossKindName(kind);
    EXPECT_EQ(got.kl, 0.0f) << LossKindName(kind);
    EXPECT_EQ(got.clip_fraction, 0.0f) << LossKindName(kind);
    EXPECT_EQ(got.accuracy, 0.0f) << LossKindName(kind);
    for (int64_t i = 0; i < 9; ++i) {
      EXPECT_TRUE(std::isfinite(got.lse[i])) << LossKindName(kind) << " lse[" << i << "]";
      if (got.want_logp) EXPECT_EQ(got.logp[i], 0.0f) << LossKindName(kind);
      if (got.want_entropy) EXPECT_EQ(got.entropy[i], 0.0f) << LossKindName(kind);
    }
    EXPECT_TRUE(AllZero(got.dx)) << LossKindName(kind);
    EXPECT_TRUE(AllZero(got.dw)) << LossKindName(kind);
    EXPECT_TRUE(AllZero(got.db)) << LossKindName(kind);
  }
}

TEST(CpuKindsEdgeTest, NoRowsGiveZeroGradients) {
  for (LossKind kind : kKinds) {
    KindProblem k(kind, 0, DType::kF16, 0.0);
    k.problem.x = k.problem.targets = nullptr;
    if (kind == LossKind::kPolicy) k.problem.advantages = nullptr;
    if (kind == LossKind::kDistill) k.problem.teacher_x = nullptr;
    KindOutputs got = OutputsFor(k.problem);
    const absl::Status st = NewCpuBackend(1)->Compute(k.problem, got.outputs(), nullptr);
    ASSERT_TRUE(st.ok()) << LossKindName(kind) << ": " << st;
    EXPECT_EQ(got.tokens, 0);
    EXPECT_EQ(got.loss[0], 0.0f);
    EXPECT_TRUE(AllZero(got.dw)) << LossKindName(kind);
    EXPECT_TRUE(AllZero(got.db)) << LossKindName(kind);
  }
}

// Logits of about 1e4 (bf16 holds them; exp of them overflows fp32): every output finite,
// log-probs <= 0 (up to fp32 rounding of lse), entropies >= 0. Policy without old and
// reference log-probs: log-probs near -1e4 against ones in [-1, 1] overflow the ratio and the
// KL's exp in any precision (the reference's too).
TEST(CpuKindsEdgeTest, HugeLogitsStayFinite) {
  for (LossKind kind : kKinds) {
    KindProblem k(kind, 33, DType::kBF16, 0.1, 1e4);
    k.problem.old_logp = k.problem.ref_logp = nullptr;
    KindOutputs got = OutputsFor(k.problem);
    LossStats stats;
    const absl::Status st = NewCpuBackend(2)->Compute(k.problem, got.outputs(), &stats);
    ASSERT_TRUE(st.ok()) << LossKindName(kind) << ": " << st;
    EXPECT_EQ(stats.nonfinite, 0u) << LossKindName(kind);
    EXPECT_TRUE(std::isfinite(got.loss[0])) << LossKindName(kind);
    for (int64_t i = 0; i < 33; ++i) {
      EXPECT_TRUE(std::isfinite(got.lse[i])) << LossKindName(kind) << " lse[" << i << "]";
      EXPECT_GT(std::abs(got.lse[i]), 10.0f) << LossKindName(kind) << " lse[" << i << "]";
      if (got.want_logp) {
        EXPECT_LE(got.logp[i], 1e-7f * std::abs(got.lse[i])) << LossKindName(kind) << " " << i;
      }
      if (got.want_entropy) {
        EXPECT_GE(got.entropy[i], 0.0f) << i;
        EXPECT_TRUE(std::isfinite(got.entropy[i])) << i;
      }
    }
  }
}

TEST(CpuKindsEdgeTest, InfoListsEveryKindComputed) {
  const BackendInfo info = NewCpuBackend(1)->Info();
  EXPECT_EQ(info.loss_kinds, LossKindBit(LossKind::kCrossEntropy) |
                                 LossKindBit(LossKind::kLogprob) | LossKindBit(LossKind::kPolicy) |
                                 LossKindBit(LossKind::kDistill) | kPolicySequenceBit |
                                 kPolicyIsRatioBit | kDistillWeightsBit | kPolicyKlEstimatorBit |
                                 kPolicyEntropyBit | kPolicyAggregationBit | kPolicyGpgBit |
                                 kPolicyGeoMeanBit | kPolicyKlCovBit | kPolicyVespoBit |
                                 kPolicyCispoClampBit | kDistillTopkBit);
}

}  // namespace
}  // namespace lossd
