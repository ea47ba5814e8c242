// SPDX-License-Identifier: Apache-2.0
// Tests the raw (byte-buffer) methods of the Loss service over real gRPC on loopback: bytes
// that are not the method's message are refused with INVALID_ARGUMENT, and the parts sent as
// slices of the output buffers are protobuf's own encoding, byte for byte what a typed client
// reads, call after call (the buffers are reused from the pool only once gRPC lets go).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "engine/engine.h"
#include "service/loss_server.h"
#include "service/metrics.h"

namespace lossd {
namespace {

class LossServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::make_unique<Engine>(NewCpuBackend(2), EngineOptions{});
    metrics_ = std::make_unique<ServerMetrics>([] { return StateSample{}; });
    LossServerOptions o;
    o.address = "127.0.0.1:0";
    o.service.default_response_part_bytes = 64 << 10;  // many parts per output
    auto s = LossServer::Start(engine_.get(), metrics_.get(), o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    channel_ = grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Loss::NewStub(channel_);
  }
  void TearDown() override {
    stub_.reset();
    channel_.reset();
    server_.reset();
    engine_.reset();
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<LossServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Loss::Stub> stub_;
};

grpc::ByteBuffer Bytes(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

// A field-1 length-delimited value that runs past the end: no protobuf message.
const char kGarbage[] = "\x0a\x7f\x01\x02";

TEST_F(LossServiceTest, ComputeRefusesBytesThatAreNotAComputeRequest) {
  grpc::GenericStub generic(channel_);
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto call = generic.PrepareCall(&ctx, "/lossd.v1.Loss/Compute", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  ASSERT_TRUE(cq.Next(&tag, &ok) && ok);
  call->Write(Bytes(std::string(kGarbage, sizeof(kGarbage) - 1)), reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  call->WritesDone(reinterpret_cast<void*>(3));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(4));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(4)) {
  }
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("a Compute message is not a ComputeRequest"),
            std::string::npos)
      << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

TEST_F(LossServiceTest, FetchGradientsRefusesBytesThatAreNotARequest) {
  grpc::GenericStub generic(channel_);
  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  auto call = generic.PrepareUnaryCall(&ctx, "/lossd.v1.Loss/FetchGradients",
                                       Bytes(std::string(kGarbage, sizeof(kGarbage) - 1)), &cq);
  call->StartCall();
  grpc::ByteBuffer reply;
  grpc::Status status;
  call->Finish(&reply, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("not a valid FetchGradientsRequest"), std::string::npos)
      << status.error_message();
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

// Three Computes in a row, read through the typed stub: the dX parts (slices of pooled output
// buffers) arrive in order, with the right sizes, and every call gives the same bytes.
TEST_F(LossServiceTest, ComputeResponsePartsParseAsTypedMessagesCallAfterCall) {
  // dX of 1.3 MB: a pooled host buffer (>= 1 MiB), reused by the next call.
  constexpr int64_t kBt = 330, kH = 1000, kV = 17;
  std::mt19937 gen(7);
  std::vector<float> x(kBt * kH), w(kV * kH);
  for (float& f : x) f = std::uniform_real_distribution<float>(-1, 1)(gen);
  for (float& f : w) f = std::uniform_real_distribution<float>(-0.5f, 0.5f)(gen);
  std::vector<int32_t> y(kBt);
  for (int32_t& t : y) t = static_cast<int32_t>(gen() % kV);
  auto spec = [](v1::TensorSpec* s, v1::DType d, std::vector<int64_t> shape) {
    s->set_dtype(d);
    for (int64_t v : shape) s->add_shape(v);
  };
  std::string first_dx;
  for (int call = 0; call < 3; ++call) {
    grpc::ClientContext ctx;
    auto stream = stub_->Compute(&ctx);
    v1::ComputeRequest head;
    v1::ComputeHeader* h = head.mutable_header();
    spec(h->mutable_x(), v1::DTYPE_FP32, {kBt, kH});
    spec(h->mutable_w(), v1::DTYPE_FP32, {kV, kH});
    spec(h->mutable_targets(), v1::DTYPE_INT32, {kBt});
    h->mutable_outputs()->set_dx(true);
    ASSERT_TRUE(stream->Write(head));
    auto send = [&](v1::TensorId id, const void* data, size_t bytes) {
      v1::ComputeRequest r;
      r.mutable_part()->set_tensor(id);
      r.mutable_part()->set_data(data, bytes);
      ASSERT_TRUE(stream->Write(r));
    };
    send(v1::TENSOR_W, w.data(), w.size() * 4);
    send(v1::TENSOR_TARGETS, y.data(), y.size() * 4);
    send(v1::TENSOR_X, x.data(), x.size() * 4);
    ASSERT_TRUE(stream->WritesDone());
    v1::ComputeResponse r;
    ASSERT_TRUE(stream->Read(&r));
    ASSERT_TRUE(r.has_summary());
    ASSERT_EQ(r.summary().tensors_size(), 1);
    EXPECT_EQ(r.summary().tensors(0), v1::TENSOR_DX);
    std::string dx;
    while (stream->Read(&r)) {
      ASSERT_TRUE(r.has_part());
      EXPECT_EQ(r.part().tensor(), v1::TENSOR_DX);
      EXPECT_EQ(r.part().offset(), dx.size());
      EXPECT_LE(r.part().data().size(), 64u << 10);
      dx += r.part().data();
    }
    grpc::Status status = stream->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_EQ(dx.size(), static_cast<size_t>(kBt * kH * 4));
    const float* g = reinterpret_cast<const float*>(dx.data());
    int finite_nonzero = 0;
    for (int64_t i = 0; i < kBt * kH; ++i) finite_nonzero += std::isfinite(g[i]) && g[i] != 0;
    EXPECT_GT(finite_nonzero, kBt * kH / 2);  // a real gradient, not poison or zeros
    if (call == 0) {
      first_dx = dx;
    } else {
      EXPECT_EQ(dx, first_dx) << "call " << call;
    }
  }
}

// Compute calls the server has finished with gRPC status `code` (lossd_requests_total).
double FinishedComputes(ServerMetrics& metrics, const std::string& code) {
  for (const prometheus::MetricFamily& family : metrics.registry()->Collect()) {
    if (family.name != "lossd_requests_total") continue;
    for (const prometheus::ClientMetric& m : family.metric) {
      bool compute = false, with_code = false;
      for (const prometheus::ClientMetric::Label& l : m.label) {
        compute = compute || (l.name == "method" && l.value == "Compute");
        with_code = with_code || (l.name == "code" && l.value == code);
      }
      if (compute && with_code) return m.counter.value;
    }
  }
  return 0;
}

// A Compute cancelled while the server handles its header (before its memory reservation
// exists) must not wait in the memory queue until its turn: the reservation is withdrawn (or
// never queued) at once, and nothing is granted to it afterwards.
TEST(ComputeCancelTest, ACancelWhileTheHeaderIsHandledLeavesNothingInTheMemoryQueue) {
  constexpr uint64_t kBudget = 1 << 20;
  EngineOptions eo;
  eo.memory_budget_bytes = kBudget;
  Engine engine(NewCpuBackend(1), eo);
  ServerMetrics metrics([] { return StateSample{}; });
  absl::Notification in_header, cancelled;
  LossServerOptions o;
  o.address = "127.0.0.1:0";
  o.service.compute_header_hook = [&] {
    in_header.Notify();
    // Held here until the cancel has been handled, so it lands inside the header's handling.
    cancelled.WaitForNotificationWithTimeout(absl::Seconds(10));
  };
  o.service.compute_cancel_hook = [&] {
    if (!cancelled.HasBeenNotified()) cancelled.Notify();
  };
  auto server = LossServer::Start(&engine, &metrics, o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Loss::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*server)->port()), grpc::InsecureChannelCredentials()));

