// SPDX-License-Identifier: Apache-2.0
// The CPU backend's distill kind against its float64 reference (kernels/cpu/distill_reference.h)
// over shapes x dtypes x options, with the tolerance table below; determinism, the teacher's
// own hidden size, and what the backend refuses.
#include <algorithm>
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
#include "kernels/cpu/distill_reference.h"
#include "kernels/cpu/reference_head.h"
#include "testing/cpu/kind_test_util.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

struct Shape {
  const char* name;
  int64_t bt, h, teacher_h, v;
};
const Shape kShapes[] = {{"tiny", 2, 3, 4, 5},
                         {"bt1", 1, 16, 9, 37},
                         {"odd", 47, 31, 45, 123},
                         {"medium", 256, 128, 96, 1000}};

struct Case {
  const char* name;
  float jsd_beta = 0.5f, temperature = 1, grad_scale = 1;
  float w_hard = 0, w_soft = 1;  // LigerFusedLinearJSDLoss's weight_hard_loss / _soft_loss
  bool labels = true, bias = false, teacher_bias = false, grad_f32 = false, accumulate = false;
  double ignore = 0.1;
  int64_t chunk_rows = 0;
  DType target_dtype = DType::kI64;
};

std::vector<Case> Cases() {
  std::vector<Case> cs;
  Case c;
  c.name = "jsd";
  cs.push_back(c);
  c = Case();
  c.name = "forward_kl";
  c.jsd_beta = 0;
  cs.push_back(c);
  c = Case();
  c.name = "reverse_kl_t2_biases";
  c.jsd_beta = 1;
  c.temperature = 2;
  c.bias = c.teacher_bias = true;
  cs.push_back(c);
  c = Case();
  c.name = "beta03_no_labels";
  c.jsd_beta = 0.3f;
  c.labels = false;
  cs.push_back(c);
  c = Case();
  c.name = "ignore_i32_t07";
  c.ignore = 0.3;
  c.temperature = 0.7f;
  c.target_dtype = DType::kI32;
  cs.push_back(c);
  c = Case();
  c.name = "accumulate_chunked_f32";
  c.accumulate = c.grad_f32 = c.bias = true;
  c.grad_scale = 0.7f;
  c.chunk_rows = 11;
  cs.push_back(c);
  // The hard-label term (its cross-entropy at temperature 1 whatever T).
  c = Case();
  c.name = "hard_jsd";
  c.w_hard = c.w_soft = 0.5f;
  cs.push_back(c);
  c = Case();
  c.name = "hard_only_t2_bias";
  c.w_hard = 1;
  c.w_soft = 0;
  c.temperature = 2;
  c.bias = true;
  cs.push_back(c);
  c = Case();
  c.name = "hard_forward_kl_t07_chunked_i32";
  c.jsd_beta = 0;
  c.w_hard = 0.3f;
  c.w_soft = 1.2f;
  c.temperature = 0.7f;
  c.ignore = 0.3;
  c.chunk_rows = 11;
  c.target_dtype = DType::kI32;
  cs.push_back(c);
  return cs;
}

