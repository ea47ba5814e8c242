// SPDX-License-Identifier: Apache-2.0
// End to end over real gRPC on loopback, bad input: every refusal is checked for its exact
// code and a message naming the field and the values, and the server must answer a valid
// request afterwards and hold no memory for the refused one.
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"
#include "tests/e2e_fixture.h"

namespace lossd {
namespace {

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
