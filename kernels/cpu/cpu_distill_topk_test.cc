// SPDX-License-Identifier: Apache-2.0
// The CPU backend's distill kind from the teacher's top-k log-probs against its float64
// reference (kernels/cpu/distill_reference.h) over shapes x dtypes x options (jsd_beta, the
// tail's treatment, k, temperature, the hard-label term, ignored rows, int32 ids, chunks,
// accumulators), with the tolerance derived below; determinism, streamed rows, the
// workspace (no teacher buffers) and what the backend refuses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
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
  int64_t bt, h, v;
};
const Shape kShapes[] = {{"tiny", 2, 3, 5}, {"bt1", 1, 16, 37}, {"odd", 47, 31, 123},
                         {"medium", 256, 128, 1000}};

struct Case {
  const char* name;
  float jsd_beta = 0.0f, temperature = 1, grad_scale = 1;
  DistillTopkTail tail = DistillTopkTail::kBucket;
  int64_t k = 4;  // capped at V - 1
  float w_hard = 0, w_soft = 1;
  bool bias = false, grad_f32 = false, accumulate = false;
  double ignore = 0.1;
  int64_t chunk_rows = 0;
  DType id_dtype = DType::kI64;
};

std::vector<Case> Cases() {
  std::vector<Case> cs;
  Case c;
  c.name = "bucket_forward_kl";
  cs.push_back(c);
  c = Case();
  c.name = "bucket_jsd_t2_bias_k20_scaled";
  c.jsd_beta = 0.5f;
  c.temperature = 2;
  c.bias = true;
  c.k = 20;
  // Flat distributions at T 2: a dX of ~1e-7, below fp16's normal range (6e-5), which an fp16
  // gradient cannot hold; an fp16 trainer scales its loss (as here) for that reason.
  c.grad_scale = 1024;
  cs.push_back(c);
  c = Case();
  c.name = "bucket_reverse_kl_i32_chunked";
  c.jsd_beta = 1;
  c.id_dtype = DType::kI32;
  c.ignore = 0.3;
  c.chunk_rows = 11;
  cs.push_back(c);
  c = Case();
  c.name = "renormalize_reverse_kl_t07";
  c.tail = DistillTopkTail::kRenormalize;
  c.jsd_beta = 1;
  c.temperature = 0.7f;
  cs.push_back(c);
  c = Case();
  c.name = "renormalize_jsd_k1";
  c.tail = DistillTopkTail::kRenormalize;
  c.jsd_beta = 0.3f;
  c.k = 1;
  cs.push_back(c);
  c = Case();
  c.name = "none_forward_kl_hard";  // verl's forward_kl_topk, with a cross-entropy term
  c.tail = DistillTopkTail::kNone;
  c.w_hard = 0.5f;
  c.w_soft = 0.8f;
  cs.push_back(c);
  c = Case();
  c.name = "bucket_hard_accumulate_f32";
  c.w_hard = 0.3f;
  c.accumulate = c.grad_f32 = c.bias = true;
  c.grad_scale = 0.7f;
  c.chunk_rows = 11;
  cs.push_back(c);
  return cs;
}

// The student's problem and a teacher's top-k: per row a random teacher distribution
// (logits of std 2 over V) of which the k most likely ids (in random order) and their
// log-probs, fp32.
struct TopkSetup {
  TopkSetup(const Shape& s, DType dtype, const Case& c, uint64_t seed)
      : random(RandomProblem::Make(Spec(s, dtype, c, seed))), k(std::min(c.k, s.v - 1)) {
    problem = random.problem();
    const std::vector<float> tz = RandomFloats(s.bt * s.v, -3.5f, 3.5f, seed + 1);
    std::vector<int64_t> order(s.v);
    for (int64_t i = 0; i < s.bt; ++i) {
      const float* z = tz.data() + i * s.v;
      const double m = *std::max_element(z, z + s.v);
      double sum = 0;
      for (int64_t j = 0; j < s.v; ++j) sum += std::exp(z[j] - m);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t a, int64_t b) { return z[a] > z[b]; });
      std::rotate(order.begin(), order.begin() + (i % k), order.begin() + k);  // any order
      for (int64_t a = 0; a < k; ++a) {
        ids64.push_back(order[a]);
        ids32.push_back(static_cast<int32_t>(order[a]));
        logp.push_back(static_cast<float>(z[order[a]] - m - std::log(sum)));
      }
    }
    problem.kind = LossKind::kDistill;
    problem.options.temperature = c.temperature;
    problem.options.grad_scale = c.grad_scale;
    problem.options.chunk_rows = c.chunk_rows;
    problem.teacher_topk = k;
    problem.teacher_topk_id_dtype = c.id_dtype;
    problem.teacher_topk_ids =
        c.id_dtype == DType::kI32 ? static_cast<const void*>(ids32.data()) : ids64.data();
    problem.teacher_topk_logp = logp.data();
    problem.distill = DistillParams{c.jsd_beta, c.w_hard, c.w_soft, c.tail};
    student = HeadInputs{s.bt, s.h, s.v, dtype, problem.x, problem.w, problem.bias};
    DistillProblem dp;
    dp.student = student;
    dp.topk = k;
    dp.topk_ids = problem.teacher_topk_ids;
    dp.topk_id_dtype = c.id_dtype;
    dp.topk_logp = logp.data();
    dp.labels = problem.targets;
    dp.label_dtype = problem.target_dtype;
    dp.options = {c.jsd_beta, c.temperature, problem.options.ignore_index, c.grad_scale,
                  c.w_hard,   c.w_soft,      c.tail};
    status = DistillReference(dp, &ref);
    logits = ComputeRawLogits(student);
  }
  static RandomProblemSpec Spec(const Shape& s, DType dtype, const Case& c, uint64_t seed) {
    RandomProblemSpec spec = HeadSpec(s.bt, s.h, s.v, dtype, seed);
    spec.bias = c.bias;
    spec.ignore_fraction = s.bt > 1 ? c.ignore : 0;
    return spec;
  }
  bool Counted(int64_t i) const {
    return LoadAsInt(problem.targets, problem.target_dtype, i) != problem.options.ignore_index;
  }
  RandomProblem random;
  int64_t k;
  std::vector<int64_t> ids64;
  std::vector<int32_t> ids32;
  std::vector<float> logp;
  LossProblem problem;
  HeadInputs student;
  DistillReferenceOutputs ref;
  absl::Status status;
  RawLogits logits;
};

