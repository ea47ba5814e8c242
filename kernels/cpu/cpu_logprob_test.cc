// SPDX-License-Identifier: Apache-2.0
// The CPU backend's logprob kind against its float64 reference (kernels/cpu/logprob_reference.h)
// over shapes x dtypes x options, with the tolerance table below; determinism, chunking, the
// overlapped path, accumulators, and what the backend refuses.
#include <cmath>
#include <cstdint>
#include <memory>
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
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/kind_test_util.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

struct Shape {
  const char* name;
  int64_t bt, h, v;
};
const Shape kShapes[] = {
    {"tiny", 2, 3, 5}, {"bt1", 1, 16, 37}, {"odd", 47, 31, 123}, {"medium", 256, 128, 1000}};

struct Case {
  const char* name;
  float temperature = 1, cap = 0, grad_scale = 1;
  bool bias = false, dlogp = true, dentropy = false, grad_f32 = false, accumulate = false;
  bool want_entropy = true;
  double ignore = 0;
  int64_t chunk_rows = 0;
  DType target_dtype = DType::kI64;
};

std::vector<Case> Cases() {
  std::vector<Case> cs;
  Case c;
  c.name = "dlogp";
  cs.push_back(c);
  c = Case();
  c.name = "entropy_t07";
  c.dentropy = true;
  c.temperature = 0.7f;
  c.ignore = 0.2;
  cs.push_back(c);
  c = Case();
  c.name = "only_dentropy";
  c.dlogp = false;
  c.dentropy = true;
  cs.push_back(c);
  c = Case();
  c.name = "softcap_t13_bias";
  c.cap = 5;
  c.temperature = 1.3f;
  c.bias = c.dentropy = true;
  c.ignore = 0.2;
  c.target_dtype = DType::kI32;
  cs.push_back(c);
  c = Case();
  c.name = "forward_only";  // no upstream gradient: logp and entropy, zero gradients
  c.dlogp = false;
  c.ignore = 0.1;
  cs.push_back(c);
  c = Case();
  c.name = "scaled_f32_grads";
  c.grad_scale = 0.37f;
  c.dentropy = c.grad_f32 = true;
  c.temperature = 2.0f;
  cs.push_back(c);
  c = Case();
  c.name = "accumulate_chunked";
  c.bias = c.dentropy = c.accumulate = true;
  c.chunk_rows = 7;
  c.ignore = 0.1;
  c.want_entropy = false;
  cs.push_back(c);
  return cs;
}

// One random logprob problem and its reference; owns every buffer.
struct LogprobSetup {
  LogprobSetup(const Shape& s, DType dtype, const Case& c, uint64_t seed)
      : random(RandomProblem::Make(Spec(s, dtype, c, seed))) {
    if (c.dlogp) dlogp = RandomFloats(s.bt, -1.0f, 1.0f, seed + 1);
    if (c.dentropy) dentropy = RandomFloats(s.bt, -0.5f, 0.5f, seed + 2);
    problem = random.problem();
    problem.kind = LossKind::kLogprob;
    problem.options.temperature = c.temperature;
    problem.options.grad_scale = c.grad_scale;
    problem.options.chunk_rows = c.chunk_rows;
    problem.dlogp = dlogp.empty() ? nullptr : dlogp.data();
    problem.dentropy = dentropy.empty() ? nullptr : dentropy.data();
    head = HeadInputs{s.bt, s.h, s.v, dtype, problem.x, problem.w, problem.bias};
    LogprobProblem lp;
    lp.head = head;
    lp.targets = problem.targets;
    lp.target_dtype = problem.target_dtype;
    lp.dlogp = problem.dlogp;
    lp.dentropy = problem.dentropy;
    lp.options.temperature = c.temperature;
    lp.options.softcap = c.cap;
    lp.options.ignore_index = problem.options.ignore_index;
    status = LogprobReference(lp, &ref);
    logits = ComputeRawLogits(head);
  }
  static RandomProblemSpec Spec(const Shape& s, DType dtype, const Case& c, uint64_t seed) {
    RandomProblemSpec spec = HeadSpec(s.bt, s.h, s.v, dtype, seed);
    spec.target_dtype = c.target_dtype;
    spec.bias = c.bias;
    spec.options.softcap = c.cap;
    spec.ignore_fraction = c.ignore;
    return spec;
  }
  RandomProblem random;
  std::vector<float> dlogp, dentropy;
  LossProblem problem;
  HeadInputs head;
  LogprobReferenceOutputs ref;
  absl::Status status;
  RawLogits logits;
};

