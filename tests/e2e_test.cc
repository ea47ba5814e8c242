// End to end over real gRPC on loopback: a lossd server in this process (CPU backend) and raw
// wire clients. Every result is compared with the float64 reference; every refusal is checked
// for its exact code and a message naming the field and the values, and the server must
// answer a valid request afterwards.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <condition_variable>
#include <mutex>

#include <grpcpp/generic/generic_stub.h>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "testing/test_util.h"
#include "testing/server_harness.h"

namespace lossd {
namespace {

using testing_harness::ComputeReply;
using testing_harness::Harness;
using testing_harness::HarnessOptions;
using testing_harness::HeaderFor;
using testing_harness::HealthStatus;
using testing_harness::MetricValue;
using testing_harness::PartsFor;
using testing_harness::RunCompute;

RandomProblemSpec SmallSpec(DType dtype = DType::kBF16, uint64_t seed = 1) {
  RandomProblemSpec s;
  s.bt = 47;
  s.h = 31;
  s.v = 123;
  s.dtype = dtype;
  s.seed = seed;
  s.ignore_fraction = 0.1;
  return s;
}

using testing_harness::ReplyMatchesReference;

// A valid request succeeds: used after every refusal to show the server keeps serving.
void ExpectServes(Harness& h) {
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 99));
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_TRUE(std::isfinite(r.summary.loss()));
}

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

class E2eTest : public ::testing::Test {
 protected:
  // Shared by the derived suites too (SetUpTestSuite runs once per suite).
  static void SetUpTestSuite() {
    if (h_ == nullptr) h_ = new Harness();
  }
  static Harness* h_;
};
Harness* E2eTest::h_ = nullptr;

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
  RandomProblemSpec s = SmallSpec(DType::kF32, 5);
  s.v = 4000;
  s.h = 64;
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
  RandomProblemSpec s = SmallSpec(DType::kBF16, 8);
  s.v = 1000;
  s.h = 64;
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
  EXPECT_FALSE(info.instance().empty());
  EXPECT_EQ(info.memory_budget_bytes(), h_->engine().options().memory_budget_bytes);
  EXPECT_GT(info.max_part_bytes(), 0u);
  EXPECT_NE(std::find(info.features().begin(), info.features().end(), "token_scaling"),
            info.features().end());
}

TEST_F(E2eTest, HealthCheckSaysServing) { EXPECT_EQ(HealthStatus(h_->channel()), 1); }

// ---------------------------------------------------------------------------------------
// Bad input: exact code, a message naming the field and the values, and service afterwards.

struct BadCase {
  const char* name;
  grpc::StatusCode code;
  const char* message;
};

class BadInputTest : public E2eTest {
 protected:
  void Expect(const ComputeReply& r, grpc::StatusCode code, const std::string& substring) {
    EXPECT_EQ(r.status.error_code(), code) << r.status.error_message();
    EXPECT_NE(r.status.error_message().find(substring), std::string::npos)
        << "message: " << r.status.error_message() << "\nwanted: " << substring;
    ExpectServes(*h_);
    EXPECT_EQ(h_->WaitForIdleMemory(), 0u) << "a refused request left memory behind";
  }
  RandomProblem Problem() { return RandomProblem::Make(SmallSpec(DType::kBF16, 21)); }
};

TEST_F(BadInputTest, HiddenSizeMismatch) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.mutable_w()->set_shape(1, 30);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "w.shape [123, 30] must be (V, H) with H = x.shape[1] = 31");
}

TEST_F(BadInputTest, TargetsOfTheWrongLength) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.mutable_targets()->set_shape(0, 46);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "targets.shape [46] must be (BT) = [47]");
}

TEST_F(BadInputTest, UnknownDType) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.mutable_x()->set_dtype(static_cast<v1::DType>(17));
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "header.x.dtype 17 is not a known dtype");
}

TEST_F(BadInputTest, MixedDTypes) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.mutable_w()->set_dtype(v1::DTYPE_FP16);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "w.dtype fp16 differs from x.dtype bf16");
}

TEST_F(BadInputTest, APartRunsPastItsShape) {
  RandomProblem rp = Problem();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1 << 20);
  parts[0].mutable_part()->mutable_data()->append("xx");
  Expect(RunCompute(h_->stub(), HeaderFor(rp), parts), grpc::StatusCode::INVALID_ARGUMENT,
         "a part of x at offset 0 with 2916 bytes runs past the 2914 bytes");
}

TEST_F(BadInputTest, TargetOutsideTheVocabulary) {
  RandomProblem rp = Problem();
  rp.targets[5] = 123;
  Expect(RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20)),
         grpc::StatusCode::INVALID_ARGUMENT,
         "targets[5] = 123 is outside [0, V=123) and is not ignore_index (-100)");
}

TEST_F(BadInputTest, NegativeTargetThatIsNotIgnoreIndex) {
  RandomProblem rp = Problem();
  rp.targets[0] = -1;
  Expect(RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20)),
         grpc::StatusCode::INVALID_ARGUMENT, "targets[0] = -1 is outside [0, V=123)");
}