  // The whole budget is taken, so the Compute (a few KiB) would have to queue.
  uint64_t blocker = 0;
  ASSERT_TRUE(engine.budget().Reserve(kBudget, "blocker", [](absl::Status) {}, &blocker).ok());

  grpc::ClientContext ctx;
  auto stream = stub->Compute(&ctx);
  v1::ComputeRequest head;
  v1::ComputeHeader* h = head.mutable_header();
  auto spec = [](v1::TensorSpec* s, v1::DType d, std::vector<int64_t> shape) {
    s->set_dtype(d);
    for (int64_t v : shape) s->add_shape(v);
  };
  spec(h->mutable_x(), v1::DTYPE_FP32, {4, 8});
  spec(h->mutable_w(), v1::DTYPE_FP32, {16, 8});
  spec(h->mutable_targets(), v1::DTYPE_INT32, {4});
  h->mutable_outputs()->set_dx(true);
  ASSERT_TRUE(stream->Write(head));
  ASSERT_TRUE(in_header.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ctx.TryCancel();
  EXPECT_EQ(stream->Finish().error_code(), grpc::StatusCode::CANCELLED);
  ASSERT_TRUE(cancelled.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "the server never saw the cancel";

  // Still holding the whole budget: the cancelled Compute must end by itself. Waited for as
  // the server's count of finished Computes, not as an empty queue: the header's handling
  // goes on after the cancel, and the queue is empty until it reaches its reservation too.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (FinishedComputes(metrics, "CANCELLED") < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(FinishedComputes(metrics, "CANCELLED"), 1)
      << "a Compute cancelled during its header still waits for memory";
  EXPECT_EQ(engine.budget().waiting(), 0u)
      << "a Compute cancelled during its header still waits for memory";
  EXPECT_EQ(engine.budget().in_use(), kBudget);
  engine.budget().Release(kBudget);
  EXPECT_EQ(engine.budget().in_use(), 0u) << "memory was granted to a cancelled Compute";
  (*server)->Shutdown(absl::ZeroDuration());
}

}  // namespace
}  // namespace lossd

namespace lossd {
namespace {

// An address the server cannot listen on is UNAVAILABLE, naming it; the half-built server is
// torn down without touching the engine (it keeps serving whatever else uses it).
TEST(LossServerStartTest, AnAddressItCannotListenOnIsUnavailable) {
  Engine engine(NewCpuBackend(1), EngineOptions{});
  ServerMetrics metrics([] { return StateSample{}; });
  LossServerOptions o;
  o.address = "256.0.0.1:0";
  auto server = LossServer::Start(&engine, &metrics, o);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kUnavailable) << server.status();
  EXPECT_NE(server.status().message().find("cannot listen for gRPC on 256.0.0.1:0"),
            std::string::npos)
      << server.status();
  uint64_t ticket = 0;
  EXPECT_TRUE(engine.budget().Reserve(1, "after", [](absl::Status) {}, &ticket).ok())
      << "a failed start drained the engine";
  engine.budget().Release(1);
}

// A second server on a port another one listens on must fail to start, saying the port is
// taken (gRPC's default SO_REUSEPORT let it start and share the port's connections).
TEST(LossServerStartTest, APortAnotherServerListensOnIsRefused) {
  Engine engine(NewCpuBackend(1), EngineOptions{});
  ServerMetrics metrics([] { return StateSample{}; });
  LossServerOptions o;
  o.address = "127.0.0.1:0";
  auto first = LossServer::Start(&engine, &metrics, o);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*first)->port());
  for (const std::string& second_address :
       {address, absl::StrCat("0.0.0.0:", (*first)->port())}) {
    o.address = second_address;
    auto second = LossServer::Start(&engine, &metrics, o);
    ASSERT_FALSE(second.ok()) << "a second server started on " << second_address;
    EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
    EXPECT_NE(second.status().message().find(
                  absl::StrCat("cannot listen for gRPC on ", second_address,
                               ": the port is taken")),
              std::string::npos)
        << second.status();
  }
  (*first)->Shutdown(absl::ZeroDuration());
}

}  // namespace
}  // namespace lossd
