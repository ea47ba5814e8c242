// SPDX-License-Identifier: Apache-2.0
// Tests the client's Compute against an in-process fake lossd service over real loopback gRPC:
// part splitting and ordering, caller buffers, response validation, status propagation,
// deadlines, non-finite outputs; and the checks of ClientOptions.
#include "client/lossd_client.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "testing/client/fake_loss_service.h"
#include "testing/client/lossd_client_fixture.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

TEST_F(LossClientTest, ComputeReturnsSummaryAndEveryWantedOutput) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest();
  r.targets.mutable_data_as<int64_t>()[2] = -100;  // ignored: not counted in tokens
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->loss, 1.5f);
  EXPECT_EQ(res->z_loss, 0.25f);
  EXPECT_EQ(res->accuracy, 0.125f);
  EXPECT_EQ(res->tokens, 5);
  EXPECT_EQ(res->compute_seconds, 0.5);
  EXPECT_EQ(res->backend, "fake");
  EXPECT_EQ(res->outputs.size(), 4u);
  ASSERT_NE(res->Find(OutputTensor::kDx), nullptr);
  ASSERT_NE(res->Find(OutputTensor::kDw), nullptr);
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDx), r.x));
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDw), *r.w));
  EXPECT_EQ(res->Find(OutputTensor::kDx)->shape(), (std::vector<int64_t>{6, 5}));
  EXPECT_EQ(res->Find(OutputTensor::kDx)->dtype(), DType::kBF16);
  const HostTensor* lse = res->Find(OutputTensor::kLse);
  const HostTensor* pred = res->Find(OutputTensor::kPredictions);
  ASSERT_NE(lse, nullptr);
  ASSERT_NE(pred, nullptr);
  EXPECT_EQ(pred->dtype(), DType::kI64);
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(pred->data_as<int64_t>()[i], r.targets.data_as<int64_t>()[i]) << i;
    EXPECT_EQ(lse->data_as<float>()[i], static_cast<float>(r.targets.data_as<int64_t>()[i]));
  }
  EXPECT_EQ(res->Find(OutputTensor::kDb), nullptr);
  EXPECT_EQ(res->bytes_sent, r.x.num_bytes() + r.w->num_bytes() + r.targets.num_bytes());
  EXPECT_EQ(res->bytes_received, r.x.num_bytes() + r.w->num_bytes() + 6 * 4 + 6 * 8);

  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.x().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(h.x().shape_size(), 2);
  EXPECT_EQ(h.w().shape(0), 7);
  EXPECT_EQ(h.targets().dtype(), v1::DTYPE_INT64);
  EXPECT_FALSE(h.has_bias());
  EXPECT_TRUE(h.options().has_ignore_index());
  EXPECT_EQ(h.options().ignore_index(), -100);
  EXPECT_TRUE(h.outputs().dx() && h.outputs().dw() && h.outputs().lse());
  EXPECT_FALSE(h.outputs().db() || h.outputs().z_loss());
}

TEST_F(LossClientTest, OptionsReachTheHeader) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest();
  r.options.ignore_index = 3;
  r.options.reduction = Reduction::kNone;
  r.options.label_smoothing = 0.1f;
  r.options.z_loss_scale = 1e-4f;
  r.options.softcap = 30.0f;
  r.options.grad_scale = 0.5f;
  r.options.chunk_rows = 128;
  r.grad_dtype = DType::kF32;
  r.bias = RandomTensor(DType::kBF16, {7}, 4);
  r.class_weights = RandomTensor(DType::kF32, {7}, 5);
  r.grad_output = RandomTensor(DType::kF32, {6}, 6);
  r.want.db = true;
  r.want.z_loss = true;
  r.want.accuracy = true;
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->Find(OutputTensor::kDx)->dtype(), DType::kF32);
  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.options().ignore_index(), 3);
  EXPECT_EQ(h.options().reduction(), v1::REDUCTION_NONE);
  EXPECT_EQ(h.options().label_smoothing(), 0.1f);
  EXPECT_EQ(h.options().lse_square_scale(), 1e-4f);
  EXPECT_EQ(h.options().softcap(), 30.0f);
  EXPECT_EQ(h.options().grad_scale(), 0.5f);
  EXPECT_EQ(h.options().chunk_rows(), 128);
  EXPECT_EQ(h.options().grad_dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(h.bias().shape(0), 7);
  EXPECT_EQ(h.class_weights().dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(h.grad_output().shape(0), 6);
  EXPECT_TRUE(h.outputs().db() && h.outputs().z_loss() && h.outputs().accuracy());
  EXPECT_EQ(fake_.last_parts[v1::TENSOR_BIAS], 1);
  EXPECT_EQ(fake_.last_parts[v1::TENSOR_CLASS_WEIGHTS], 1);
  EXPECT_EQ(fake_.last_parts[v1::TENSOR_GRAD_OUTPUT], 1);
}

// A tensor much larger than part_bytes goes as ceil(bytes / part_bytes) parts in byte order
// (the fake refuses out-of-order parts), and comes back split at response_part_bytes.
TEST_F(LossClientTest, LargeTensorsAreSplitIntoOrderedParts) {
  ClientOptions o = Options();
  o.part_bytes = 64 << 10;
  o.response_part_bytes = 100000;  // not a divisor of anything
  auto client = Client(o);
  ComputeRequest r;
  r.x = RandomTensor(DType::kF32, {1000, 701}, 11);  // 2804000 bytes
  r.w = RandomTensor(DType::kF32, {300, 701}, 12);
  r.targets = Targets(1000, 300, 13);
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDx), r.x));
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDw), *r.w));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.last_parts[v1::TENSOR_X], (2804000 + 65535) / 65536);
  EXPECT_EQ(fake_.last_parts[v1::TENSOR_W], (300 * 701 * 4 + 65535) / 65536);
  EXPECT_EQ(fake_.last_parts[v1::TENSOR_TARGETS], 1);
  EXPECT_EQ(fake_.last_max_part, 65536u);
}

