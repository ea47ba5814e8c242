// SPDX-License-Identifier: Apache-2.0
// GPU tests of the reference-exp path (fused_loss_ref_exp.cc) through the CUDA backend: every
// option it covers against the float64 reference, its own counts saying it ran, bit-identical
// reruns, agreement with the other path, rows whose exp overflows redone alone, and a chunk
// with a row of non-finite logits redone whole by the cross-entropy kernel. Skipped where the
// path is not there: no GPU, a device other than sm_90, or a plugin built without
// --define=lossd_sm90=1 (CUTLASS).
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/cpu/reference.h"
#include "kernels/cuda/cuda_backend.h"
#include "testing/cuda/cuda_test_fixture.h"
#include "testing/test_util.h"

namespace lossd {
namespace cuda {
namespace {

// The path forced on: a device's default may take the other path (device_tuning.h: an H100).
CudaBackend* RefExpBackend() {
  static CudaBackend* backend = [] {
    CudaBackendOptions o;
    o.ref_exp = RefExpChoice::kOn;
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(o);
    return b.ok() ? b->release() : nullptr;
  }();
  return backend;
}

class RefExpTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    backend_ = RefExpBackend();
    ASSERT_NE(backend_, nullptr);
    if (!backend_->ref_exp()) {
      GTEST_SKIP() << "the reference-exp path is not built in or the device is not sm_90";
    }
  }

  // Computes `rp` on the shared backend; the chunks the path ran, the rows it redid and the
  // chunks it redid whole in the call.
  CudaBackend::RefExpCounters Run(const RandomProblem& rp, HostOutputs& out) {
    const auto before = backend_->RefExpCounts();
    const absl::Status st = backend_->Compute(rp.problem(), out.outputs(), nullptr);
    EXPECT_TRUE(st.ok()) << st;
    const auto after = backend_->RefExpCounts();
    CudaBackend::RefExpCounters d;
    d.chunks = after.chunks - before.chunks;
    d.redone_rows = after.redone_rows - before.redone_rows;
    d.chunk_fallbacks = after.chunk_fallbacks - before.chunk_fallbacks;
    return d;
  }

