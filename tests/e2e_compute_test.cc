// SPDX-License-Identifier: Apache-2.0
// End to end over real gRPC on loopback, valid requests: a lossd server in this process (CPU
// backend) and raw wire clients; every result is compared with the float64 reference, bit for
// bit where the design promises it (weights by handle, accumulation, the same request twice).
// Refusals live in e2e_bad_input_test, limits in e2e_limits_test, cancellation in
// e2e_cancel_test; all share e2e_fixture.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"
#include "tests/e2e_fixture.h"
#include "tests/health_status.h"

namespace lossd {
namespace {

struct E2eCase {
  const char* name;
  DType dtype;
  Reduction reduction;
  bool bias, class_weights;
  float label_smoothing, z_loss, softcap;
  bool token_scaling = false;
};

class E2eOptionsTest : public ::testing::TestWithParam<E2eCase> {};

TEST_P(E2eOptionsTest, InlineWeightsMatchTheReference) {
  static Harness* h = new Harness();
  const E2eCase& c = GetParam();
  RandomProblemSpec s = SmallSpec(c.dtype, 7);
  s.options.reduction = c.reduction;
  s.options.label_smoothing = c.label_smoothing;
  s.options.z_loss_scale = c.z_loss;
  s.options.softcap = c.softcap;
  s.options.token_scaling = c.token_scaling;
  s.bias = c.bias;
  s.class_weights = c.class_weights;
  s.grad_output = c.reduction == Reduction::kNone;
  RandomProblem rp = RandomProblem::Make(s);
  ComputeReply r = RunCompute(h->stub(), HeaderFor(rp), PartsFor(rp, 4096));
  EXPECT_TRUE(ReplyMatchesReference(rp, r, c.dtype));
  EXPECT_EQ(r.summary.backend(), "cpu");
}

INSTANTIATE_TEST_SUITE_P(
    Options, E2eOptionsTest,
    ::testing::Values(
        E2eCase{"bf16_mean", DType::kBF16, Reduction::kMean, false, false, 0, 0, 0},
        E2eCase{"fp16_sum_bias", DType::kF16, Reduction::kSum, true, false, 0, 0, 0},
        E2eCase{"fp32_none", DType::kF32, Reduction::kNone, false, false, 0, 0, 0},
        E2eCase{"bf16_all_options", DType::kBF16, Reduction::kMean, true, true, 0.1f, 1e-3f,
                15.0f},
        E2eCase{"fp32_smooth_weights_none", DType::kF32, Reduction::kNone, true, true, 0.2f,
                1e-2f, 0},
        // LossOptions.token_scaling travels and is honoured (ServerInfo lists it).
        E2eCase{"bf16_token_scaling_all_options", DType::kBF16, Reduction::kMean, true, true,
                0.1f, 1e-3f, 15.0f, true},
        E2eCase{"fp32_token_scaling_none", DType::kF32, Reduction::kNone, true, false, 0,
                1e-2f, 0, true}),
    [](const ::testing::TestParamInfo<E2eCase>& i) { return std::string(i.param.name); });

TEST_F(E2eTest, WeightsByHandleGiveTheSameBitsAsInline) {
  RandomProblemSpec s = SmallSpec(DType::kBF16, 3);
  s.bias = true;
  RandomProblem rp = RandomProblem::Make(s);
  std::string handle;
  grpc::Status put = testing_harness::PutWeights(h_->stub(), rp, 1000, &handle);
  ASSERT_TRUE(put.ok()) << put.error_message();
  ASSERT_FALSE(handle.empty());
  ComputeReply by_handle =
      RunCompute(h_->stub(), HeaderFor(rp, handle), PartsFor(rp, 4096, false));
  ComputeReply inline_w = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 4096));
  ASSERT_TRUE(ReplyMatchesReference(rp, by_handle, s.dtype));
  ASSERT_TRUE(inline_w.status.ok());
  EXPECT_EQ(by_handle.summary.loss(), inline_w.summary.loss());
  for (const auto& [id, bytes] : inline_w.tensors) {
    EXPECT_EQ(bytes, by_handle.tensors[id]) << "tensor " << v1::TensorId_Name(static_cast<v1::TensorId>(id));
  }
  // Dropped handles are gone, with a message that says so.
  grpc::ClientContext ctx;
  v1::DropWeightsRequest drop;
  drop.set_handle(handle);
  v1::DropWeightsResponse dropped;
  ASSERT_TRUE(h_->stub().DropWeights(&ctx, drop, &dropped).ok());
  ComputeReply after = RunCompute(h_->stub(), HeaderFor(rp, handle), PartsFor(rp, 4096, false));
  EXPECT_EQ(after.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(after.status.error_message().find("was dropped"), std::string::npos)
      << after.status.error_message();
}

TEST_F(E2eTest, FourAccumulatedMicroBatchesEqualOneBatchFourTimesAsLarge) {
  RandomProblemSpec big = SmallSpec(DType::kBF16, 11);
  big.bt = 4 * 24;
  big.bias = true;
  big.options.reduction = Reduction::kSum;
  RandomProblem whole = RandomProblem::Make(big);
  std::string handle;
  ASSERT_TRUE(testing_harness::PutWeights(h_->stub(), whole, 1 << 20, &handle).ok());

  // The whole batch, inline, with fp32 gradients.
  v1::ComputeHeader hw = HeaderFor(whole);
  hw.mutable_options()->set_grad_dtype(v1::DTYPE_FP32);
  ComputeReply ref = RunCompute(h_->stub(), hw, PartsFor(whole, 1 << 20));
  ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
  // The whole batch is right by the float64 reference, so the sum below is checked against a
  // right answer and not just against the server itself.
  ASSERT_TRUE(ReplyMatchesReference(whole, ref, DType::kF32));

  const int64_t rows = big.bt / 4;
  const size_t xrow = big.h * DTypeSize(big.dtype);
  for (int k = 0; k < 4; ++k) {
    RandomProblemSpec ms = big;
    ms.bt = rows;
    RandomProblem micro = RandomProblem::Make(ms);
    micro.x.assign(whole.x.begin() + k * rows * xrow, whole.x.begin() + (k + 1) * rows * xrow);
    micro.targets.assign(whole.targets.begin() + k * rows, whole.targets.begin() + (k + 1) * rows);
    micro.w = whole.w;
    micro.bias = whole.bias;
    v1::ComputeHeader hm = HeaderFor(micro, handle);
    hm.set_accumulator("step-1");
    ComputeReply r = RunCompute(h_->stub(), hm, PartsFor(micro, 1 << 20, false));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.summary.accumulated_micro_batches(), static_cast<uint64_t>(k + 1));
    EXPECT_EQ(r.tensors.count(v1::TENSOR_DW), 0u) << "dW must stay on the server";
  }
  grpc::ClientContext ctx;
  v1::FetchGradientsRequest fr;
  fr.set_accumulator("step-1");
  fr.set_reset(true);
  fr.set_response_part_bytes(3000);  // many parts
  auto reader = h_->stub().FetchGradients(&ctx, fr);
  v1::FetchGradientsResponse msg;
  std::vector<uint8_t> dw(big.v * big.h * 4, 0xFF), db(big.v * 4, 0xFF);
  v1::GradientsHeader header;
  while (reader->Read(&msg)) {
    if (msg.has_header()) {
      header = msg.header();
      continue;
    }
    auto& dst = msg.part().tensor() == v1::TENSOR_DW ? dw : db;
    ASSERT_LE(msg.part().offset() + msg.part().data().size(), dst.size());
    std::memcpy(dst.data() + msg.part().offset(), msg.part().data().data(),
                msg.part().data().size());
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(header.micro_batches(), 4u);
  EXPECT_EQ(header.tokens(), ref.summary.tokens());
  // Same sums in another order: equal up to fp32 rounding of the dW summation.
  std::vector<double> want_dw = Widen(ref.tensors[v1::TENSOR_DW].data(), DType::kF32, big.v * big.h);
  std::vector<double> got_dw = Widen(dw.data(), DType::kF32, big.v * big.h);
  CompareResult c = CompareRelNorm("dw", want_dw, got_dw, 1e-5);
  EXPECT_TRUE(c.ok()) << c.ToString();
  CompareResult cb = CompareRelNorm("db", Widen(ref.tensors[v1::TENSOR_DB].data(), DType::kF32, big.v),
                                    Widen(db.data(), DType::kF32, big.v), 1e-5);
  EXPECT_TRUE(cb.ok()) << cb.ToString();

  // reset zeroed it: the next fetch has no micro-batches.
  grpc::ClientContext ctx2;
  auto again = h_->stub().FetchGradients(&ctx2, fr);
  ASSERT_TRUE(again->Read(&msg));
  EXPECT_EQ(msg.header().micro_batches(), 0u);
  while (again->Read(&msg)) {
  }
  EXPECT_TRUE(again->Finish().ok());
}

TEST_F(E2eTest, ATensorFarLargerThanOneMessageTravelsInManyParts) {
  // A small part size makes "far larger than the message limit" cheap: W is 4000 parts (and
  // dW comes back in 1000, the smallest response parts a client may ask for).
  const RandomProblemSpec s = WideSpec(DType::kF32, 5, 64, 4000);
  RandomProblem rp = RandomProblem::Make(s);
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 256);
  ASSERT_GT(parts.size(), 4000u);
  v1::ComputeHeader header = HeaderFor(rp);
  header.set_response_part_bytes(1024);
  ComputeReply small = RunCompute(h_->stub(), header, parts);
  ASSERT_TRUE(ReplyMatchesReference(rp, small, s.dtype));
  ComputeReply large = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 4 << 20));
  ASSERT_TRUE(large.status.ok());
  EXPECT_EQ(small.tensors, large.tensors);
}