struct DistillSetup {
  DistillSetup(const Shape& s, DType dtype, const Case& c, uint64_t seed)
      : random(RandomProblem::Make(Spec(s, dtype, c, seed))) {
    problem = random.problem();
    teacher_x = RandomStored(s.bt * s.teacher_h, 1.0, dtype, seed + 1);
    teacher_w =
        RandomStored(s.v * s.teacher_h, 2.0 / std::sqrt(double(s.teacher_h)), dtype, seed + 2);
    if (c.teacher_bias) teacher_bias = RandomStored(s.v, 0.5, dtype, seed + 3);
    problem.kind = LossKind::kDistill;
    if (!c.labels) problem.targets = nullptr;
    problem.options.temperature = c.temperature;
    problem.options.grad_scale = c.grad_scale;
    problem.options.chunk_rows = c.chunk_rows;
    problem.teacher_h = s.teacher_h;
    problem.teacher_x = teacher_x.data();
    problem.teacher_w = teacher_w.data();
    problem.teacher_bias = teacher_bias.empty() ? nullptr : teacher_bias.data();
    problem.distill.jsd_beta = c.jsd_beta;
    problem.distill.weight_hard_loss = c.w_hard;
    problem.distill.weight_soft_loss = c.w_soft;
    student = HeadInputs{s.bt, s.h, s.v, dtype, problem.x, problem.w, problem.bias};
    teacher = HeadInputs{
        s.bt, s.teacher_h, s.v, dtype, problem.teacher_x, problem.teacher_w, problem.teacher_bias};
    DistillProblem dp;
    dp.student = student;
    dp.teacher = teacher;
    dp.labels = problem.targets;
    dp.label_dtype = problem.target_dtype;
    dp.options = {c.jsd_beta, c.temperature, problem.options.ignore_index, c.grad_scale,
                  c.w_hard, c.w_soft};
    status = DistillReference(dp, &ref);
    student_logits = ComputeRawLogits(student);
    teacher_logits = ComputeRawLogits(teacher);
  }
  static RandomProblemSpec Spec(const Shape& s, DType dtype, const Case& c, uint64_t seed) {
    RandomProblemSpec spec = HeadSpec(s.bt, s.h, s.v, dtype, seed);
    spec.target_dtype = c.target_dtype;
    spec.bias = c.bias;
    spec.ignore_fraction = s.bt > 1 ? c.ignore : 0;
    return spec;
  }
  bool Counted(int64_t i) const {
    return problem.targets == nullptr ||
           LoadAsInt(problem.targets, problem.target_dtype, i) != problem.options.ignore_index;
  }
  RandomProblem random;
  LossProblem problem;
  std::vector<uint8_t> teacher_x, teacher_w, teacher_bias;
  HeadInputs student, teacher;
  DistillReferenceOutputs ref;
  absl::Status status;
  RawLogits student_logits, teacher_logits;
};

// sum_j (p_j + q_j) |log p_j - log q_j| of row i at temperature T (P the teacher's softmax,
// Q the student's): what scales the divergence's slopes beyond 1.
double LogRatioMass(const DistillSetup& s, int64_t i, double t) {
  const int64_t v = s.problem.v;
  auto log_softmax = [&](const RawLogits& l) {
    std::vector<double> z(v);
    double m = -INFINITY, sum = 0;
    for (int64_t j = 0; j < v; ++j) m = std::max(m, z[j] = l.u[i * v + j] / t);
    for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - m);
    for (int64_t j = 0; j < v; ++j) z[j] -= m + std::log(sum);
    return z;
  };
  const std::vector<double> lq = log_softmax(s.student_logits), lp = log_softmax(s.teacher_logits);
  double mass = 0;
  for (int64_t j = 0; j < v; ++j)
    mass += (std::exp(lp[j]) + std::exp(lq[j])) * std::abs(lp[j] - lq[j]);
  return mass;
}

// The student's log-sum-exp of row i at temperature T, in double.
double StudentLse(const DistillSetup& s, int64_t i, double t) {
  const int64_t v = s.problem.v;
  double m = -INFINITY, sum = 0;
  for (int64_t j = 0; j < v; ++j) m = std::max(m, s.student_logits.u[i * v + j] / t);
  for (int64_t j = 0; j < v; ++j) sum += std::exp(s.student_logits.u[i * v + j] / t - m);
  return m + std::log(sum);
}