  // rp's X rows `rows` times 256 (bf16 exponent + 8): their largest logits sit hundreds above
  // the largest of the reference's sample, so their exp overflows.
  static void Inflate(RandomProblem& rp, const std::vector<int64_t>& rows, int64_t h) {
    for (int64_t row : rows) {
      for (int64_t j = 0; j < h; ++j) {
        uint16_t bits;
        std::memcpy(&bits, &rp.x[(row * h + j) * 2], 2);
        if ((bits & 0x7f80) != 0) bits = static_cast<uint16_t>(bits + (8 << 7));
        std::memcpy(&rp.x[(row * h + j) * 2], &bits, 2);
      }
    }
    rp.RecomputeStats();
  }
};

// The options the path covers (no bias, softcap or label smoothing), in OptionCase's order:
// name, reduction, eps, z-loss, cap, bias, weights, grad_output, ignored share, chunk rows,
// target dtype, fp32 grads, accumulate, weight scale, signed weights, token scaling.
const OptionCase kCovered[] = {
    {"mean"},
    {"sum_weights_ignore", Reduction::kSum, 0, 0, 0, false, true, false, 0.3},
    {"none_gradout_zloss", Reduction::kNone, 0, 1e-3f, 0, false, false, true},
    {"mean_chunked_i32", Reduction::kMean, 0, 0, 0, false, false, false, 0.1, 128,
     DType::kI32},
    {"sum_f32_grads_accumulate", Reduction::kSum, 0, 1e-4f, 0, false, false, false, 0.1, 0,
     DType::kI64, true, true},
    {"mean_signed_weights_zloss", Reduction::kMean, 0, 1e-4f, 0, false, true, false, 0.1, 0,
     DType::kI64, false, false, 1, true},
    {"mean_token_scaling_weights", Reduction::kMean, 0, 1e-3f, 0, false, true, false, 0.2, 0,
     DType::kI64, false, false, 1, false, true},
    {"none_token_scaling_gradout_chunked", Reduction::kNone, 0, 1e-3f, 0, false, false, true,
     0.2, 200, DType::kI64, true, false, 1, false, true},
};

// Rows not a multiple of the 128-row tile, V not a multiple of the 128-column tile, and a
// vocabulary wider than the reference's 1024-row sample.
const Shape kRefExpShapes[] = {
    {"medium", 300, 96, 1000},
    {"wide", 300, 64, 16392},
};

class RefExpMatrixTest : public RefExpTest,
                         public testing::WithParamInterface<std::tuple<int, int>> {};

TEST_P(RefExpMatrixTest, MatchesReferenceAndReruns) {
  const Shape& shape = kRefExpShapes[std::get<0>(GetParam())];
  const OptionCase& opt = kCovered[std::get<1>(GetParam())];
  RandomProblem rp = RandomProblem::Make(MakeSpec(shape, opt, DType::kBF16, 29 + shape.v));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  const DType grad_dtype = opt.grad_f32 ? DType::kF32 : DType::kBF16;
  HostOutputs first(p, grad_dtype, /*want_grads=*/true, opt.accumulate);
  const auto counts = Run(rp, first);
  const int64_t chunk_rows = opt.chunk_rows > 0 ? opt.chunk_rows : shape.bt;
  EXPECT_EQ(counts.chunks, (shape.bt + chunk_rows - 1) / chunk_rows) << "the path did not run";
  EXPECT_EQ(counts.redone_rows, 0);
  EXPECT_EQ(counts.chunk_fallbacks, 0);
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, first.outputs()));
  // A rerun writes the same bits (the accumulating case adds into a fresh zero again).
  HostOutputs second(p, grad_dtype, /*want_grads=*/true, opt.accumulate);
  Run(rp, second);
  EXPECT_TRUE(BitIdentical(first, second));
}

INSTANTIATE_TEST_SUITE_P(
    Covered, RefExpMatrixTest,
    testing::Combine(testing::Range(0, 2),
                     testing::Range(0, static_cast<int>(sizeof(kCovered) / sizeof(kCovered[0])))),
    [](const testing::TestParamInfo<std::tuple<int, int>>& info) {
      return std::string(kRefExpShapes[std::get<0>(info.param)].name) + "_" +
             kCovered[std::get<1>(info.param)].name;
    });

// Options the path does not cover run the other path in the same workspace: no chunk counted.
TEST_F(RefExpTest, UncoveredOptionsTakeTheOtherPath) {
  for (const OptionCase& opt : {OptionCase{"smooth", Reduction::kMean, 0.1f},
                                OptionCase{"softcap", Reduction::kMean, 0, 0, 5.0f},
                                OptionCase{"bias", Reduction::kMean, 0, 0, 0, true}}) {
    SCOPED_TRACE(opt.name);
    RandomProblem rp = RandomProblem::Make(MakeSpec(kRefExpShapes[0], opt, DType::kBF16, 5));
    const LossProblem p = rp.problem();
    ReferenceOutputs ref;
    ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
    HostOutputs out(p, DType::kBF16);
    EXPECT_EQ(Run(rp, out).chunks, 0);
    EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, out.outputs()));
  }
}

// One row's hidden state times 256 puts its largest logit hundreds above the largest of the
// reference's sample: its exp overflows, the combine flags the row, and that row alone is
// recomputed with its own largest logit as the reference (the rest of its chunk is kept, no
// chunk is redone whole). The results still match the float64 reference, and a rerun gives
// the same bits.
TEST_F(RefExpTest, OverflowingRowIsRedoneAlone) {
  OptionCase opt{"mean_chunked", Reduction::kMean, 0, 0, 0, false, false, false, 0.0, 64};
  RandomProblem rp = RandomProblem::Make(SpecOf(256, 64, 32000, DType::kBF16, opt, 0.7f, 41));
  Inflate(rp, {100}, 64);
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs first(p, DType::kBF16), second(p, DType::kBF16);
  const auto counts = Run(rp, first);
  EXPECT_EQ(counts.chunks, 4);
  EXPECT_EQ(counts.redone_rows, 1) << "row 100 alone should have been redone";
  EXPECT_EQ(counts.chunk_fallbacks, 0);
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, first.outputs()));
  Run(rp, second);
  EXPECT_TRUE(BitIdentical(first, second));
}