TEST_F(BadInputTest, NaNInX) {
  RandomProblem rp = Problem();
  reinterpret_cast<uint16_t*>(rp.x.data())[2 * 31 + 4] = 0x7fc0;  // bf16 NaN at [2, 4]
  Expect(RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20)),
         grpc::StatusCode::INVALID_ARGUMENT, "x contains a non-finite value (nan) at [2, 4]");
}

TEST_F(BadInputTest, InfInW) {
  RandomProblem rp = Problem();
  reinterpret_cast<uint16_t*>(rp.w.data())[31 * 10 + 3] = 0x7f80;  // bf16 +inf at [10, 3]
  Expect(RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20)),
         grpc::StatusCode::INVALID_ARGUMENT, "w contains a non-finite value (inf) at [10, 3]");
}

TEST_F(BadInputTest, HeaderMissing) {
  RandomProblem rp = Problem();
  Expect(RunCompute(h_->stub(), PartsFor(rp, 1 << 20)), grpc::StatusCode::INVALID_ARGUMENT,
         "the first message of a Compute stream must be a header, got a part of TENSOR_X");
}

TEST_F(BadInputTest, HeaderRepeated) {
  RandomProblem rp = Problem();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1 << 20);
  v1::ComputeRequest again;
  *again.mutable_header() = HeaderFor(rp);
  parts.insert(parts.begin() + 1, again);
  Expect(RunCompute(h_->stub(), HeaderFor(rp), parts), grpc::StatusCode::INVALID_ARGUMENT,
         "the Compute stream carries a second header");
}

TEST_F(BadInputTest, PartsOutOfOrder) {
  RandomProblem rp = Problem();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1000);
  std::swap(parts[0], parts[1]);  // x: offset 1000 arrives first
  Expect(RunCompute(h_->stub(), HeaderFor(rp), parts), grpc::StatusCode::INVALID_ARGUMENT,
         "a part of x starts at byte offset 1000 but 0 bytes of it were received");
}

TEST_F(BadInputTest, PartsOverlapping) {
  RandomProblem rp = Problem();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1000);
  parts[1].mutable_part()->set_offset(500);
  Expect(RunCompute(h_->stub(), HeaderFor(rp), parts), grpc::StatusCode::INVALID_ARGUMENT,
         "a part of x starts at byte offset 500 but 1000 bytes of it were received");
}

TEST_F(BadInputTest, PartMissingAndStreamClosedEarly) {
  RandomProblem rp = Problem();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1000);
  parts.pop_back();  // the last part of targets
  Expect(RunCompute(h_->stub(), HeaderFor(rp), parts), grpc::StatusCode::INVALID_ARGUMENT,
         "the Compute stream closed early: targets has 0 of its 376 bytes");
}

TEST_F(BadInputTest, StreamClosedBeforeTheHeader) {
  Expect(RunCompute(h_->stub(), std::vector<v1::ComputeRequest>{}),
         grpc::StatusCode::INVALID_ARGUMENT, "the Compute stream closed before its header");
}

TEST_F(BadInputTest, APartOfATensorTheHeaderDoesNotSend) {
  RandomProblem rp = Problem();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1 << 20);
  parts[0].mutable_part()->set_tensor(v1::TENSOR_BIAS);
  Expect(RunCompute(h_->stub(), HeaderFor(rp), parts), grpc::StatusCode::INVALID_ARGUMENT,
         "a part of bias arrived but the header does not send bias inline");
}

TEST_F(BadInputTest, APartOfAnOutputTensor) {
  RandomProblem rp = Problem();
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 1 << 20);
  parts[0].mutable_part()->set_tensor(v1::TENSOR_DX);
  Expect(RunCompute(h_->stub(), HeaderFor(rp), parts), grpc::StatusCode::INVALID_ARGUMENT,
         "part.tensor TENSOR_DX is not an input tensor of Compute");
}

TEST_F(BadInputTest, UnknownHandle) {
  RandomProblem rp = Problem();
  Expect(RunCompute(h_->stub(), HeaderFor(rp, "no-such-handle"), {}),
         grpc::StatusCode::NOT_FOUND, "weight handle 'no-such-handle' not found");
}

TEST_F(BadInputTest, HandleFromAnotherServerInstance) {
  RandomProblem rp = Problem();
  Expect(RunCompute(h_->stub(), HeaderFor(rp, "w-deadbeef-1"), {}),
         grpc::StatusCode::NOT_FOUND, "belongs to another server instance");
}