// Every output against the reference. With a_i, at_i the student's and the teacher's
// max_j |u_ij| (the logits' rounding moves z_j by at most u a_i / T), the row's divergence has
// slopes summing to at most 2 (1 + M_i) on each side, M_i = LogRatioMass, and the hard term's
// cross-entropy (of u, no 1/T) at most 2; 2x margin:
//   row_i:     w_s 4 u (a_i + at_i) / T (1 + M_i) + w_h 4 u a_i; the loss their mean,
//              + 1e-5 (1 + |loss|)
//   lse_i:     4 u a_i / T
//   gradients: relative norm GradientTolerance(g_rel = 2 u rms_i e_i), e_i the larger of the
//              parts' (r_i + rt_i)(1 + M_i) / T (with w_s) and 2 r_i (with w_h), r_i =
//              rms_j |u_ij|: a row's rounding errors are independent, so they move G in
//              quadrature (the max-based bound, over 1 for 16-bit, could never fail)
::testing::AssertionResult MatchesDistillReference(const DistillSetup& s, const Case& c,
                                                   const KindOutputs& got) {
  const LossProblem& p = s.problem;
  const DistillReferenceOutputs& ref = s.ref;
  const double u = UnitRoundoff(p.dtype), inv_t = 1.0 / c.temperature;
  std::string err;
  if (got.tokens != ref.tokens)
    absl::StrAppend(&err, "tokens ", got.tokens, " vs ", ref.tokens, "\n");
  double loss_bound = 0;
  std::vector<double> mass_rms;  // (counted rows) (rms_j |u_ij| + rms_j |ut_ij|) (1 + M_i)
  int64_t correct = 0;
  for (int64_t i = 0; i < p.bt; ++i) {
    const double a = s.student_logits.abs_max[i], at = s.teacher_logits.abs_max[i];
    if (!(std::abs(got.lse[i] - StudentLse(s, i, c.temperature)) <=
          4 * u * a * inv_t + 1e-5 * (1 + std::abs(got.lse[i])))) {
      absl::StrAppend(&err, "lse[", i, "] = ", got.lse[i], "\n");
    }
    if (!ArgmaxAcceptable(s.student_logits, p.v, i, got.predictions[i], u)) {
      absl::StrAppend(&err, "predictions[", i, "] = ", got.predictions[i], "\n");
    }
    if (!s.Counted(i)) continue;
    const double mass = LogRatioMass(s, i, c.temperature);
    const double soft = (s.student_logits.rms[i] + s.teacher_logits.rms[i]) * (1 + mass) * inv_t;
    const double hard = 2 * s.student_logits.rms[i];
    mass_rms.push_back(std::max(c.w_soft != 0 ? soft : 0.0, c.w_hard != 0 ? hard : 0.0));
    loss_bound += c.w_soft * 4 * u * (a + at) * inv_t * (1 + mass) + c.w_hard * 4 * u * a;
    if (p.targets != nullptr && got.predictions[i] == LoadAsInt(p.targets, p.target_dtype, i)) {
      ++correct;
    }
  }
  if (ref.tokens > 0) loss_bound /= static_cast<double>(ref.tokens);
  if (!(std::abs(got.loss[0] - ref.loss) <= loss_bound + 1e-5 * (1 + std::abs(ref.loss)))) {
    absl::StrAppend(&err, "loss ", got.loss[0], " vs ", ref.loss, " (bound ", loss_bound, ")\n");
  }
  const double acc = ref.tokens > 0 ? static_cast<double>(correct) / ref.tokens : 0.0;
  if (!(std::abs(got.accuracy - acc) <= 1e-7))
    absl::StrAppend(&err, "accuracy ", got.accuracy, "\n");
  const double g_rel = 2 * u * Rms(mass_rms);
  const double tol = GradientTolerance(p, got.grad_dtype, g_rel);
  return KindVerdict(
      err, GradientsMatch(p, got, ref.grad, 1.0, tol),
      absl::StrCat("loss ", got.loss[0], " vs ", ref.loss, " (bound ", loss_bound, ")\n"));
}

KindOutputs DistillOutputs(const LossProblem& p, DType grad_dtype, bool accumulate = false) {
  KindOutputs out(p, grad_dtype, accumulate);
  out.want_logp = out.want_entropy = false;  // not distill's
  return out;
}

using Param = std::tuple<Shape, DType, Case>;
class CpuDistillMatrixTest : public ::testing::TestWithParam<Param> {};

TEST_P(CpuDistillMatrixTest, MatchesReference) {
  const auto& [shape, dtype, c] = GetParam();
  const DistillSetup s(shape, dtype, c, 7000 + shape.bt * 7 + static_cast<int>(dtype));
  ASSERT_TRUE(s.status.ok()) << s.status;
  KindOutputs got = DistillOutputs(s.problem, c.grad_f32 ? DType::kF32 : dtype, c.accumulate);
  ExpectComputeMatches(s.problem, got,
                       [&](const KindOutputs& g) { return MatchesDistillReference(s, c, g); });
}