// Outputs of a shape known from the request (dX, dW with inline weights) and at least 1 MiB
// are allocated, and their pages touched, while the call runs: they still come back intact,
// owned by the result, call after call; a call that fails meanwhile leaves nothing behind.
TEST_F(LossClientTest, OwnedLargeOutputsPreparedDuringTheCallArriveIntact) {
  ClientOptions o = Options();
  o.response_part_bytes = 1 << 20;
  auto client = Client(o);
  ComputeRequest r;
  r.x = RandomTensor(DType::kF32, {1000, 701}, 21);  // 2.8 MB
  r.w = RandomTensor(DType::kF32, {600, 701}, 22);   // 1.7 MB
  r.targets = Targets(1000, 600, 23);
  r.want.dw = true;
  for (int call = 0; call < 3; ++call) {
    absl::StatusOr<ComputeResult> res = client->Compute(r);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_NE(res->Find(OutputTensor::kDx), nullptr);
    ASSERT_NE(res->Find(OutputTensor::kDw), nullptr);
    EXPECT_FALSE(res->Find(OutputTensor::kDx)->is_view());
    EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDx), r.x)) << call;
    EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDw), *r.w)) << call;
  }
  fake_.error_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  fake_.error_message = "no room";
  fake_.mode = Mode::kError;  // last: publishes the two above to the server's threads
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kResourceExhausted) << res.status();
}

// Parts never split an element: part_bytes is rounded down to whole elements of each tensor
// (at least one), for inline weights and PutWeights alike.
TEST_F(LossClientTest, PartsHoldWholeElements) {
  ClientOptions o = Options();
  o.part_bytes = 7;
  auto client = Client(o);
  ComputeRequest r;
  r.x = RandomTensor(DType::kBF16, {5, 3}, 71);  // 30 bytes: 6-byte parts
  r.w = RandomTensor(DType::kBF16, {4, 3}, 72);
  r.targets = Targets(5, 4, 73);  // int64: one element (8 bytes) a part
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDx), r.x));
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_parts[v1::TENSOR_X], 5);
    EXPECT_EQ(fake_.last_parts[v1::TENSOR_W], 4);
    EXPECT_EQ(fake_.last_parts[v1::TENSOR_TARGETS], 5);
    EXPECT_EQ(fake_.last_max_part, 8u);
  }
  HostTensor w = RandomTensor(DType::kF32, {3, 3}, 74);
  ASSERT_TRUE(client->PutWeights(w, nullptr).ok());
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.weights["fake-0"].second.parts.at(v1::TENSOR_W), 9);
  EXPECT_EQ(fake_.weights["fake-0"].second.max_part, 4u);
}