// Ids longer than any the server issues are refused with their length, not echoed whole
// (a megabyte of handle in a status message would not reach the client as itself).
TEST_F(BadInputTest, IdsLongerThanAnyIssuedAreRefusedWithTheirLength) {
  RandomProblem rp = Problem();
  const std::string huge(1 << 20, 'w');
  // A Compute header of a megabyte is refused by its size (ShapesOfAnyRank...): the ids in
  // one are as long as a header may hold.
  const std::string long_id(60000, 'w');
  Expect(RunCompute(h_->stub(), HeaderFor(rp, long_id), {}), grpc::StatusCode::INVALID_ARGUMENT,
         "header.weight_handle is 60000 characters long, more than any issued (128)");
  v1::ComputeHeader h = HeaderFor(rp);
  h.set_accumulator("long-instance");
  h.set_accumulator_instance(long_id);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "header.accumulator_instance is 60000 characters long, more than any issued (128)");
  {
    grpc::ClientContext ctx;
    v1::DropWeightsRequest req;
    req.set_handle(huge);
    v1::DropWeightsResponse resp;
    grpc::Status st = h_->stub().DropWeights(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find("handle is 1048576 characters long"), std::string::npos)
        << st.error_message();
  }
  h.clear_accumulator_instance();
  ASSERT_TRUE(RunCompute(h_->stub(), h, PartsFor(rp, 1 << 20)).status.ok());
  grpc::ClientContext ctx;
  v1::FetchGradientsRequest fr;
  fr.set_accumulator("long-instance");
  fr.set_reset(true);
  fr.set_accumulator_instance(huge);
  auto reader = h_->stub().FetchGradients(&ctx, fr);
  v1::FetchGradientsResponse msg;
  while (reader->Read(&msg)) {
  }
  grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("accumulator_instance is 1048576 characters long"),
            std::string::npos)
      << st.error_message();
  auto g = h_->engine().FetchGradients("long-instance", false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 1u);  // the refused reset fetch reset nothing
  ASSERT_TRUE(h_->engine().DropAccumulator("long-instance").ok());
  ExpectServes(*h_);
}

// A response part of a few bytes would make the server send a message per few bytes (at 1
// byte, 128 KiB of dW took 131k messages and 18 s): refused below 1 KiB, before admission.
TEST_F(BadInputTest, ResponsePartsBelowTheFloorAreRefused) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.set_accumulator("tiny-parts");
  ComputeReply made = RunCompute(h_->stub(), h, PartsFor(rp, 1 << 20));
  ASSERT_TRUE(made.status.ok()) << made.status.error_message();
  for (uint32_t asked : {1u, 1023u}) {
    v1::ComputeHeader tiny = HeaderFor(rp);
    tiny.set_response_part_bytes(asked);
    Expect(RunCompute(h_->stub(), tiny, PartsFor(rp, 1 << 20)),
           grpc::StatusCode::INVALID_ARGUMENT,
           absl::StrCat("header.response_part_bytes must be 0 (the server's default, ",
                        4u << 20, ") or at least 1024, got ", asked));
    grpc::ClientContext ctx;
    v1::FetchGradientsRequest fr;
    fr.set_accumulator("tiny-parts");
    fr.set_response_part_bytes(asked);
    auto reader = h_->stub().FetchGradients(&ctx, fr);
    v1::FetchGradientsResponse msg;
    int messages = 0;
    while (reader->Read(&msg)) ++messages;
    const grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find(absl::StrCat(
                  "response_part_bytes must be 0 (the server's default, ", 4u << 20,
                  ") or at least 1024, got ", asked)),
              std::string::npos)
        << st.error_message();
    EXPECT_EQ(messages, 0);
  }
  v1::ComputeHeader floor = HeaderFor(rp);
  floor.set_response_part_bytes(1024);
  EXPECT_TRUE(RunCompute(h_->stub(), floor, PartsFor(rp, 1 << 20)).status.ok());
}

// A refusal never grows with what the client sent: a shape of any rank is echoed as its first
// dimensions and its rank (a 200k-dim x.shape made a 600k-character status, which a client
// with default channel options received as RESOURCE_EXHAUSTED), and a header too large to be
// one is refused by its size before it is parsed.
TEST_F(BadInputTest, ShapesOfAnyRankAreEchoedWithinABound) {
  RandomProblem rp = Problem();
  auto with_x_dims = [&](int dims) {
    v1::ComputeHeader h = HeaderFor(rp);
    h.mutable_x()->clear_shape();
    for (int i = 0; i < dims; ++i) h.mutable_x()->add_shape(1);
    return RunCompute(h_->stub(), h, {});
  };
  ComputeReply ranked = with_x_dims(10000);  // a 10 KB header
  EXPECT_LE(ranked.status.error_message().size(), 1024u);
  Expect(ranked, grpc::StatusCode::INVALID_ARGUMENT,
         "x.shape must have 2 dimensions, got [1, 1, 1, 1, 1, 1, 1, 1, ... (10000 dims)]");
  ComputeReply huge = with_x_dims(200000);  // a 200 KB header
  EXPECT_LE(huge.status.error_message().size(), 1024u);
  Expect(huge, grpc::StatusCode::INVALID_ARGUMENT,
         "the Compute header is 200059 bytes, more than the 65536 a header may have");
}

// A PutWeights header is bounded like a Compute header (it too holds shapes and names only).
TEST_F(BadInputTest, APutWeightsHeaderOverTheBoundIsRefusedByItsSize) {
  grpc::ClientContext ctx;
  v1::PutWeightsResponse resp;
  auto writer = h_->stub().PutWeights(&ctx, &resp);
  v1::PutWeightsRequest req;
  req.mutable_header()->mutable_w()->set_dtype(v1::DTYPE_FP32);
  for (int i = 0; i < 100000; ++i) req.mutable_header()->mutable_w()->add_shape(1);
  writer->Write(req);
  writer->WritesDone();
  const grpc::Status st = writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("the PutWeights header is 100010 bytes, more than the 65536 "
                                    "a header may have"),
            std::string::npos)
      << st.error_message();
  ExpectServes(*h_);
}