TEST_F(E2eTest, TheSameRequestTwiceGivesBitIdenticalOutputs) {
  RandomProblemSpec s = WideSpec(DType::kBF16, 8, 64, 1000);
  s.bt = 70;
  RandomProblem rp = RandomProblem::Make(s);
  ComputeReply a = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 16));
  ComputeReply b = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 16));
  ASSERT_TRUE(a.status.ok() && b.status.ok());
  const float la = a.summary.loss(), lb = b.summary.loss();
  EXPECT_EQ(std::memcmp(&la, &lb, 4), 0);
  EXPECT_EQ(a.tensors, b.tensors);
}

TEST_F(E2eTest, ServerInfoDescribesTheServer) {
  grpc::ClientContext ctx;
  v1::ServerInfoResponse info;
  ASSERT_TRUE(h_->stub().ServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.backend(), "cpu");
  EXPECT_EQ(info.compute_path(), "cpu");  // the CPU backend's BackendInfo, field 17
  EXPECT_FALSE(info.instance().empty());
  EXPECT_EQ(info.memory_budget_bytes(), h_->engine().options().memory_budget_bytes);
  EXPECT_GT(info.max_part_bytes(), 0u);
  EXPECT_NE(std::find(info.features().begin(), info.features().end(), "token_scaling"),
            info.features().end());
}