TEST_F(LossClientTest, PartBytesAboveGrpcsDefaultLimitWork) {
  ClientOptions o = Options();
  o.part_bytes = 17 << 20;
  o.response_part_bytes = 17 << 20;
  auto client = Client(o);
  ComputeRequest r;
  r.x = RandomTensor(DType::kBF16, {4096, 4096}, 21);  // 32 MiB: two parts
  r.w = RandomTensor(DType::kBF16, {16, 4096}, 22);
  r.targets = Targets(4096, 16, 23);
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDx), r.x));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.last_parts[v1::TENSOR_X], 2);
  EXPECT_EQ(fake_.last_max_part, 17u << 20);
}

TEST_F(LossClientTest, OutputsLandInCallerBuffers) {
  ClientOptions o = Options();
  o.response_part_bytes = 7;
  auto client = Client(o);
  ComputeRequest r = SmallRequest(33, 9, 5);
  std::vector<uint8_t> dx(r.x.num_bytes() + 16, 0xFF);  // poisoned
  r.output_into[OutputTensor::kDx] = {dx.data(), dx.size()};
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  const HostTensor* got = res->Find(OutputTensor::kDx);
  ASSERT_NE(got, nullptr);
  EXPECT_TRUE(got->is_view());
  EXPECT_EQ(got->data(), dx.data());
  EXPECT_EQ(std::memcmp(dx.data(), r.x.data(), r.x.num_bytes()), 0);
  for (size_t i = r.x.num_bytes(); i < dx.size(); ++i) EXPECT_EQ(dx[i], 0xFF) << i;

  r.output_into[OutputTensor::kDx] = {dx.data(), r.x.num_bytes() - 1};
  res = client->Compute(r);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(res.status().message()), HasSubstr("output_into[dx]"));
}

// A caller buffer that cannot take what the call returns, or one for an output the call does
// not return, is refused before the Compute goes out: refused after the server answered, a
// micro-batch would already be in its accumulator, and a retry would add it twice.
TEST_F(LossClientTest, CallerBuffersAreCheckedBeforeTheCallIsSent) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(33, 9, 5);
  r.accumulator = "never-reached";
  std::vector<uint8_t> buf(1 << 16);
  struct Bad {
    OutputTensor t;
    size_t bytes;
    const char* says;
  };
  const Bad bad[] = {
      {OutputTensor::kDx, r.x.num_bytes() - 1, "output_into[dx] holds"},
      {OutputTensor::kDw, buf.size(), "output_into[dw]: this call does not return dw"},
      {OutputTensor::kZLoss, buf.size(),
       "output_into[z_loss]: this call does not return z_loss"},
      {OutputTensor::kLoss, buf.size(), "output_into[loss]: this call does not return loss"},
  };
  for (const Bad& b : bad) {
    ComputeRequest one = r;
    one.output_into[b.t] = {buf.data(), b.bytes};
    absl::StatusOr<ComputeResult> res = client->Compute(one);
    EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << b.says;
    EXPECT_THAT(std::string(res.status().message()), HasSubstr(b.says));
  }
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.accumulators.count("never-reached"), 0u) << "a refused call reached the server";
  EXPECT_TRUE(fake_.last_parts.empty());
}

TEST_F(LossClientTest, AOneDimensionalWIsRefused) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(6, 5, 7);
  r.w = RandomTensor(DType::kBF16, {35}, 24);
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(res.status().message()), HasSubstr("w must be (V, H)"));
}

class ErrorCodeTest : public LossClientTest,
                      public ::testing::WithParamInterface<grpc::StatusCode> {};

TEST_P(ErrorCodeTest, ServerCodeAndMessageReachTheCaller) {
  fake_.error_code = GetParam();
  fake_.error_message = "x: shape (6, 5) does not match w (7, 4) on H";
  fake_.mode = Mode::kError;  // last: publishes the two above to the server's threads
  auto client = Client(Options());
  absl::StatusOr<ComputeResult> res = client->Compute(SmallRequest());
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(static_cast<int>(res.status().code()), static_cast<int>(GetParam()));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(res.status().message(),
            absl::StrCat(fake_.error_message, " (request_id ", fake_.last_request_id, ")"));
}