// Many inflated rows over three chunks, ignored rows among them, with z-loss and class weights:
// the rows whose exp overflows are redone alone (not every inflated row overflows: its
// sample's largest logit grows with it; on an H100, 30 of the 43 did), no chunk is redone whole,
// and the rows' results and gradients match the float64 reference.
TEST_F(RefExpTest, ManyFlaggedRowsAreRedoneAlone) {
  OptionCase opt{"sum_weights_ignore_zloss", Reduction::kSum, 0, 1e-3f, 0, false, true, false,
                 0.3, 128};
  RandomProblem rp = RandomProblem::Make(SpecOf(300, 64, 16392, DType::kBF16, opt, 0.7f, 43));
  std::vector<int64_t> rows;
  for (int64_t r = 3; r < 300; r += 7) rows.push_back(r);  // 43 rows over the three chunks
  Inflate(rp, rows, 64);
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs first(p, DType::kBF16), second(p, DType::kBF16);
  const auto counts = Run(rp, first);
  EXPECT_EQ(counts.chunks, 3);
  EXPECT_GT(counts.redone_rows, 1);
  EXPECT_LE(counts.redone_rows, static_cast<int64_t>(rows.size()));
  EXPECT_EQ(counts.chunk_fallbacks, 0);
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, first.outputs()));
  Run(rp, second);
  EXPECT_TRUE(BitIdentical(first, second));
}

// A row of non-finite logits (an infinite hidden state) cannot be mended by a new reference:
// its chunk, and only that one, is redone whole by the cross-entropy kernel, as before.
TEST_F(RefExpTest, NonFiniteRowRedoesItsChunk) {
  OptionCase opt{"mean_chunked", Reduction::kMean, 0, 0, 0, false, false, false, 0.0, 64};
  RandomProblem rp = RandomProblem::Make(SpecOf(256, 64, 32000, DType::kBF16, opt, 0.7f, 47));
  const uint16_t inf_bits = 0x7f80;
  std::memcpy(&rp.x[(70 * 64 + 5) * 2], &inf_bits, 2);
  rp.RecomputeStats();
  HostOutputs out(rp.problem(), DType::kBF16);
  const auto counts = Run(rp, out);
  EXPECT_EQ(counts.chunks, 4);
  EXPECT_EQ(counts.redone_rows, 0);
  EXPECT_EQ(counts.chunk_fallbacks, 1);
}

// The same problems with the path off (a second backend) agree within the reference's bounds,
// and the path's predictions are the argmax of the float64 logits up to ties (MatchesReference).
TEST_F(RefExpTest, AgreesWithTheOtherPath) {
  CudaBackendOptions off;
  off.ref_exp = RefExpChoice::kOff;
  absl::StatusOr<std::unique_ptr<CudaBackend>> other = CudaBackend::Create(off);
  ASSERT_TRUE(other.ok()) << other.status();
  ASSERT_FALSE((*other)->ref_exp());
  RandomProblem rp = RandomProblem::Make(MakeSpec(kRefExpShapes[1], kCovered[0], DType::kBF16, 3));
  const LossProblem p = rp.problem();
  ReferenceOutputs ref;
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  HostOutputs mine(p, DType::kBF16), theirs(p, DType::kBF16);
  EXPECT_EQ(Run(rp, mine).chunks, 1);
  ASSERT_TRUE((*other)->Compute(p, theirs.outputs(), nullptr).ok());
  EXPECT_EQ((*other)->RefExpCounts().chunks, 0);
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, mine.outputs()));
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, theirs.outputs()));
}

}  // namespace
}  // namespace cuda
}  // namespace lossd