TEST_F(E2eTest, HealthCheckSaysServing) { EXPECT_EQ(HealthStatus(h_->channel()), 1); }

// ---------------------------------------------------------------------------------------

TEST_F(E2eTest, MetricsPageShowsTheCountersMoved) {
  const std::string before = h_->ScrapeMetrics();
  const double ok0 = std::max(0.0, MetricValue(before, "lossd_requests_total",
                                               R"(code="OK",method="Compute")"));
  const double bad0 = std::max(0.0, MetricValue(before, "lossd_requests_total",
                                                R"(code="INVALID_ARGUMENT",method="Compute")"));
  const double tokens0 = std::max(0.0, MetricValue(before, "lossd_tokens_total"));
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 31));
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20)).status.ok());
  }
  ASSERT_FALSE(RunCompute(h_->stub(), std::vector<v1::ComputeRequest>{}).status.ok());
  const std::string after = h_->ScrapeMetrics();
  EXPECT_EQ(MetricValue(after, "lossd_requests_total", R"(code="OK",method="Compute")"), ok0 + 3);
  EXPECT_EQ(MetricValue(after, "lossd_requests_total",
                        R"(code="INVALID_ARGUMENT",method="Compute")"),
            bad0 + 1);
  int64_t tokens = 0;
  for (int64_t t : rp.targets) tokens += t != -100;
  EXPECT_EQ(MetricValue(after, "lossd_tokens_total"), tokens0 + 3 * tokens);
  EXPECT_GT(MetricValue(after, "lossd_bytes_received_total"), 0);
  EXPECT_GT(MetricValue(after, "lossd_request_duration_seconds_count",
                        R"(method="Compute",phase="compute")"),
            0);
  EXPECT_EQ(MetricValue(after, "lossd_requests_in_flight"), 0);
}

}  // namespace
}  // namespace lossd