// A name the client chose is echoed as its start and its length, before its own checks.
TEST_F(BadInputTest, AClientChosenNameIsEchoedWithinABound) {
  grpc::ClientContext ctx;
  v1::FetchGradientsRequest fr;
  fr.set_accumulator(std::string(1 << 20, 'a'));
  fr.set_accumulator_instance("0000abcd");
  auto reader = h_->stub().FetchGradients(&ctx, fr);
  v1::FetchGradientsResponse msg;
  while (reader->Read(&msg)) {
  }
  const grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_LE(st.error_message().size(), 1024u);
  EXPECT_NE(st.error_message().find("accumulator '" + std::string(64, 'a') +
                                    "... (1048576 bytes)' began on another server instance"),
            std::string::npos)
      << st.error_message();
  ExpectServes(*h_);
}

// Request metadata is bounded by the server (8 KiB): a call with a 4 MiB header value is
// refused by gRPC with RESOURCE_EXHAUSTED, and the server serves the next call.
TEST_F(BadInputTest, MetadataOverTheLimitIsRefused) {
  auto stub = h_->NewStub(grpc::InsecureChannelCredentials());
  for (size_t bytes : {size_t{9000}, size_t{4} << 20}) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-big", std::string(bytes, 'q'));
    v1::ServerInfoResponse r;
    const grpc::Status st = stub->ServerInfo(&ctx, v1::ServerInfoRequest(), &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
    EXPECT_NE(st.error_message().find("metadata size exceeds limit"), std::string::npos)
        << st.error_message();
  }
  grpc::ClientContext ctx;
  ctx.AddMetadata("x-small", std::string(4000, 'q'));
  v1::ServerInfoResponse r;
  EXPECT_TRUE(h_->stub().ServerInfo(&ctx, v1::ServerInfoRequest(), &r).ok());
  ExpectServes(*h_);
}

TEST_F(BadInputTest, OptionsOutOfRange) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.mutable_options()->set_label_smoothing(1.5f);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "options.label_smoothing must be in [0, 1], got 1.5");
  h = HeaderFor(rp);
  h.mutable_options()->set_softcap(-2.0f);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "options.softcap must be finite and >= 0 (0 = off), got -2");
  h = HeaderFor(rp);
  *h.mutable_grad_output() = h.targets();
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "grad_output is only accepted with reduction none");
  // The converse: grad_scale would be ignored with reduction none, so it is refused.
  h = HeaderFor(rp);
  h.mutable_options()->set_reduction(v1::REDUCTION_NONE);
  h.mutable_options()->set_grad_scale(0.5f);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "options.grad_scale 0.5 applies to reduction mean and sum; with reduction none scale "
         "grad_output");
  // A chunk plan of more chunks than a compute should hold the device for, refused at the
  // header (its shapes alone), before any tensor bytes.
  h = HeaderFor(rp);
  h.mutable_options()->set_chunk_rows(2);
  h.mutable_x()->set_shape(0, 10000);
  h.mutable_targets()->set_shape(0, 10000);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "options.chunk_rows 2 splits BT=10000 rows into 5000 chunks; at most 4096 are served "
         "(chunk_rows >= 3 here, or 0 to let the server choose)");
  h = HeaderFor(rp);
  h.mutable_options()->set_grad_dtype(static_cast<v1::DType>(77));
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "header.options.grad_dtype 77 must be DTYPE_UNSPECIFIED");
}

TEST_F(BadInputTest, AccumulatorShapeMismatch) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.set_accumulator("shape-check");
  ASSERT_TRUE(RunCompute(h_->stub(), h, PartsFor(rp, 1 << 20)).status.ok());
  RandomProblemSpec other = SmallSpec(DType::kBF16, 22);
  other.v = 100;
  RandomProblem rp2 = RandomProblem::Make(other);
  v1::ComputeHeader h2 = HeaderFor(rp2);
  h2.set_accumulator("shape-check");
  Expect(RunCompute(h_->stub(), h2, PartsFor(rp2, 1 << 20)), grpc::StatusCode::INVALID_ARGUMENT,
         "accumulator 'shape-check' holds dW of shape (V=123, H=31) without db but this "
         "request has (V=100, H=31)");
  // The header alone is enough to refuse it: the client need not send X and W first.
  Expect(RunCompute(h_->stub(), h2, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "accumulator 'shape-check' holds dW of shape (V=123, H=31) without db but this "
         "request has (V=100, H=31)");
}

