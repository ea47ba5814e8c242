// Tests the client against an in-process fake lossd service over real loopback gRPC: part
// splitting and ordering, response validation, status propagation, deadlines, striping.
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

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/fake_loss_service.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

// Random bytes: every test tensor is distinct, so an echo that mixes tensors up shows.
ByteVector RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  ByteVector b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(gen());
  return b;
}

HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  const size_t n = *TensorByteSize(dtype, shape);
  return HostTensor::FromBytes(dtype, std::move(shape), RandomBytes(n, seed));
}

HostTensor Targets(int64_t bt, int64_t v, uint32_t seed) {
  std::mt19937 gen(seed);
  HostTensor t = HostTensor::Owned(DType::kI64, {bt});
  for (int64_t i = 0; i < bt; ++i) t.mutable_data_as<int64_t>()[i] = gen() % v;
  return t;
}

bool SameBytes(const HostTensor& a, const HostTensor& b) {
  return a.num_bytes() == b.num_bytes() && std::memcmp(a.data(), b.data(), a.num_bytes()) == 0;
}

class LossClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(-1);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port_, 0);
  }
  void TearDown() override {
    server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  ClientOptions Options() {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", port_);
    o.deadline = absl::Seconds(30);
    return o;
  }

  std::unique_ptr<LossClient> Client(const ClientOptions& o) {
    auto c = LossClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // A small bf16 request with inline weights.
  ComputeRequest SmallRequest(int64_t bt = 6, int64_t h = 5, int64_t v = 7) {
    ComputeRequest r;
    r.x = RandomTensor(DType::kBF16, {bt, h}, 1);
    r.w = RandomTensor(DType::kBF16, {v, h}, 2);
    r.targets = Targets(bt, v, 3);
    r.want.lse = true;
    r.want.predictions = true;
    return r;
  }

  FakeLossService fake_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

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
  EXPECT_EQ(res.status().message(), fake_.error_message);
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
    EXPECT_EQ(res.status().message(), fake_.error_message);
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

TEST_F(LossClientTest, WeightHandleLifecycle) {
  ClientOptions o = Options();
  o.part_bytes = 1000;
  auto client = Client(o);
  HostTensor w = RandomTensor(DType::kF16, {50, 33}, 31);
  HostTensor bias = RandomTensor(DType::kF16, {50}, 32);
  absl::StatusOr<PutWeightsResult> put = client->PutWeights(w, &bias);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->handle, "fake-0");
  EXPECT_EQ(put->bytes, w.num_bytes() + bias.num_bytes());
  {
    absl::MutexLock lock(&fake_.mu);
    const Assembler& a = fake_.weights["fake-0"].second;
    EXPECT_EQ(a.parts.at(v1::TENSOR_W), (50 * 33 * 2 + 999) / 1000);
    EXPECT_EQ(a.data.at(v1::TENSOR_BIAS),
              std::string(reinterpret_cast<const char*>(bias.data()), bias.num_bytes()));
  }
  ComputeRequest r;
  r.x = RandomTensor(DType::kF16, {4, 33}, 33);
  r.weight_handle = put->handle;
  r.targets = Targets(4, 50, 34);
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDw), w));
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.weight_handle(), "fake-0");
    EXPECT_FALSE(fake_.last_header.has_w());
  }
  EXPECT_TRUE(client->DropWeights(put->handle).ok());
  absl::Status again = client->DropWeights(put->handle);
  EXPECT_EQ(again.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(again.message(), "unknown weight handle 'fake-0'");
}

TEST_F(LossClientTest, AccumulateThenFetchGradients) {
  ClientOptions o = Options();
  o.response_part_bytes = 333;
  auto client = Client(o);
  ComputeRequest r = SmallRequest(6, 40, 25);
  r.bias = RandomTensor(DType::kBF16, {25}, 41);
  r.accumulator = "step-1";
  for (int i = 1; i <= 3; ++i) {
    absl::StatusOr<ComputeResult> res = client->Compute(r);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->accumulated_micro_batches, static_cast<uint64_t>(i));
    EXPECT_EQ(res->Find(OutputTensor::kDw), nullptr);
  }
  absl::StatusOr<FetchGradientsResult> g = client->FetchGradients("step-1", /*reset=*/true);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 3u);
  EXPECT_EQ(g->tokens, 18);
  EXPECT_EQ(g->instance, "fake-instance");
  ASSERT_EQ(g->dw.shape(), (std::vector<int64_t>{25, 40}));
  EXPECT_EQ(g->dw.dtype(), DType::kF32);
  for (int64_t i = 0; i < 25 * 40; ++i) {
    ASSERT_EQ(g->dw.data_as<float>()[i], static_cast<float>(i + 3)) << i;
  }
  ASSERT_TRUE(g->db.has_value());
  for (int64_t j = 0; j < 25; ++j) EXPECT_EQ(g->db->data_as<float>()[j], -static_cast<float>(j));
  g = client->FetchGradients("step-1", false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 0u);  // reset
  EXPECT_TRUE(client->DropAccumulator("step-1").ok());
  EXPECT_EQ(client->DropAccumulator("step-1").code(), absl::StatusCode::kNotFound);
  absl::StatusOr<FetchGradientsResult> gone = client->FetchGradients("step-1", false);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(gone.status().message(), "no accumulator 'step-1'");
}