// Every output against the reference. Tolerances, first order in the stored logits' rounding
// (relative u on the raw logit, |du_ij| <= u a_i with a_i = max_j |u_ij|, scaled by at most 1/T
// through the softcap and the temperature), 4x margin, plus fp32 arithmetic 1e-5 (1 + |ref|):
//   lse_i, logp_i:  |d| <= 2 u a_i / T                  -> 4 u a_i / T
//   H_i:            |d| <= u a_i / T sum_j p_j |log p_j + H| <= 2 H u a_i / T
//                                                        -> 4 u a_i / T (1 + 2 H)
//   loss F:         sum_i |grad_scale| (|dlogp_i| bound(logp_i) + |dentropy_i| bound(H_i))
//   gradients:      relative norm GradientTolerance(g_rel = 2 u rms(a) / T)
::testing::AssertionResult MatchesLogprobReference(const LogprobSetup& s, const Case& c,
                                                   const KindOutputs& got) {
  const LossProblem& p = s.problem;
  const LogprobReferenceOutputs& ref = s.ref;
  const double u = UnitRoundoff(p.dtype), inv_t = 1.0 / c.temperature;
  std::string err;
  if (got.tokens != ref.tokens)
    absl::StrAppend(&err, "tokens ", got.tokens, " vs ", ref.tokens, "\n");
  double f_ref = 0, f_bound = 0;
  int64_t correct = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const double a = 4 * u * s.logits.abs_max[i] * inv_t;
    auto check = [&](const char* what, double g, double r, double bound) {
      if (!(std::abs(g - r) <= bound + 1e-5 * (1 + std::abs(r)))) {
        absl::StrAppend(&err, what, "[", i, "] = ", g, " vs ", r, " (bound ", bound, ")\n");
      }
    };
    check("lse", got.lse[i], ref.lse[i], a);
    if (!ArgmaxAcceptable(s.logits, p.v, i, got.predictions[i], u)) {
      absl::StrAppend(&err, "predictions[", i, "] = ", got.predictions[i], "\n");
    }
    const int64_t t = LoadAsInt(p.targets, p.target_dtype, i);
    const bool counted = t != p.options.ignore_index;
    const double hb = a * (1 + 2 * ref.entropy[i]);
    check("logp", got.logp[i], ref.logp[i], counted ? a : 0.0);
    if (c.want_entropy) check("entropy", got.entropy[i], ref.entropy[i], counted ? hb : 0.0);
    if (!counted) continue;
    correct += got.predictions[i] == t ? 1 : 0;
    const double dl = p.dlogp != nullptr ? p.dlogp[i] : 0.0;
    const double dh = p.dentropy != nullptr ? p.dentropy[i] : 0.0;
    f_ref += c.grad_scale * (dl * ref.logp[i] + dh * ref.entropy[i]);
    f_bound += std::abs(c.grad_scale) * (std::abs(dl) * a + std::abs(dh) * hb);
  }
  if (!(std::abs(got.loss[0] - f_ref) <= f_bound + 1e-5 * (1 + std::abs(f_ref)))) {
    absl::StrAppend(&err, "loss ", got.loss[0], " vs ", f_ref, " (bound ", f_bound, ")\n");
  }
  const double acc = ref.tokens != 0 ? static_cast<double>(correct) / ref.tokens : 0.0;
  if (!(std::abs(got.accuracy - acc) <= 1e-7))
    absl::StrAppend(&err, "accuracy ", got.accuracy, "\n");
  std::vector<double> abs_max = s.logits.abs_max;
  const double tol = GradientTolerance(p, got.grad_dtype, 2 * u * Rms(abs_max) * inv_t);
  return KindVerdict(err, GradientsMatch(p, got, ref.grad, c.grad_scale, tol));
}

using Param = std::tuple<Shape, DType, Case>;
class CpuLogprobMatrixTest : public ::testing::TestWithParam<Param> {};