// An accumulator belongs to one server instance. A Compute or fetch that names the instance
// it expects is refused by any other (another replica, a restarted server) before anything is
// added or reset, and the sum it expected stays whole where it is.
TEST_F(BadInputTest, AccumulatorOfAnotherServerInstance) {
  RandomProblem rp = Problem();
  v1::ComputeHeader h = HeaderFor(rp);
  h.set_accumulator("instance-check");
  ComputeReply first = RunCompute(h_->stub(), h, PartsFor(rp, 1 << 20));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  const std::string instance = first.summary.instance();
  ASSERT_FALSE(instance.empty());
  h.set_accumulator_instance(instance);
  ComputeReply second = RunCompute(h_->stub(), h, PartsFor(rp, 1 << 20));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  EXPECT_EQ(second.summary.accumulated_micro_batches(), 2u);
  EXPECT_EQ(second.summary.instance(), instance);

  h.set_accumulator_instance("elsewhere-7");
  const std::string refused = "header.accumulator_instance 'elsewhere-7' is not this server "
                              "(instance '" + instance + "'): accumulator 'instance-check' "
                              "began on another server instance";
  Expect(RunCompute(h_->stub(), h, PartsFor(rp, 1 << 20)),
         grpc::StatusCode::FAILED_PRECONDITION, refused);
  Expect(RunCompute(h_->stub(), h, {}), grpc::StatusCode::FAILED_PRECONDITION, refused);
  v1::ComputeHeader bare = HeaderFor(rp);
  bare.set_accumulator_instance(instance);
  Expect(RunCompute(h_->stub(), bare, {}), grpc::StatusCode::INVALID_ARGUMENT,
         "header.accumulator_instance is set but header.accumulator is not");

  // A reset fetch expecting another instance is refused and resets nothing.
  auto fetch = [&](const std::string& expect, bool reset, v1::GradientsHeader* header) {
    grpc::ClientContext ctx;
    v1::FetchGradientsRequest fr;
    fr.set_accumulator("instance-check");
    fr.set_reset(reset);
    fr.set_accumulator_instance(expect);
    auto reader = h_->stub().FetchGradients(&ctx, fr);
    v1::FetchGradientsResponse msg;
    while (reader->Read(&msg)) {
      if (msg.has_header()) *header = msg.header();
    }
    return reader->Finish();
  };
  v1::GradientsHeader header;
  grpc::Status st = fetch("elsewhere-7", true, &header);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(st.error_message().find("accumulator_instance 'elsewhere-7' is not this server"),
            std::string::npos)
      << st.error_message();
  st = fetch(instance, false, &header);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(header.micro_batches(), 2u);  // the two Computes above, and nothing more
  EXPECT_EQ(header.instance(), instance);
  ExpectServes(*h_);
}

TEST(AccumulatorLimitTest, ANewAccumulatorOverTheLimitsIsRefusedAtTheHeader) {
  HarnessOptions o;
  o.engine.max_accumulators = 1;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 23));
  v1::ComputeHeader first = HeaderFor(rp);
  first.set_accumulator("only-one");
  ASSERT_TRUE(RunCompute(h.stub(), first, PartsFor(rp, 1 << 20)).status.ok());
  v1::ComputeHeader second = HeaderFor(rp);
  second.set_accumulator("one-too-many");
  ComputeReply r = RunCompute(h.stub(), second, {});  // no tensors sent
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(r.status.error_message().find("cannot create accumulator 'one-too-many': 1 "
                                          "accumulators exist (--max_accumulators=1)"),
            std::string::npos)
      << r.status.error_message();
  ExpectServes(h);
}

TEST(BudgetTest, ARequestOverTheMemoryBudgetIsRefusedAtOnce) {
  HarnessOptions o;
  o.engine.memory_budget_bytes = 200 << 10;  // the small problem fits, W of 512 KB not
  Harness h(o);
  RandomProblemSpec s = SmallSpec(DType::kF32, 2);
  s.v = 2000;
  s.h = 64;  // W alone is 512 KB
  RandomProblem rp = RandomProblem::Make(s);
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), {});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(r.status.error_message().find("more than the whole memory budget of 204800 bytes"),
            std::string::npos)
      << r.status.error_message();
  ExpectServes(h);
}

// FetchGradients' host copy of its range comes out of the memory budget: a range larger than
// the whole budget is refused, ranges that fit are served, and two that do not fit together
// take turns instead of both taking memory.
TEST(BudgetTest, FetchGradientsCopiesComeOutOfTheMemoryBudget) {
  RandomProblemSpec s = SmallSpec(DType::kF32, 5);
  s.v = 1000;
  s.h = 256;  // dW in fp32: 1024000 bytes; a Compute into an accumulator needs about 300 KB
  s.options.reduction = Reduction::kSum;
  RandomProblem rp = RandomProblem::Make(s);
  // The same gradient returned by a server with room for it.
  ComputeReply ref;
  {
    Harness roomy;
    v1::ComputeHeader whole = HeaderFor(rp);
    whole.mutable_options()->set_grad_dtype(v1::DTYPE_FP32);
    ref = RunCompute(roomy.stub(), whole, PartsFor(rp, 1 << 20));
    ASSERT_TRUE(ref.status.ok()) << ref.status.error_message();
  }
  HarnessOptions o;
  o.engine.memory_budget_bytes = 700000;
  Harness h(o);
  std::string handle;
  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), rp, 1 << 20, &handle).ok());
  v1::ComputeHeader acc = HeaderFor(rp, handle);
  acc.set_accumulator("fetch-budget");
  ComputeReply r = RunCompute(h.stub(), acc, PartsFor(rp, 1 << 20, false));
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();

  auto fetch = [&](uint64_t begin, uint64_t end, std::vector<uint8_t>* bytes) {
    grpc::ClientContext ctx;
    v1::FetchGradientsRequest fr;
    fr.set_accumulator("fetch-budget");
    fr.set_range_begin(begin);
    fr.set_range_end(end);
    auto reader = h.stub().FetchGradients(&ctx, fr);
    v1::FetchGradientsResponse msg;
    while (reader->Read(&msg)) {
      if (msg.has_part()) {
        bytes->insert(bytes->end(), msg.part().data().begin(), msg.part().data().end());
      }
    }
    return reader->Finish();
  };
  std::vector<uint8_t> all;
  grpc::Status st = fetch(0, 0, &all);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(st.error_message().find("fetching bytes [0, 1024000) of accumulator 'fetch-budget' "
                                    "needs a host copy of 1024000 bytes, more than the whole "
                                    "memory budget of 700000 bytes"),
            std::string::npos)
      << st.error_message();
  // Two halves at once: 512000 bytes each, so one waits for the other to finish.
  std::vector<uint8_t> lo, hi;
  grpc::Status st_lo, st_hi;
  std::thread t([&] { st_lo = fetch(0, 512000, &lo); });
  st_hi = fetch(512000, 1024000, &hi);
  t.join();
  ASSERT_TRUE(st_lo.ok()) << st_lo.error_message();
  ASSERT_TRUE(st_hi.ok()) << st_hi.error_message();
  // One micro-batch added to zeros: the bits of the same gradient returned in fp32.
  lo.insert(lo.end(), hi.begin(), hi.end());
  EXPECT_EQ(lo, ref.tensors[v1::TENSOR_DW]);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u) << "a fetch left memory reserved";
  ExpectServes(h);
}