// The client keeps an accumulator's sum on the server instance that began it: later Computes
// and fetches name that instance, so a restarted server (here: the fake's instance changed)
// refuses them instead of starting a second sum; DropAccumulator lets a new sum begin.
TEST_F(LossClientTest, AnAccumulatorStaysOnTheInstanceThatBeganIt) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(6, 40, 25);
  r.accumulator = "step-7";
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->instance, "fake-instance");
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.accumulator_instance(), "");  // nothing known yet
  }
  res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.accumulator_instance(), "fake-instance");
    fake_.instance = "fake-restarted";
  }
  res = client->Compute(r);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kFailedPrecondition) << res.status();
  EXPECT_THAT(res.status().message(), HasSubstr("'fake-instance' is not this server"));
  absl::StatusOr<FetchGradientsResult> g = client->FetchGradients("step-7", /*reset=*/true);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
  // Another accumulator is not held back by this one.
  ComputeRequest other = r;
  other.accumulator = "step-8";
  ASSERT_TRUE(client->Compute(other).ok());
  // Dropping forgets the instance: a new sum begins on the server there is now.
  (void)client->DropAccumulator("step-7");
  res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->instance, "fake-restarted");
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.accumulator_instance(), "");
  }
  g = client->FetchGradients("step-7", /*reset=*/false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->instance, "fake-restarted");
}

// Two first Computes into a new accumulator at once: both go out before its instance is
// known, so neither names one. The one answered first pins the accumulator to its instance;
// the other, answered by another instance (a restart in between here; another replica behind
// a balancer in life), is FAILED_PRECONDITION when it comes back: the sum is split.
TEST_F(LossClientTest, AFirstComputeAnsweredByAnotherInstanceIsRefusedAfterTheFact) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(6, 40, 26);
  r.accumulator = "step-9";
  absl::Notification held, release;
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.held = &held;
    fake_.release = &release;
  }
  absl::StatusOr<ComputeResult> late = absl::UnknownError("not run");
  std::thread first([&] { late = client->Compute(r); });
  held.WaitForNotification();  // sent, without an instance; the fake holds it
  absl::StatusOr<ComputeResult> early = client->Compute(r);
  ASSERT_TRUE(early.ok()) << early.status();
  EXPECT_EQ(early->instance, "fake-instance");
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.accumulator_instance(), "");  // also sent before it was known
    fake_.instance = "fake-restarted";
  }
  release.Notify();
  first.join();
  EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition) << late.status();
  EXPECT_THAT(late.status().message(),
              HasSubstr("accumulator 'step-9' began on server instance 'fake-instance', but "
                        "this Compute was added to one on instance 'fake-restarted'"));
  // The instance remembered is still the first one: later calls name it.
  absl::StatusOr<FetchGradientsResult> g = client->FetchGradients("step-9", false);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
}

TEST_F(LossClientTest, ServerInfo) {
  auto client = Client(Options());
  absl::StatusOr<ServerInfoResult> info = client->ServerInfo();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->version, "0.0-fake");
  EXPECT_EQ(info->backend, "cpu");
  EXPECT_EQ(info->device, "fake device");
  EXPECT_EQ(info->memory_total_bytes, 1000u);
  EXPECT_EQ(info->max_part_bytes, 16u << 20);
  EXPECT_EQ(info->max_bt, 1 << 20);
  EXPECT_EQ(info->accumulators, 3u);
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

TEST_F(LossClientTest, RequireFeatureAsksServerInfoOnceAndNamesWhatIsMissing) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"b_feature", "refuse_unknown_fields"};
  }
  auto client = Client(Options());
  EXPECT_TRUE(client->RequireFeature("refuse_unknown_fields").ok());
  EXPECT_TRUE(client->RequireFeature("b_feature").ok());
  absl::Status s = client->RequireFeature("from_the_future");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr("the server (lossd 0.0-fake) does not support "
                                     "'from_the_future'"));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.server_info_calls, 1);
}

TEST_F(LossClientTest, MetadataIsSentWithEveryCall) {
  ClientOptions o = Options();
  o.metadata = {{"authorization", "Bearer t0ken"}};
  auto client = Client(o);
  ASSERT_TRUE(client->Compute(SmallRequest()).ok());
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.last_metadata, "Bearer t0ken");
}

class ConnectionsTest : public LossClientTest, public ::testing::WithParamInterface<int> {};