// Every call carries an id of its own (x-request-id), and its error names the id the server
// saw, so that the error can be matched with the server's log line.
TEST_F(LossClientTest, EveryErrorNamesTheRequestIdTheServerSaw) {
  fake_.error_message = "no such thing";
  fake_.mode = Mode::kError;  // last: publishes the message to the server's threads
  auto client = Client(Options());
  std::set<std::string> ids;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<ComputeResult> res = client->Compute(SmallRequest());
    ASSERT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << res.status();
    absl::MutexLock lock(&fake_.mu);
    EXPECT_THAT(fake_.last_request_id, ::testing::MatchesRegex("[0-9a-f]{16}"));
    EXPECT_EQ(res.status().message(),
              absl::StrCat("no such thing (request_id ", fake_.last_request_id, ")"));
    ids.insert(fake_.last_request_id);
  }
  EXPECT_EQ(ids.size(), 3u);  // a new one each call
  // A unary call's error names its id too.
  absl::Status drop = client->DropWeights("no-such-handle");
  EXPECT_EQ(drop.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(drop.message()),
              ::testing::MatchesRegex("unknown weight handle 'no-such-handle' "
                                      "\\(request_id [0-9a-f]{16}\\)"));
}

TEST_F(LossClientTest, MetadataMayNotCarryARequestId) {
  ClientOptions o = Options();
  o.metadata = {{"x-request-id", "mine"}};
  auto client = LossClient::Create(o);
  ASSERT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(client.status().message()),
              ::testing::HasSubstr("metadata x-request-id: the client makes a new one"));
}

INSTANTIATE_TEST_SUITE_P(
    Codes, ErrorCodeTest,
    ::testing::Values(grpc::StatusCode::INVALID_ARGUMENT, grpc::StatusCode::RESOURCE_EXHAUSTED,
                      grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::NOT_FOUND,
                      grpc::StatusCode::FAILED_PRECONDITION, grpc::StatusCode::INTERNAL));

// The server fails after the header while most parts are still unsent: the call must end
// promptly with the server's status, and every slice of caller memory must be let go (Compute
// waits for that before it returns).
TEST_F(LossClientTest, EarlyErrorWhileSendingALargeTensor) {
  fake_.error_message = "w: V 4096 exceeds max_v 1024";
  fake_.mode = Mode::kError;  // last: publishes the message to the server's threads
  ClientOptions o = Options();
  o.part_bytes = 16 << 10;
  auto client = Client(o);
  ComputeRequest r;
  r.x = RandomTensor(DType::kBF16, {2048, 1024}, 51);  // 4 MiB: 256 parts
  r.w = RandomTensor(DType::kBF16, {4096, 1024}, 52);  // 8 MiB: 512 parts
  r.targets = Targets(2048, 4096, 53);
  for (int i = 0; i < 5; ++i) {
    const absl::Time start = absl::Now();
    absl::StatusOr<ComputeResult> res = client->Compute(r);
    EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << res.status();
    EXPECT_TRUE(absl::StartsWith(res.status().message(), fake_.error_message + " (request_id "))
        << res.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    absl::StatusOr<PutWeightsResult> put = client->PutWeights(*r.w, nullptr);
    ASSERT_TRUE(put.ok()) << put.status();  // the connection is still good
  }
}

TEST_F(LossClientTest, DeadlineExceeded) {
  fake_.mode = Mode::kSleep;
  auto client = Client(Options());
  const absl::Time start = absl::Now();
  CallOptions call;
  call.deadline = absl::Milliseconds(300);
  absl::StatusOr<ComputeResult> res = client->Compute(SmallRequest(), call);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kDeadlineExceeded) << res.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

TEST_F(LossClientTest, ClientDeadlineOptionApplies) {
  fake_.mode = Mode::kSleep;
  ClientOptions o = Options();
  o.deadline = absl::Milliseconds(200);
  auto client = Client(o);
  absl::StatusOr<ComputeResult> res = client->Compute(SmallRequest());
  EXPECT_EQ(res.status().code(), absl::StatusCode::kDeadlineExceeded) << res.status();
}

struct BadResponse {
  Mode mode;
  absl::StatusCode code;
  const char* message;
};

class BadResponseTest : public LossClientTest, public ::testing::WithParamInterface<BadResponse> {};

TEST_P(BadResponseTest, IsRejectedWithAClearMessage) {
  fake_.mode = GetParam().mode;
  ClientOptions o = Options();
  o.response_part_bytes = 16;  // several parts per tensor
  auto client = Client(o);
  // Both response orders: summary first, and overlap's preliminary summary ... final summary.
  for (bool overlap : {false, true}) {
    SCOPED_TRACE(overlap ? "overlap" : "no overlap");
    ComputeRequest r = SmallRequest();
    r.overlap = overlap;
    absl::StatusOr<ComputeResult> res = client->Compute(r);
    EXPECT_EQ(res.status().code(), GetParam().code) << res.status();
    EXPECT_THAT(std::string(res.status().message()), HasSubstr(GetParam().message));
  }
}

