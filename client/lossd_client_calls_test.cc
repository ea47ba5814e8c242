// SPDX-License-Identifier: Apache-2.0
// Tests the client's calls but Compute against an in-process fake lossd service over real
// loopback gRPC (weight handles, accumulators and their instances, ServerInfo, RequireFeature),
// and its channels: metadata, one connection per channel, an unreachable server, TLS.
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
  EXPECT_THAT(std::string(again.message()),  // the call's own id follows the server's message
              ::testing::MatchesRegex("unknown weight handle 'fake-0' "
                                      "\\(request_id [0-9a-f]{16}\\)"));
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
  EXPECT_THAT(std::string(gone.status().message()),
              ::testing::MatchesRegex(
                  "no accumulator 'step-1' \\(request_id [0-9a-f]{16}\\)"));
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

// Connect connects every connection (here four) to a live server; to a port where nothing
// listens it gives up at its timeout with DEADLINE_EXCEEDED naming the target.
TEST_F(LossClientTest, ConnectConnectsEveryConnectionOrTimesOut) {
  ClientOptions o = Options();
  o.connections = 4;
  std::unique_ptr<LossClient> c = Client(o);
  EXPECT_TRUE(c->Connect(absl::Seconds(30)).ok());
  o.target = "127.0.0.1:1";
  std::unique_ptr<LossClient> nowhere = Client(o);
  absl::Status s = nowhere->Connect(absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()), HasSubstr("not connected to 127.0.0.1:1"));
}

}  // namespace
}  // namespace client
}  // namespace lossd