// Each channel is its own TCP connection (distinct client ports), and calls rotate over them.
TEST_P(ConnectionsTest, EachChannelIsItsOwnConnection) {
  ClientOptions o = Options();
  o.connections = GetParam();
  auto client = Client(o);
  for (int i = 0; i < 2 * GetParam(); ++i) ASSERT_TRUE(client->ServerInfo().ok());
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.peers.size(), static_cast<size_t>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Counts, ConnectionsTest, ::testing::Values(1, 2, 4));

TEST_F(LossClientTest, TwoClientsDoNotShareAConnection) {
  auto a = Client(Options());
  auto b = Client(Options());
  ASSERT_TRUE(a->ServerInfo().ok());
  ASSERT_TRUE(b->ServerInfo().ok());
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.peers.size(), 2u);
}

TEST_F(LossClientTest, ConcurrentCallsFromManyThreads) {
  ClientOptions o = Options();
  o.connections = 3;
  o.part_bytes = 4096;
  auto client = Client(o);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 4; ++i) {
        ComputeRequest r;
        r.x = RandomTensor(DType::kF32, {64, 100}, 100 * t + i);
        r.w = RandomTensor(DType::kF32, {20, 100}, 1000 + 100 * t + i);
        r.targets = Targets(64, 20, t);
        absl::StatusOr<ComputeResult> res = client->Compute(r);
        if (!res.ok() || !SameBytes(*res->Find(OutputTensor::kDx), r.x) ||
            !SameBytes(*res->Find(OutputTensor::kDw), *r.w)) {
          ++failures;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.peers.size(), 3u);
}

TEST_F(LossClientTest, UnreachableServerIsUnavailable) {
  ClientOptions o = Options();
  server_->Shutdown();
  auto client = Client(o);
  absl::StatusOr<ComputeResult> res = client->Compute(SmallRequest());
  EXPECT_EQ(res.status().code(), absl::StatusCode::kUnavailable) << res.status();
  EXPECT_EQ(client->ServerInfo().status().code(), absl::StatusCode::kUnavailable);
}

std::string ReadTestFile(const std::string& name) {
  std::ifstream f("client/testdata/" + name, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_FALSE(ss.str().empty()) << name;
  return ss.str();
}

// A fake behind TLS (mutual TLS when `require_client_cert`), with a test CA whose server
// certificate names localhost and 127.0.0.1.
class TlsTest : public ::testing::Test {
 protected:
  void Start(bool require_client_cert) {
    grpc::SslServerCredentialsOptions o(
        require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                            : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
    o.pem_key_cert_pairs.push_back({ReadTestFile("server.key"), ReadTestFile("server.pem")});
    if (require_client_cert) o.pem_root_certs = ReadTestFile("ca.pem");
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(o), &port_);
    builder.RegisterService(&fake_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  ClientOptions TlsOptions() {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", port_);
    o.deadline = absl::Seconds(20);
    o.tls = true;
    o.tls_root_certs = ReadTestFile("ca.pem");
    return o;
  }

  absl::Status Info(const ClientOptions& o) {
    auto c = LossClient::Create(o);
    if (!c.ok()) return c.status();
    return (*c)->ServerInfo().status();
  }

  FakeLossService fake_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

TEST_F(TlsTest, ComputeOverTls) {
  Start(false);
  ClientOptions o = TlsOptions();
  o.auth_token = "s3cret";
  o.part_bytes = 1 << 16;
  auto client = LossClient::Create(o);
  ASSERT_TRUE(client.ok());
  ComputeRequest r;
  r.x = RandomTensor(DType::kF32, {300, 300}, 61);
  r.w = RandomTensor(DType::kF32, {50, 300}, 62);
  r.targets = Targets(300, 50, 63);
  absl::StatusOr<ComputeResult> res = (*client)->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDx), r.x));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.last_metadata, "Bearer s3cret");
}

TEST_F(TlsTest, ServerNameIsChecked) {
  Start(false);
  ClientOptions o = TlsOptions();
  o.tls_server_name = "localhost";
  EXPECT_TRUE(Info(o).ok()) << Info(o);
  o.tls_server_name = "elsewhere.example";
  EXPECT_EQ(Info(o).code(), absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, WrongCaOrPlaintextFails) {
  Start(false);
  ClientOptions o = TlsOptions();
  o.tls_root_certs = ReadTestFile("client.pem");  // not the CA that signed the server
  EXPECT_EQ(Info(o).code(), absl::StatusCode::kUnavailable);
  o = TlsOptions();
  o.tls = false;
  o.tls_root_certs.clear();
  EXPECT_EQ(Info(o).code(), absl::StatusCode::kUnavailable);
}

TEST_F(TlsTest, MutualTlsNeedsTheClientCertificate) {
  Start(true);
  ClientOptions o = TlsOptions();
  EXPECT_EQ(Info(o).code(), absl::StatusCode::kUnavailable);
  o.tls_client_cert = ReadTestFile("client.pem");
  o.tls_client_key = ReadTestFile("client.key");
  EXPECT_TRUE(Info(o).ok()) << Info(o);
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