TEST_F(LossClientTest, OverlappedCallWithoutItsFinalSummaryIsRejected) {
  fake_.mode = Mode::kNoFinal;
  auto client = Client(Options());
  ComputeRequest r = SmallRequest();
  r.overlap = true;
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kInternal) << res.status();
  EXPECT_THAT(std::string(res.status().message()), HasSubstr("without its final summary"));
  // Without overlap the fake's single summary is the final one: the call succeeds.
  r.overlap = false;
  EXPECT_TRUE(client->Compute(r).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Modes, BadResponseTest,
    ::testing::Values(
        BadResponse{Mode::kOutOfOrder, absl::StatusCode::kInternal,
                    "parts out of order: dx part at byte offset 16, expected 0"},
        BadResponse{Mode::kShort, absl::StatusCode::kDataLoss,
                    "stream ended early: dx got 59 of 60 bytes"},
        BadResponse{Mode::kOverflow, absl::StatusCode::kDataLoss, "runs past the 60 bytes"},
        BadResponse{Mode::kUnannounced, absl::StatusCode::kInternal,
                    "part of z_loss, which it did not announce"},
        BadResponse{Mode::kNoSummary, absl::StatusCode::kInternal, "without a summary"},
        BadResponse{Mode::kPartFirst, absl::StatusCode::kInternal, "part before its summary"},
        BadResponse{Mode::kBadShape, absl::StatusCode::kInternal,
                    "announced dx as bf16[7, 5], expected bf16[6, 5]"},
        BadResponse{Mode::kTwoSummaries, absl::StatusCode::kInternal, "second summary"}));

TEST_F(LossClientTest, RequestsThatCannotBeSentAreRefusedLocally) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest();
  r.weight_handle = "h";
  EXPECT_EQ(client->Compute(r).status().code(), absl::StatusCode::kInvalidArgument);
  r = SmallRequest();
  r.w.reset();
  EXPECT_THAT(std::string(client->Compute(r).status().message()), HasSubstr("exactly one of w"));
  r = SmallRequest();
  r.x = HostTensor::View(DType::kBF16, {6, 5}, nullptr);
  EXPECT_THAT(std::string(client->Compute(r).status().message()), HasSubstr("x: null data"));
  r = SmallRequest();
  r.x = HostTensor::FromBytes(DType::kBF16, {6, 5}, ByteVector(59));
  EXPECT_THAT(std::string(client->Compute(r).status().message()), HasSubstr("x: holds 59 bytes"));
  r = SmallRequest();
  r.x = RandomTensor(DType::kBF16, {30}, 1);
  EXPECT_THAT(std::string(client->Compute(r).status().message()), HasSubstr("x must be (BT, H)"));
  r = SmallRequest();
  r.weight_handle = "h";
  r.w.reset();
  r.bias = RandomTensor(DType::kBF16, {7}, 1);
  EXPECT_THAT(std::string(client->Compute(r).status().message()),
              HasSubstr("carries its own bias"));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.peers.empty());  // nothing reached the server
}
TEST_F(LossClientTest, NonFiniteOutputsAreReported) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest();
  absl::StatusOr<ComputeResult> fine = client->Compute(r);
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_TRUE(fine->nonfinite.empty());
  r.options.grad_scale = 3e38f;
  absl::StatusOr<ComputeResult> inf = client->Compute(r);
  ASSERT_TRUE(inf.ok()) << inf.status();
  EXPECT_EQ(inf->nonfinite, (std::vector<OutputTensor>{OutputTensor::kDx, OutputTensor::kDw}));
}


TEST(LossClientOptionsTest, BadOptionsAreRefused) {
  ClientOptions o;
  o.connections = 0;
  EXPECT_EQ(LossClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = ClientOptions();
  o.part_bytes = 0;
  EXPECT_EQ(LossClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = ClientOptions();
  o.part_bytes = 64 << 20;
  o.max_send_message_bytes = 32 << 20;
  EXPECT_THAT(std::string(LossClient::Create(o).status().message()),
              HasSubstr("max_send_message_bytes"));
  o = ClientOptions();
  o.tls_root_certs = "pem";
  EXPECT_THAT(std::string(LossClient::Create(o).status().message()), HasSubstr("tls = true"));
  o = ClientOptions();
  o.tls = true;
  o.tls_client_cert = "pem";
  EXPECT_THAT(std::string(LossClient::Create(o).status().message()), HasSubstr("go together"));
  o = ClientOptions();
  o.target = "";
  EXPECT_EQ(LossClient::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace client
}  // namespace lossd