TEST_P(CpuLogprobMatrixTest, MatchesReference) {
  const auto& [shape, dtype, c] = GetParam();
  const LogprobSetup s(shape, dtype, c, 3000 + shape.bt * 7 + static_cast<int>(dtype));
  ASSERT_TRUE(s.status.ok()) << s.status;
  KindOutputs got(s.problem, c.grad_f32 ? DType::kF32 : dtype, c.accumulate);
  got.want_entropy = c.want_entropy;
  LossStats stats;
  ASSERT_NO_FATAL_FAILURE(ExpectComputeMatches(
      s.problem, got, [&](const KindOutputs& g) { return MatchesLogprobReference(s, c, g); },
      &stats));
  EXPECT_EQ(stats.nonfinite, 0u);
}

INSTANTIATE_TEST_SUITE_P(Matrix, CpuLogprobMatrixTest,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::Values(DType::kBF16, DType::kF16,
                                                              DType::kF32),
                                            ::testing::ValuesIn(Cases())),
                         MatrixCaseName<Param>);

Case EntropyCase() {
  Case c;
  c.name = "entropy";
  c.dentropy = c.bias = true;
  c.temperature = 0.8f;
  c.ignore = 0.2;
  return c;
}

TEST(CpuLogprobTest, BitIdenticalAtAnyThreadCountAndOnRerun) {
  const Case c = EntropyCase();
  const LogprobSetup s(kShapes[3], DType::kBF16, c, 11);
  ASSERT_TRUE(s.status.ok());
  ExpectBitIdenticalAcrossThreads(
      s.problem, [](const LossProblem& p) { return KindOutputs(p, DType::kBF16); });
}

TEST(CpuLogprobTest, StreamedRowsGiveTheWholeProblemsBits) {
  Case c = EntropyCase();
  c.chunk_rows = 40;
  const LogprobSetup s(kShapes[3], DType::kF16, c, 12);
  ASSERT_TRUE(s.status.ok());
  ExpectStreamedRowsIdentical(
      s.problem, [](const LossProblem& p) { return KindOutputs(p, DType::kF16); }, 7);
}

TEST(CpuLogprobTest, InfoListsTheKindsComputed) {
  const BackendInfo info = NewCpuBackend(1)->Info();
  EXPECT_NE(info.loss_kinds & LossKindBit(LossKind::kCrossEntropy), 0u);
  EXPECT_NE(info.loss_kinds & LossKindBit(LossKind::kLogprob), 0u);
}

// What the backend refuses for logprob, each naming the field.
TEST(CpuLogprobTest, RefusesWhatItCannotCompute) {
  const LogprobSetup s(kShapes[0], DType::kF32, EntropyCase(), 13);
  ASSERT_TRUE(s.status.ok());
  const std::vector<float> cw(s.problem.v, 1.0f), adv(s.problem.bt, 0.5f);
  const std::vector<Refusal> bad = {
      {"class_weights", [&](LossProblem& p) { p.class_weights = cw.data(); }},
      {"grad_output", [&](LossProblem& p) { p.grad_output = adv.data(); }},
      {"options.reduction", [](LossProblem& p) { p.options.reduction = Reduction::kSum; }},
      {"options.label_smoothing", [](LossProblem& p) { p.options.label_smoothing = 0.1f; }},
      {"options.lse_square_scale", [](LossProblem& p) { p.options.z_loss_scale = 1e-3f; }},
      {"options.token_scaling", [](LossProblem& p) { p.options.token_scaling = true; }},
      {"options.temperature", [](LossProblem& p) { p.options.temperature = 0.0f; }},
      {"options.temperature", [](LossProblem& p) { p.options.temperature = NAN; }},
      {"advantages", [&](LossProblem& p) { p.advantages = adv.data(); }},
      {"teacher_x", [&](LossProblem& p) { p.teacher_x = adv.data(); }},
      {"kind 9", [](LossProblem& p) { p.kind = static_cast<LossKind>(9); }},
      {"options.temperature 2",
       [](LossProblem& p) {
         p.kind = LossKind::kCrossEntropy;
         p.dlogp = p.dentropy = nullptr;
         p.options.temperature = 2.0f;
       }},
  };
  ExpectRefusals(s.problem, bad, [](const LossProblem& p) { return KindOutputs(p, DType::kF32); });
}

}  // namespace
}  // namespace lossd