// A reset fetch whose client goes away after the first part: the sum it reset is put back
// (the step's gradient is not lost), bit for bit, with its counts.
TEST(FetchResetTest, AResetFetchThatDoesNotArriveIsUndone) {
  RandomProblemSpec s = SmallSpec(DType::kF32, 8);
  s.v = 4096;
  s.h = 1024;  // 16 MiB of fp32 dW: far more than the stream's flow-control window
  s.options.reduction = Reduction::kSum;
  RandomProblem rp = RandomProblem::Make(s);
  Harness h;
  std::string handle;
  ASSERT_TRUE(testing_harness::PutWeights(h.stub(), rp, 1 << 20, &handle).ok());
  v1::ComputeHeader acc = HeaderFor(rp, handle);
  acc.set_accumulator("undo");
  ASSERT_TRUE(RunCompute(h.stub(), acc, PartsFor(rp, 1 << 20, false)).status.ok());
  ASSERT_TRUE(RunCompute(h.stub(), acc, PartsFor(rp, 1 << 20, false)).status.ok());
  auto before = h.engine().FetchGradients("undo", false);
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->micro_batches, 2u);

  grpc::ClientContext ctx;
  v1::FetchGradientsRequest fr;
  fr.set_accumulator("undo");
  fr.set_reset(true);
  fr.set_response_part_bytes(1 << 16);
  auto reader = h.stub().FetchGradients(&ctx, fr);
  v1::FetchGradientsResponse msg;
  ASSERT_TRUE(reader->Read(&msg));
  ASSERT_TRUE(msg.has_header());
  EXPECT_EQ(msg.header().micro_batches(), 2u);
  ctx.TryCancel();  // gone before the parts
  while (reader->Read(&msg)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  // The server finishes the call (and the undo) on its own time: wait for the counts.
  absl::StatusOr<GradientsSnapshot> after;
  for (int i = 0; i < 500; ++i) {
    after = h.engine().FetchGradients("undo", false);
    if (!after.ok() || after->micro_batches != 0) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->micro_batches, 2u);
  EXPECT_EQ(after->tokens, before->tokens);
  ASSERT_EQ(after->end - after->begin, before->end - before->begin);
  EXPECT_EQ(std::memcmp(after->data.get(), before->data.get(), before->end - before->begin), 0);
  ExpectServes(h);
}

TEST(BudgetTest, ARequestOverMaxRequestBytesIsRefused) {
  HarnessOptions o;
  o.engine.max_request_bytes = 10000;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 2));
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), {});
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("more than --max_request_bytes=10000"),
            std::string::npos)
      << r.status.error_message();
}

TEST(DrainTest, ADrainingServerRefusesNewWorkWithUnavailable) {
  Harness h;
  h.engine().Drain();
  RandomProblem rp = RandomProblem::Make(SmallSpec());
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(r.status.error_message().find("draining"), std::string::npos);
}

// ---------------------------------------------------------------------------------------
// Cancellation and deadlines free everything a request holds.

TEST_F(E2eTest, ACancelledStreamLeavesNoMemoryBehind) {
  RandomProblemSpec s = SmallSpec(DType::kF32, 4);
  s.v = 3000;
  s.h = 64;
  RandomProblem rp = RandomProblem::Make(s);
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 4096);
  grpc::ClientContext ctx;
  auto stream = h_->stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));
  for (size_t i = 0; i < parts.size() / 2; ++i) ASSERT_TRUE(stream->Write(parts[i]));
  // The server holds the admitted request now.
  for (int i = 0; i < 200 && h_->engine().budget().in_use() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GT(h_->engine().budget().in_use(), 0u);
  ctx.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  EXPECT_EQ(MetricValue(h_->ScrapeMetrics(), "lossd_memory_in_use_bytes"), 0);
  ExpectServes(*h_);
}

