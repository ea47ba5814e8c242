// The one validation of a loss problem: a valid problem passes, and each rule refuses with
// INVALID_ARGUMENT and the message a client reads (the option and target ones) or one naming
// the field. The option rules come in the order the engine reports them.
#include "core/loss_problem_check.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

// A valid (BT=4, H=3, V=5) fp32 problem over this object's buffers.
struct Valid {
  std::vector<float> x = std::vector<float>(12, 0.5f), w = std::vector<float>(15, -0.25f);
  std::vector<float> bias = std::vector<float>(5, 0.1f);
  std::vector<int64_t> targets = {0, 4, -100, 2};
  LossProblem problem() const {
    LossProblem p;
    p.bt = 4;
    p.h = 3;
    p.v = 5;
    p.dtype = DType::kF32;
    p.x = x.data();
    p.w = w.data();
    p.targets = targets.data();
    return p;
  }
};

void ExpectRefused(const absl::Status& s, const std::string& message) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), message);
}

TEST(LossProblemCheckTest, AValidProblemPasses) {
  Valid v;
  LossProblem p = v.problem();
  LossOutputs out;
  out.grad_dtype = DType::kF32;
  EXPECT_TRUE(ValidateLossProblem(p, out).ok());
  p.bias = v.bias.data();
  out.db = &v.bias[0];
  EXPECT_TRUE(ValidateLossProblem(p, out).ok());
  p.bt = 0;  // no rows: x and targets may be null
  p.x = nullptr;
  p.targets = nullptr;
  EXPECT_TRUE(ValidateLossProblem(p, out).ok());
}

TEST(LossProblemCheckTest, OptionsAreRefusedWithTheMessagesClientsRead) {
  LossOptions o;
  EXPECT_TRUE(CheckLossOptions(o, false).ok());
  o.reduction = static_cast<Reduction>(7);
  ExpectRefused(CheckLossOptions(o, false), "options.reduction 7 is unknown");
  o = LossOptions();
  ExpectRefused(CheckLossOptions(o, true),
                "grad_output is only accepted with reduction none (use options.grad_scale "
                "for mean and sum)");
  o.reduction = Reduction::kNone;
  EXPECT_TRUE(CheckLossOptions(o, true).ok());
  o.label_smoothing = 1.5f;
  ExpectRefused(CheckLossOptions(o, true), "options.label_smoothing must be in [0, 1], got 1.5");
  o.label_smoothing = std::nanf("");
  EXPECT_EQ(CheckOptionRanges(o).code(), absl::StatusCode::kInvalidArgument);
  o = LossOptions();
  o.z_loss_scale = std::numeric_limits<float>::infinity();
  ExpectRefused(CheckOptionRanges(o),
                "options.lse_square_scale must be finite and >= 0, got inf");
  o = LossOptions();
  o.softcap = -2.0f;
  ExpectRefused(CheckOptionRanges(o),
                "options.softcap must be finite and >= 0 (0 = off), got -2");
  o = LossOptions();
  o.grad_scale = std::numeric_limits<float>::infinity();
  ExpectRefused(CheckOptionRanges(o), "options.grad_scale must be finite, got inf");
  o = LossOptions();
  o.chunk_rows = -1;
  ExpectRefused(CheckLossOptions(o, false),
                "options.chunk_rows must be >= 0 (0 = automatic), got -1");
  // The order: an unknown reduction is reported before a bad range, a range before chunk_rows.
  o.label_smoothing = 2.0f;
  ExpectRefused(CheckLossOptions(o, false), "options.label_smoothing must be in [0, 1], got 2");
  o.reduction = static_cast<Reduction>(9);
  ExpectRefused(CheckLossOptions(o, false), "options.reduction 9 is unknown");
}

