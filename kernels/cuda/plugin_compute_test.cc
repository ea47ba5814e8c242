// SPDX-License-Identifier: Apache-2.0
// The CUDA backend through the plugin ABI (liblossd_cuda.so loaded by the server's loader)
// against the same backend linked in and called directly, on a GPU host: the same bits for
// every output and optimizer step, the same statistics, the same workspace sizes, the same
// info, the policy options of ABI 6.3. Both run with fixed GEMM algorithms, so a difference can only come from the C
// boundary.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "core/status_macros.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/optimizer.h"
#include "kernels/plugin_loader.h"
#include "testing/optimizer_cases.h"
#include "testing/cuda/row_loss_test_cases.h"
#include "testing/plugin_cases.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

class PluginComputeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    LossdCudaOptions o = DefaultCudaOptions();
    o.fixed_gemm_algorithms = 1;
    absl::StatusOr<std::unique_ptr<Backend>> p = LoadCudaBackend("", o);
    ASSERT_TRUE(p.ok()) << p.status();
    plugin_ = std::move(*p);
    cuda::CudaBackendOptions d;
    d.autotune_gemms = false;
    absl::StatusOr<std::unique_ptr<cuda::CudaBackend>> b = cuda::CudaBackend::Create(d);
    ASSERT_TRUE(b.ok()) << b.status();
    direct_ = std::move(*b);
  }
  std::unique_ptr<Backend> plugin_;
  std::unique_ptr<Backend> direct_;
};

// One step of case c in b's memory: buf's buffers and grad uploaded, stepped and read back
// into buf; *sum = the sum of squares of the new master, on the device.
absl::Status StepOn(Backend& b, const OptimizerCase& c, OptimizerBuffers* buf,
                    const std::vector<float>& grad, double* sum) {
  const size_t bytes = static_cast<size_t>(buf->n) * 4;
  std::vector<float>* host[4] = {&buf->param, &buf->state1, &buf->state2, &buf->state3};
  std::unique_ptr<BackendBuffer> dev[6];
  const void* src[6] = {buf->param.data(), buf->state1.data(), buf->state2.data(),
                        buf->state3.data(), grad.data(), buf->copy.data()};
  for (int i = 0; i < 6; ++i) {
    LOSSD_ASSIGN_OR_RETURN(dev[i], b.Allocate(bytes));
    LOSSD_RETURN_IF_ERROR(b.CopyToBackend(*dev[i], 0, src[i], bytes));
  }
  OptimizerTensors t;
  t.n = buf->n;
  t.param = static_cast<float*>(dev[0]->data());
  t.state1 = static_cast<float*>(dev[1]->data());
  t.state2 = static_cast<float*>(dev[2]->data());
  t.state3 = static_cast<float*>(dev[3]->data());
  t.grad = static_cast<const float*>(dev[4]->data());
  t.copy = c.copy ? dev[5]->data() : nullptr;
  t.copy_dtype = c.copy_dtype;
  LOSSD_RETURN_IF_ERROR(b.OptimizerStep(c.params, t));
  for (int i = 0; i < 4; ++i) {
    LOSSD_RETURN_IF_ERROR(b.CopyFromBackend(*dev[i], 0, host[i]->data(), bytes));
  }
  LOSSD_RETURN_IF_ERROR(b.CopyFromBackend(*dev[5], 0, buf->copy.data(), bytes));
  LOSSD_ASSIGN_OR_RETURN(*sum, b.SumOfSquares(t.param, buf->n));
  return absl::OkStatus();
}