// sum_e (p_e + q_e) |log p_e - log q_e| over row i's events (the ids, and the bucket's tail),
// the student's at temperature T in double: what scales the divergence's slopes beyond 1.
double EventMass(const TopkSetup& s, const Case& c, int64_t i) {
  const int64_t v = s.problem.v, k = s.k;
  std::vector<double> z(v);
  double m = -INFINITY, sum = 0;
  for (int64_t j = 0; j < v; ++j) m = std::max(m, z[j] = s.logits.u[i * v + j] / c.temperature);
  for (int64_t j = 0; j < v; ++j) sum += std::exp(z[j] - m);
  double mass = 0, p_sum = 0, q_sum = 0;
  for (int64_t a = 0; a < k; ++a) {
    const double lp = s.logp[i * k + a], lq = z[s.ids64[i * k + a]] - m - std::log(sum);
    mass += (std::exp(lp) + std::exp(lq)) * std::abs(lp - lq);
    p_sum += std::exp(lp);
    q_sum += std::exp(lq);
  }
  if (c.tail == DistillTopkTail::kBucket && p_sum < 1) {
    mass += (1 - p_sum + 1 - q_sum) * std::abs(std::log((1 - p_sum) / (1 - q_sum)));
  }
  return mass;
}

// Every output against the reference. With a_i the student's max_j |u_ij| (the logits'
// rounding moves z_j by at most u a_i / T; the teacher's log-probs are exact), the row's
// divergence has slopes summing to at most 2 (1 + M_i) (M_i = EventMass), the hard term's
// at most 2; 2x margin:
//   row_i:     w_s 4 u a_i / T (1 + M_i) + w_h 4 u a_i; the loss their mean, + 1e-5 (1 + |loss|)
//   lse_i:     4 u a_i / T (+ fp32 slack)
//   gradients: relative norm GradientTolerance(g_rel = 2 u rms_i e_i), e_i the larger of
//              r_i (1 + M_i) / T (with w_s) and 2 r_i (with w_h), r_i = rms_j |u_ij|
::testing::AssertionResult MatchesTopkReference(const TopkSetup& s, const Case& c,
                                                const KindOutputs& got) {
  const LossProblem& p = s.problem;
  const DistillReferenceOutputs& ref = s.ref;
  const double u = UnitRoundoff(p.dtype), inv_t = 1.0 / c.temperature;
  std::string err;
  if (got.tokens != ref.tokens) absl::StrAppend(&err, "tokens ", got.tokens, " vs ", ref.tokens, "\n");
  double loss_bound = 0;
  std::vector<double> slopes;
  for (int64_t i = 0; i < p.bt; ++i) {
    const double a = s.logits.abs_max[i];
    if (!ArgmaxAcceptable(s.logits, p.v, i, got.predictions[i], u)) {
      absl::StrAppend(&err, "predictions[", i, "] = ", got.predictions[i], "\n");
    }
    if (!s.Counted(i)) continue;
    const double mass = EventMass(s, c, i);
    const double soft = s.logits.rms[i] * (1 + mass) * inv_t, hard = 2 * s.logits.rms[i];
    slopes.push_back(std::max(c.w_soft != 0 ? soft : 0.0, c.w_hard != 0 ? hard : 0.0));
    loss_bound += c.w_soft * 4 * u * a * inv_t * (1 + mass) + c.w_hard * 4 * u * a;
  }
  if (ref.tokens > 0) loss_bound /= static_cast<double>(ref.tokens);
  if (!(std::abs(got.loss[0] - ref.loss) <= loss_bound + 1e-5 * (1 + std::abs(ref.loss)))) {
    absl::StrAppend(&err, "loss ", got.loss[0], " vs ", ref.loss, " (bound ", loss_bound, ")\n");
  }
  const double tol = GradientTolerance(p, got.grad_dtype, 2 * u * Rms(slopes));
  return KindVerdict(
      err, GradientsMatch(p, got, ref.grad, 1.0, tol),
      absl::StrCat("loss ", got.loss[0], " vs ", ref.loss, " (bound ", loss_bound, ")\n"));
}