INSTANTIATE_TEST_SUITE_P(Matrix, CpuDistillMatrixTest,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::Values(DType::kBF16, DType::kF16,
                                                              DType::kF32),
                                            ::testing::ValuesIn(Cases())),
                         MatrixCaseName<Param>);

TEST(CpuDistillTest, BitIdenticalAtAnyThreadCountAndOnRerun) {
  Case c = Cases()[2];
  c.chunk_rows = 50;
  const DistillSetup s(kShapes[3], DType::kBF16, c, 31);
  ASSERT_TRUE(s.status.ok());
  ExpectBitIdenticalAcrossThreads(
      s.problem, [](const LossProblem& p) { return DistillOutputs(p, DType::kBF16); });
}

// X arrives while the Compute runs (the teacher's X is whole): the same bits as given whole.
TEST(CpuDistillTest, StreamedRowsGiveTheWholeProblemsBits) {
  Case c = Cases()[0];
  c.chunk_rows = 50;
  const DistillSetup s(kShapes[3], DType::kBF16, c, 34);
  ASSERT_TRUE(s.status.ok());
  ExpectStreamedRowsIdentical(
      s.problem, [](const LossProblem& p) { return DistillOutputs(p, DType::kBF16); }, 6);
}

TEST(CpuDistillTest, WorkspaceCountsTheTeachersChunk) {
  const DistillSetup s(kShapes[3], DType::kBF16, Cases()[0], 32);
  KindOutputs out = DistillOutputs(s.problem, DType::kBF16);
  std::unique_ptr<Backend> backend = NewCpuBackend(1);
  WorkspaceShape shape = ShapeOf(s.problem, out.outputs());
  const uint64_t with_teacher = backend->WorkspaceBytes(shape);
  shape.kind = LossKind::kLogprob;
  shape.teacher_h = 0;
  const uint64_t c = 256, v = 1000, th = 96;
  // The teacher's logits chunk, its X chunk and W in fp32, and its bias.
  EXPECT_GE(with_teacher - backend->WorkspaceBytes(shape), (c * v + c * th + v * th + v) * 4);
}

// The default chunk keeps both logits chunks (student's and teacher's) in one chunk budget.
TEST(CpuDistillTest, DefaultChunkHalvesForTheTeachersLogits) {
  LossProblem p;
  p.bt = 1 << 20;
  p.v = 32000;
  const int64_t ce = CpuBackend::ChunkRows(p);
  p.kind = LossKind::kDistill;
  EXPECT_EQ(CpuBackend::ChunkRows(p), ce / 2);
  EXPECT_LE(uint64_t(CpuBackend::ChunkRows(p)) * 2 * p.v * 4, CpuBackend::kDefaultChunkBytes);
}

TEST(CpuDistillTest, RefusesWhatItCannotCompute) {
  const DistillSetup s(kShapes[0], DType::kF32, Cases()[0], 33);
  ASSERT_TRUE(s.status.ok());
  const std::vector<float> ones(s.problem.bt, 1.0f);
  const std::vector<Refusal> bad = {
      {"options.softcap", [](LossProblem& p) { p.options.softcap = 5; }},
      {"distill.jsd_beta", [](LossProblem& p) { p.distill.jsd_beta = 1.5f; }},
      {"distill.jsd_beta", [](LossProblem& p) { p.distill.jsd_beta = NAN; }},
      {"teacher_h", [](LossProblem& p) { p.teacher_h = 0; }},
      {"teacher_x and teacher_w", [](LossProblem& p) { p.teacher_w = nullptr; }},
      {"advantages", [&](LossProblem& p) { p.advantages = ones.data(); }},
      {"options.label_smoothing", [](LossProblem& p) { p.options.label_smoothing = 0.1f; }},
      {"logp", [](LossProblem&) {}, [](KindOutputs& o) { o.want_logp = true; }},
  };
  ExpectRefusals(s.problem, bad,
                 [](const LossProblem& p) { return DistillOutputs(p, DType::kF32); });
}

}  // namespace
}  // namespace lossd