// The optimizer step and the sum of squares through the table: the direct backend's bits.
TEST_F(PluginComputeTest, OptimizerStepIsTheDirectBackendsBitForBit) {
  const int64_t n = 100003;
  for (const OptimizerCase& c : AllOptimizerCases()) {
    SCOPED_TRACE(c.name);
    OptimizerBuffers want = RandomOptimizerBuffers(c, n, 3), got = want;
    const std::vector<float> grad = RandomGradient(n, 4);
    double want_sum = 0, got_sum = 0;
    ASSERT_TRUE(StepOn(*direct_, c, &want, grad, &want_sum).ok());
    ASSERT_TRUE(StepOn(*plugin_, c, &got, grad, &got_sum).ok());
    EXPECT_EQ(CountNan(want.param), 0);
    EXPECT_EQ(std::memcmp(want.param.data(), got.param.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(want.state1.data(), got.state1.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(want.state2.data(), got.state2.data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(want.state3.data(), got.state3.data(), n * 4), 0);
    EXPECT_EQ(want.copy, got.copy);
    EXPECT_EQ(std::memcmp(&want_sum, &got_sum, sizeof(double)), 0);
    EXPECT_GT(want_sum, 0);
  }
}

TEST_F(PluginComputeTest, InfoAndHostMemory) {
  const BackendInfo got = plugin_->Info(), want = direct_->Info();
  EXPECT_EQ(got.name, "cuda");
  EXPECT_EQ(got.device, want.device);
  EXPECT_EQ(got.memory_total_bytes, want.memory_total_bytes);
  EXPECT_TRUE(got.healthy);
  // ABI 6.1's field crosses: the path the device chose.
  EXPECT_FALSE(got.compute_path.empty());
  EXPECT_EQ(got.compute_path, want.compute_path);
  // ABI 6.3 carries the policy's options, 6.4 geo_mean and kl_cov, 6.5 vespo, 6.6
  // cispo_clamp, so the plugin announces what the backend computes.
  EXPECT_EQ(got.loss_kinds, want.loss_kinds);
  for (uint32_t bit : {kPolicySequenceBit, kPolicyIsRatioBit, kPolicyKlEstimatorBit,
                       kPolicyEntropyBit, kPolicyAggregationBit, kPolicyGpgBit,
                       kDistillWeightsBit, kPolicyGeoMeanBit, kPolicyKlCovBit,
                       kPolicyVespoBit, kPolicyCispoClampBit}) {
    EXPECT_NE(got.loss_kinds & bit, 0u) << "bit " << bit << " not announced";
  }
  HostMemory* m = plugin_->host_memory();
  ASSERT_NE(m, nullptr);
  void* p = m->Allocate(1 << 20);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, 1 << 20);
  m->Free(p);
}

TEST_F(PluginComputeTest, WorkspaceBytesAreTheBackendsOwn) {
  for (GradOut dw : {GradOut::kNone, GradOut::kWritten, GradOut::kAccumulated}) {
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      const WorkspaceShape s = BiasedShape(8192, 4096, 128256, dtype, dw);
      EXPECT_EQ(plugin_->WorkspaceBytes(s), direct_->WorkspaceBytes(s));
    }
  }
}

TEST_F(PluginComputeTest, ComputeIsTheDirectBackendsBitForBit) {
  uint64_t seed = 90;
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (Reduction reduction : {Reduction::kMean, Reduction::kNone}) {
      for (bool resident : {false, true}) {
        const bool grad_f32 = resident && dtype != DType::kF32;
        const RandomProblem rp = RandomProblem::Make(
            SpecOf(300, 256, 5000, dtype, CombinedOptions(reduction, 64, grad_f32), 1.0f, ++seed));
        const LossProblem p = rp.problem();
        const DType g = grad_f32 ? DType::kF32 : dtype;
        HostOutputs want(p, g, true, resident), got(p, g, true, resident);
        ProblemForBoth both;  // W (then the bias) in each backend's device memory when resident
        ASSERT_TRUE(PlaceForBoth(*direct_, *plugin_, p, resident, &both).ok());
        LossStats want_stats, got_stats;
        const std::string where = absl::StrCat(DTypeName(dtype), " reduction ",
                                               static_cast<int>(reduction), " resident ", resident);
        ASSERT_TRUE(direct_->Compute(both.direct, want.outputs(), &want_stats).ok()) << where;
        const absl::Status st = plugin_->Compute(both.plugin, got.outputs(), &got_stats);
        ASSERT_TRUE(st.ok()) << where << ": " << st;
        EXPECT_TRUE(BitIdentical(want, got)) << where;
        ExpectSameStats(got_stats, want_stats, where);
      }
    }
  }
}