TEST(LossProblemCheckTest, TargetsOutsideTheVocabularyAreRefusedUnlessIgnored) {
  const std::vector<int32_t> t32 = {4, -7, 5};
  EXPECT_TRUE(CheckTargets(t32.data(), DType::kI32, 1, 5, -100).ok());
  ExpectRefused(CheckTargets(t32.data(), DType::kI32, 3, 5, -100),
                "targets[1] = -7 is outside [0, V=5) and is not ignore_index (-100)");
  EXPECT_TRUE(CheckTargets(t32.data(), DType::kI32, 2, 5, -7).ok());
  ExpectRefused(CheckTargets(t32.data(), DType::kI32, 3, 5, -7),
                "targets[2] = 5 is outside [0, V=5) and is not ignore_index (-7)");
  Valid v;
  v.targets[3] = 5;
  ExpectRefused(ValidateLossInputs(v.problem()),
                "targets[3] = 5 is outside [0, V=5) and is not ignore_index (-100)");
}

TEST(LossProblemCheckTest, EachInputRuleRefusesNamingItsField) {
  Valid v;
  LossProblem p = v.problem();
  p.h = 0;
  ExpectRefused(ValidateLossInputs(p),
                "loss problem: shape must have bt >= 0, h > 0, v > 0; got bt=4 h=0 v=5");
  p = v.problem();
  p.dtype = DType::kI32;
  ExpectRefused(ValidateLossInputs(p), "loss problem: dtype must be bf16, fp16 or fp32; got int32");
  p = v.problem();
  p.target_dtype = DType::kF32;
  ExpectRefused(ValidateLossInputs(p),
                "loss problem: target_dtype must be int32 or int64; got fp32");
  p = v.problem();
  p.targets = nullptr;
  ExpectRefused(ValidateLossInputs(p), "loss problem: x, w and targets must be non-null");
  p = v.problem();
  p.w_memory = static_cast<Memory>(3);
  ExpectRefused(ValidateLossInputs(p), "loss problem: w_memory 3 is unknown");
  p = v.problem();
  p.options.softcap = -1.0f;
  ExpectRefused(ValidateLossInputs(p), "options.softcap must be finite and >= 0 (0 = off), got -1");
  const float go[4] = {1, 1, 1, 1};
  p = v.problem();
  p.grad_output = go;  // with reduction mean
  EXPECT_EQ(ValidateLossInputs(p).code(), absl::StatusCode::kInvalidArgument);
  p.options.reduction = Reduction::kNone;
  EXPECT_TRUE(ValidateLossInputs(p).ok());
}

TEST(LossProblemCheckTest, EachOutputRuleRefusesNamingItsField) {
  Valid v;
  const LossProblem p = v.problem();
  LossOutputs out;
  out.grad_dtype = DType::kF16;  // fp32 input: fp16 gradients are neither
  ExpectRefused(ValidateLossOutputs(p, out),
                "loss problem: grad_dtype must be fp32 or the input dtype fp32; got fp16");
  out.grad_dtype = DType::kF32;
  float db[5];
  out.db_accum = db;  // no bias
  ExpectRefused(ValidateLossOutputs(p, out),
                "loss problem: db requested but the problem has no bias");
  out.db_accum = nullptr;
  out.accum_memory = static_cast<Memory>(2);
  ExpectRefused(ValidateLossOutputs(p, out), "loss problem: accum_memory 2 is unknown");
  EXPECT_EQ(ValidateLossProblem(p, out).code(), absl::StatusCode::kInvalidArgument);
}

#ifndef NDEBUG
TEST(LossProblemCheckDeathTest, TheDebugCheckAbortsOnAnInvalidProblemNamingTheCaller) {
  Valid v;
  LossProblem p = v.problem();
  LOSSD_DCHECK_VALID_PROBLEM(p, nullptr, "test backend");  // valid: goes on
  p.v = 0;
  EXPECT_DEATH(LOSSD_DCHECK_VALID_PROBLEM(p, nullptr, "test backend"),
               "test backend was handed a problem that was never validated: .*v=0");
}
#endif

}  // namespace
}  // namespace lossd