KindOutputs TopkOutputs(const LossProblem& p, DType grad_dtype, bool accumulate = false) {
  KindOutputs out(p, grad_dtype, accumulate);
  out.want_logp = out.want_entropy = false;  // not distill's
  return out;
}

using Param = std::tuple<Shape, DType, Case>;
class CpuDistillTopkMatrixTest : public ::testing::TestWithParam<Param> {};

TEST_P(CpuDistillTopkMatrixTest, MatchesReference) {
  const auto& [shape, dtype, c] = GetParam();
  const TopkSetup s(shape, dtype, c, 9000 + shape.bt * 7 + static_cast<int>(dtype));
  ASSERT_TRUE(s.status.ok()) << s.status;
  KindOutputs got = TopkOutputs(s.problem, c.grad_f32 ? DType::kF32 : dtype, c.accumulate);
  ExpectComputeMatches(s.problem, got,
                       [&](const KindOutputs& g) { return MatchesTopkReference(s, c, g); });
}

INSTANTIATE_TEST_SUITE_P(Matrix, CpuDistillTopkMatrixTest,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::Values(DType::kBF16, DType::kF16,
                                                              DType::kF32),
                                            ::testing::ValuesIn(Cases())),
                         MatrixCaseName<Param>);

TEST(CpuDistillTopkTest, BitIdenticalAtAnyThreadCountAndOnRerun) {
  Case c = Cases()[1];
  c.chunk_rows = 50;
  const TopkSetup s(kShapes[3], DType::kBF16, c, 41);
  ASSERT_TRUE(s.status.ok());
  ExpectBitIdenticalAcrossThreads(
      s.problem, [](const LossProblem& p) { return TopkOutputs(p, DType::kBF16); });
}

TEST(CpuDistillTopkTest, StreamedRowsGiveTheWholeProblemsBits) {
  Case c = Cases()[0];
  c.chunk_rows = 50;
  const TopkSetup s(kShapes[3], DType::kBF16, c, 42);
  ASSERT_TRUE(s.status.ok());
  ExpectStreamedRowsIdentical(
      s.problem, [](const LossProblem& p) { return TopkOutputs(p, DType::kBF16); }, 6);
}

// No teacher head: none of its buffers (logits chunk, W, X chunk, bias) in the workspace.
TEST(CpuDistillTopkTest, WorkspaceHoldsNoTeacherBuffers) {
  const TopkSetup s(kShapes[3], DType::kBF16, Cases()[0], 43);
  KindOutputs out = TopkOutputs(s.problem, DType::kBF16);
  std::unique_ptr<Backend> backend = NewCpuBackend(1);
  WorkspaceShape shape = ShapeOf(s.problem, out.outputs());
  EXPECT_EQ(shape.teacher_topk, s.k);
  const uint64_t topk = backend->WorkspaceBytes(shape);
  shape.teacher_topk = 0;
  shape.teacher_h = 96;  // a head teacher of the same rows
  EXPECT_GE(backend->WorkspaceBytes(shape) - topk, 256u * 1000 * 4);  // its logits chunk
}

TEST(CpuDistillTopkTest, RefusesBadTopkNamingTheRow) {
  Case c = Cases()[0];
  c.ignore = 0;  // row 0 counts
  const TopkSetup s(kShapes[0], DType::kF32, c, 44);
  ASSERT_TRUE(s.status.ok());
  std::vector<int64_t> bad_ids = s.ids64;
  bad_ids[1] = 99;
  std::vector<float> bad_logp = s.logp;
  bad_logp[0] = NAN;
  const std::vector<uint8_t> teacher(s.problem.v * 3 * 4, 0);
  const std::vector<Refusal> bad = {
      {"teacher_topk_ids[0, 1] = 99", [&](LossProblem& p) { p.teacher_topk_ids = bad_ids.data(); }},
      {"teacher_topk_logp[0, 0] = nan", [&](LossProblem& p) { p.teacher_topk_logp = bad_logp.data(); }},
      {"teacher_topk_ids: k = 6", [](LossProblem& p) { p.teacher_topk = 6; }},
      {"a teacher head or its top-k, not both",
       [&](LossProblem& p) { p.teacher_w = teacher.data(); }},
      {"distill.topk_tail 7", [](LossProblem& p) { p.distill.topk_tail = DistillTopkTail(7); }},
  };
  ExpectRefusals(s.problem, bad,
                 [](const LossProblem& p) { return TopkOutputs(p, DType::kF32); });
}

}  // namespace
}  // namespace lossd