// --stream_idle_timeout: a client that stops sending, with no deadline of its own, loses its
// stream and what it held (its memory reservation here), and the server keeps serving.
TEST(IdleStreamTest, AComputeThatStopsSendingIsCancelledAndFreesItsMemory) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  const std::string labels = R"(code="DEADLINE_EXCEEDED",method="Compute")";
  const double before =
      std::max(0.0, MetricValue(h.ScrapeMetrics(), "lossd_requests_total", labels));
  RandomProblemSpec s = SmallSpec(DType::kF32, 4);
  s.v = 3000;
  s.h = 64;
  RandomProblem rp = RandomProblem::Make(s);
  std::vector<v1::ComputeRequest> parts = PartsFor(rp, 4096);
  grpc::ClientContext ctx;  // no deadline
  auto stream = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));
  // Parts at a pace well inside the timeout keep the stream alive past it.
  const size_t half = parts.size() / 2;
  const absl::Time start = absl::Now();
  for (size_t i = 0; i < half; ++i) {
    ASSERT_TRUE(stream->Write(parts[i]));
    if (i < 8) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_GT(absl::Now() - start, absl::Milliseconds(700));
  EXPECT_GT(h.engine().budget().in_use(), 0u) << "the compute was admitted and is receiving";
  // Then silence, with the stream left open: cancelled by the server.
  v1::ComputeResponse r;
  EXPECT_FALSE(stream->Read(&r));
  const grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED) << st.error_message();
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  EXPECT_EQ(MetricValue(h.ScrapeMetrics(), "lossd_requests_total", labels), before + 1)
      << "the server's own status for the call";
  ExpectServes(h);
}

// A header and nothing else: the same.
TEST(IdleStreamTest, AComputeWithAHeaderAloneIsCancelled) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 6));
  grpc::ClientContext ctx;
  auto stream = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));
  v1::ComputeResponse r;
  EXPECT_FALSE(stream->Read(&r));
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  ExpectServes(h);
}

// A client that stops reading its results: the server's writes wait on flow control, and
// after --stream_idle_timeout without a write taken the call is cancelled and its admitted
// memory given back, while the client still holds the stream (it held 9.6 MB of a 15 MB
// budget past the timeout, so that a second identical call waited and failed).
class StalledReaderTest : public ::testing::TestWithParam<bool> {};

RandomProblem LargeOutputProblem() {
  RandomProblemSpec s = SmallSpec(DType::kF32, 12);
  s.bt = 16;
  s.h = 512;
  s.v = 16384;  // dW is 32 MiB: far more than flow control lets through unread
  return RandomProblem::Make(s);
}

double DeadlineExceeded(Harness& h, const char* method) {
  return std::max(0.0, MetricValue(h.ScrapeMetrics(), "lossd_requests_total",
                                   absl::StrCat(R"(code="DEADLINE_EXCEEDED",method=")", method,
                                                "\"")));
}

// Waits up to `seconds` for `done`; true when it came.
template <typename F>
bool WaitUntil(F done, double seconds = 10) {
  const absl::Time until = absl::Now() + absl::Seconds(seconds);
  while (!done() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  return done();
}

TEST_P(StalledReaderTest, AComputeWhoseClientStopsReadingIsCancelledAndFreesItsMemory) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  const double before = DeadlineExceeded(h, "Compute");
  RandomProblem rp = LargeOutputProblem();
  // Made before the stream opens: the server waits for them no longer than the timeout.
  const std::vector<v1::ComputeRequest> parts = testing_harness::XLast(PartsFor(rp, 1 << 20));
  grpc::ClientContext ctx;  // no deadline
  auto stream = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  header.mutable_header()->set_overlap(GetParam());
  ASSERT_TRUE(stream->Write(header));
  for (const v1::ComputeRequest& part : parts) {
    ASSERT_TRUE(stream->Write(part));
  }
  ASSERT_TRUE(stream->WritesDone());
  ASSERT_TRUE(WaitUntil([&] { return h.engine().budget().in_use() > 0; }))
      << "the compute was never admitted";
  // Nothing is read: the server must let go of the call by itself.
  EXPECT_EQ(h.WaitForIdleMemory(10), 0u) << "a client that stopped reading kept its memory";
  EXPECT_TRUE(WaitUntil([&] { return DeadlineExceeded(h, "Compute") == before + 1; }))
      << "the server's own status";
  v1::ComputeResponse r;
  while (stream->Read(&r)) {
  }
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ExpectServes(h);
}

INSTANTIATE_TEST_SUITE_P(Overlap, StalledReaderTest, ::testing::Bool());