// The options ABI 6.3 added, through the table: verl's menu (row_loss_test_cases.h's cases
// 15-18), sequence-level importance sampling, is_ratio, and distill's weights (19, 20) give the
// direct backend's bits.
TEST_F(PluginComputeTest, PolicyOptionsCrossBitForBit) {
  const cuda::Shape& shape = cuda::kShapes[2];  // 300 rows: 4 sequences
  std::vector<float> rho;
  for (int k = 15; k < cuda::kNumCases; ++k) {
    for (const bool sequence : {false, true}) {
      const cuda::RowCase& c = cuda::kCases[k];
      const bool policy = c.kind == LossKind::kPolicy;
      if (sequence && (!policy || !PolicyLossTypeClips(c.loss_type))) continue;
      cuda::RowProblem rp = cuda::MakeProblem(c, shape, DType::kBF16, 300 + k);
      LossProblem& p = rp.p;
      rho.assign(p.bt, 0.0f);
      for (int64_t i = 0; i < p.bt; ++i) rho[i] = 0.25f + 0.125f * static_cast<float>(i % 13);
      if (policy) p.is_ratio = rho.data();
      if (sequence) p.policy.importance_sampling = ImportanceSampling::kSequence;
      const DType g = c.grad_f32 ? DType::kF32 : DType::kBF16;
      cuda::RowOutputs want(p, g, c.accumulate), got(p, g, c.accumulate);
      const std::string where = absl::StrCat(c.name, sequence ? " sequence" : " token");
      LossStats want_stats, got_stats;
      ASSERT_TRUE(direct_->Compute(p, want.outputs(p.kind), &want_stats).ok()) << where;
      const absl::Status st = plugin_->Compute(p, got.outputs(p.kind), &got_stats);
      ASSERT_TRUE(st.ok()) << where << ": " << st;
      EXPECT_TRUE(BitIdentical(want.base, got.base)) << where;
      if (policy) {
        EXPECT_EQ(std::memcmp(want.logp.data(), got.logp.data(), p.bt * 4), 0) << where;
        EXPECT_EQ(std::memcmp(&want.kl, &got.kl, 4), 0) << where;
        EXPECT_EQ(std::memcmp(&want.clip_fraction, &got.clip_fraction, 4), 0) << where;
        EXPECT_FALSE(std::isnan(want.kl)) << where;
      }
      EXPECT_FALSE(std::isnan(want.base.loss[0])) << where;
      ExpectSameStats(got_stats, want_stats, where);
    }
  }
}

TEST_F(PluginComputeTest, OverlappedComputeCrossesTheRowStream) {
  const RandomProblem rp = RandomProblem::Make(
      SpecOf(300, 256, 5000, DType::kBF16, CombinedOptions(Reduction::kMean, 64), 1.0f, 7));
  const LossProblem whole = rp.problem();
  HostOutputs want(whole, DType::kBF16), got(whole, DType::kBF16);
  ASSERT_TRUE(direct_->Compute(whole, want.outputs(), nullptr).ok());
  TrickleRows rows(whole, TrickleRows::Spec{});
  const LossProblem streamed = rows.Streamed(whole);
  const absl::Status st = plugin_->Compute(streamed, got.outputs(), nullptr);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(BitIdentical(want, got));
  EXPECT_TRUE(rows.CallsAreValid(whole.bt, 5));  // 300 rows in chunks of 64
}

TEST_F(PluginComputeTest, FailedRowWaitAndRefusalsCrossBack) {
  RandomProblem rp = RandomProblem::Make(
      SpecOf(300, 256, 5000, DType::kBF16, CombinedOptions(Reduction::kMean, 64), 1.0f, 8));
  ExpectComputeEndsWithTheFailedWait(
      [&](const LossProblem& p, const LossOutputs& out) {
        return plugin_->Compute(p, out, nullptr);
      },
      rp.problem(), absl::CancelledError("test: the sender went away"), 100);
  // A backend assumes a validated problem (core/loss_problem_check.h): the error that crosses
  // back word for word is one a valid problem meets during the Compute, its rows refused.
  ExpectRowsRefusalCrossesBack(*direct_, *plugin_, rp.problem());
}

}  // namespace
}  // namespace lossd