TEST(StalledReaderFetchTest, AFetchWhoseClientStopsReadingIsCancelledAndFreesItsMemory) {
  HarnessOptions o;
  o.service.stream_idle_timeout = absl::Milliseconds(300);
  Harness h(o);
  RandomProblem rp = LargeOutputProblem();
  v1::ComputeHeader hc = HeaderFor(rp);
  hc.set_accumulator("stalled-fetch");
  ASSERT_TRUE(RunCompute(h.stub(), hc, PartsFor(rp, 1 << 20)).status.ok());
  const double before = DeadlineExceeded(h, "FetchGradients");
  grpc::ClientContext ctx;
  v1::FetchGradientsRequest fr;
  fr.set_accumulator("stalled-fetch");
  auto reader = h.stub().FetchGradients(&ctx, fr);
  // The host copy of dW comes out of the memory budget while it is sent.
  ASSERT_TRUE(WaitUntil([&] { return h.engine().budget().in_use() > 0; }))
      << "the fetch was never admitted";
  EXPECT_EQ(h.WaitForIdleMemory(10), 0u) << "a client that stopped reading kept its memory";
  EXPECT_TRUE(WaitUntil([&] { return DeadlineExceeded(h, "FetchGradients") == before + 1; }))
      << "the server's own status";
  v1::FetchGradientsResponse m;
  while (reader->Read(&m)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // Nothing was reset: the whole sum is still there for a client that reads.
  auto g = h.engine().FetchGradients("stalled-fetch", false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 1u);
  ExpectServes(h);
}

TEST_F(E2eTest, ADeadlineThatPassesMidStreamFreesTheRequest) {
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 6));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  auto stream = h_->stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(stream->Write(header));  // then nothing: the deadline passes
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(h_->WaitForIdleMemory(), 0u);
  ExpectServes(*h_);
}

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

namespace lossd {
namespace {

// Found by the PutWeights fuzzer: parts that split an element let a NaN slip past the
// finiteness check. Parts must now hold whole elements.
TEST_F(E2eTest, PutWeightsPartsMustHoldWholeElements) {
  RandomProblemSpec s = SmallSpec(DType::kBF16, 41);
  RandomProblem rp = RandomProblem::Make(s);
  const size_t handles_before = h_->engine().weights().count();
  std::string handle;
  grpc::Status st = testing_harness::PutWeights(h_->stub(), rp, 1001, &handle);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("does not hold whole bf16 elements"), std::string::npos)
      << st.error_message();
  EXPECT_TRUE(handle.empty());
  EXPECT_EQ(h_->engine().weights().count(), handles_before);
  ASSERT_TRUE(testing_harness::PutWeights(h_->stub(), rp, 1000, &handle).ok());
}

}  // namespace
}  // namespace lossd

namespace lossd {
namespace {

TEST(LimitsTest, PartsPerRequestIsLimited) {
  HarnessOptions o;
  o.service.max_parts_per_request = 10;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 3));
  ComputeReply r = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 64));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("more than --max_parts_per_request=10"),
            std::string::npos)
      << r.status.error_message();
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
  ExpectServes(h);
}

// Without --auth_tokens_file a client is its host: an authorization header nobody checks (here
// on the held stream only) does not make it another client.
class InFlightPerClientTest : public ::testing::TestWithParam<bool> {};

TEST_P(InFlightPerClientTest, InFlightPerClientIsLimited) {
  HarnessOptions o;
  o.service.max_in_flight_per_client = 1;
  Harness h(o);
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kF32, 3));
  // One stream held open (header sent, nothing more) takes this client's only slot.
  grpc::ClientContext ctx;
  if (GetParam()) ctx.AddMetadata("authorization", "Bearer one-of-many");
  auto held = h.stub().Compute(&ctx);
  v1::ComputeRequest header;
  *header.mutable_header() = HeaderFor(rp);
  ASSERT_TRUE(held->Write(header));
  for (int i = 0; i < 200 && h.engine().budget().in_use() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ComputeReply second = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(second.status.error_message().find("--max_in_flight_per_client"), std::string::npos)
      << second.status.error_message();
  ctx.TryCancel();
  held->Finish();
  // The slot is given back when the held call ends.
  grpc::Status last;
  for (int i = 0; i < 100; ++i) {
    last = RunCompute(h.stub(), HeaderFor(rp), PartsFor(rp, 1 << 20)).status;
    if (last.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(last.ok()) << last.error_message();
}

INSTANTIATE_TEST_SUITE_P(UncheckedHeader, InFlightPerClientTest, ::testing::Bool());

}  // namespace
}  // namespace lossd

namespace lossd {
namespace {

// Found by fuzzing: finite but huge inputs overflow the fp32 logits; the answer must be a
// clear refusal, never a NaN loss presented as a result.
TEST_F(E2eTest, LogitsThatOverflowFp32AreRefused) {
  RandomProblem rp = RandomProblem::Make(SmallSpec(DType::kBF16, 51));
  for (size_t i = 0; i < rp.x.size() / 2; ++i) reinterpret_cast<uint16_t*>(rp.x.data())[i] = 0x7e00;  // 4.25e37
  for (size_t i = 0; i < rp.w.size() / 2; ++i) reinterpret_cast<uint16_t*>(rp.w.data())[i] = 0x7e00;
  ComputeReply r = RunCompute(h_->stub(), HeaderFor(rp), PartsFor(rp, 1 << 20));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(r.status.error_message().find("the loss is not finite: the logits X W^T (+ b) or the z-loss"), std::string::npos)
      << r.status.error_message();
  ExpectServes(*h_);
}

}  // namespace
}  // namespace lossd
