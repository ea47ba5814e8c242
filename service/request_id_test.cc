// SPDX-License-Identifier: Apache-2.0
// Tests the request id over real gRPC on loopback: the client's x-request-id comes back in the
// response's metadata and is named in the call's log line (unary and streamed calls, OK and
// refused); a call without one gets an id the server made; a malformed one is refused with
// INVALID_ARGUMENT naming x-request-id. And ClientRequestId's checks, case by case.
#include "service/request_id.h"

#include <grpcpp/grpcpp.h>

#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "engine/engine.h"
#include "service/log.h"
#include "service/loss_server.h"
#include "service/metrics.h"
#include "spdlog/sinks/ostream_sink.h"

namespace lossd {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// One metadata map with `values` under x-request-id (the strings must outlive it).
ClientMetadata WithIds(const std::vector<std::string>& values) {
  ClientMetadata md;
  for (const std::string& v : values) md.emplace(kRequestIdKey, grpc::string_ref(v));
  return md;
}

TEST(ClientRequestIdTest, AbsentIsEmptyAndAValidOneIsKept) {
  EXPECT_EQ(*ClientRequestId(ClientMetadata()), "");
  const std::vector<std::string> ok = {"trainer-7/step:3.micro_1@host+x=y~!"};
  EXPECT_EQ(*ClientRequestId(WithIds(ok)), ok[0]);
  const std::vector<std::string> longest = {std::string(kMaxRequestIdBytes, 'a')};
  EXPECT_EQ(*ClientRequestId(WithIds(longest)), longest[0]);
}

TEST(ClientRequestIdTest, MalformedIsRefusedNamingTheFieldAndWhy) {
  struct Case {
    std::vector<std::string> values;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{""}, "metadata x-request-id must be 1 to 128 characters, got 0"},
      {{std::string(129, 'a')}, "metadata x-request-id must be 1 to 128 characters, got 129"},
      {{"two words"}, "must be visible ASCII ('!' to '~'), got byte 0x20 at offset 3"},
      {{"tab\there"}, "got byte 0x09 at offset 3"},
      {{"caf\xc3\xa9"}, "got byte 0xc3 at offset 3"},
      {{"a", "b"}, "metadata x-request-id must come once, got 2 values"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> id = ClientRequestId(WithIds(c.values));
    ASSERT_FALSE(id.ok()) << c.want;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(id.status().message(), HasSubstr(c.want));
    EXPECT_EQ(CheckRequestId(WithIds(c.values)).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(NewRequestIdTest, SixteenHexDigitsAndNewEachTime) {
  const std::string a = NewRequestId();
  EXPECT_THAT(a, MatchesRegex("[0-9a-f]{16}"));
  EXPECT_NE(a, NewRequestId());
}

class RequestIdServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    InitLogging({.access_log = true}, std::make_shared<spdlog::sinks::ostream_sink_mt>(log_));
    engine_ = std::make_unique<Engine>(NewCpuBackend(1), EngineOptions{});
    metrics_ = std::make_unique<ServerMetrics>([] { return StateSample{}; });
    LossServerOptions o;
    o.address = "127.0.0.1:0";
    auto s = LossServer::Start(engine_.get(), metrics_.get(), o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    stub_ = v1::Loss::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                                                  grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    stub_.reset();
    server_.reset();
    engine_.reset();
    InitLogging({});
  }

  // The lines of the log that name `method`.
  std::vector<std::string> LinesOf(const std::string& method) {
    std::vector<std::string> out;
    for (absl::string_view l : absl::StrSplit(log_.str(), '\n')) {
      if (absl::StrContains(l, absl::StrCat(" method=", method, " "))) out.emplace_back(l);
    }
    return out;
  }

  std::ostringstream log_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<LossServer> server_;
  std::unique_ptr<v1::Loss::Stub> stub_;
};

// The id the server sent back: in the initial metadata (or, for a response that is nothing
// but its status, wherever gRPC put it).
std::string ReturnedId(const grpc::ClientContext& ctx) {
  for (const auto* md : {&ctx.GetServerInitialMetadata(), &ctx.GetServerTrailingMetadata()}) {
    auto it = md->find(kRequestIdKey);
    if (it != md->end()) return std::string(it->second.data(), it->second.size());
  }
  return "";
}

TEST_F(RequestIdServiceTest, TheClientsIdComesBackAndIsLogged) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(kRequestIdKey, "trainer-7/step-3");
  v1::ServerInfoResponse info;
  ASSERT_TRUE(stub_->ServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  EXPECT_EQ(ReturnedId(ctx), "trainer-7/step-3");
  auto lines = LinesOf("ServerInfo");
  ASSERT_EQ(lines.size(), 1u) << log_.str();
  EXPECT_THAT(lines[0], HasSubstr(" code=OK "));
  EXPECT_THAT(lines[0], HasSubstr(" request_id=trainer-7/step-3"));
}

TEST_F(RequestIdServiceTest, ARefusedCallsIdComesBackAndIsInItsWarning) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(kRequestIdKey, "drop-1");
  v1::DropWeightsRequest req;
  req.set_handle("no-such-handle");
  v1::DropWeightsResponse resp;
  grpc::Status s = stub_->DropWeights(&ctx, req, &resp);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(ReturnedId(ctx), "drop-1");
  auto lines = LinesOf("DropWeights");
  ASSERT_EQ(lines.size(), 2u) << log_.str();  // the WARNING and the access line
  EXPECT_THAT(lines[0], HasSubstr(" WARNING lossd: call failed method=DropWeights "));
  EXPECT_THAT(lines[0], HasSubstr(" request_id=drop-1"));
  EXPECT_THAT(lines[1], HasSubstr(" request_id=drop-1"));
}

TEST_F(RequestIdServiceTest, AStreamedCallsIdComesBackAndIsLogged) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(kRequestIdKey, "fetch-9");
  v1::FetchGradientsRequest req;
  req.set_accumulator("no-such-accumulator");
  auto reader = stub_->FetchGradients(&ctx, req);
  v1::FetchGradientsResponse msg;
  while (reader->Read(&msg)) {
  }
  grpc::Status s = reader->Finish();
  ASSERT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  EXPECT_EQ(ReturnedId(ctx), "fetch-9");
  auto lines = LinesOf("FetchGradients");
  ASSERT_FALSE(lines.empty()) << log_.str();
  EXPECT_THAT(lines[0], HasSubstr(" request_id=fetch-9"));
}

TEST_F(RequestIdServiceTest, WithoutAnIdTheServerMakesOneAndLogsIt) {
  grpc::ClientContext ctx;
  v1::ServerInfoResponse info;
  ASSERT_TRUE(stub_->ServerInfo(&ctx, v1::ServerInfoRequest(), &info).ok());
  const std::string id = ReturnedId(ctx);
  EXPECT_THAT(id, MatchesRegex("[0-9a-f]{16}"));
  auto lines = LinesOf("ServerInfo");
  ASSERT_EQ(lines.size(), 1u) << log_.str();
  EXPECT_THAT(lines[0], HasSubstr(" request_id=" + id));
}

TEST_F(RequestIdServiceTest, AMalformedIdIsRefusedUnderAnIdTheServerMade) {
  grpc::ClientContext ctx;
  ctx.AddMetadata(kRequestIdKey, "two words");
  v1::ServerInfoResponse info;
  grpc::Status s = stub_->ServerInfo(&ctx, v1::ServerInfoRequest(), &info);
  ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("metadata x-request-id must be visible ASCII"));
  const std::string id = ReturnedId(ctx);
  EXPECT_THAT(id, MatchesRegex("[0-9a-f]{16}"));
  auto lines = LinesOf("ServerInfo");
  ASSERT_EQ(lines.size(), 2u) << log_.str();
  EXPECT_THAT(lines[0], HasSubstr(" request_id=" + id));

  // A streamed call (Step: the waiting kind) and a Compute are refused the same way.
  grpc::ClientContext step_ctx;
  step_ctx.AddMetadata(kRequestIdKey, std::string(200, 'x'));
  v1::StepResponse step;
  s = stub_->Step(&step_ctx, v1::StepRequest(), &step);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("x-request-id must be 1 to 128 characters, got 200"));
  grpc::ClientContext compute_ctx;
  compute_ctx.AddMetadata(kRequestIdKey, "a b");
  auto stream = stub_->Compute(&compute_ctx);
  stream->WritesDone();
  s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("x-request-id must be visible ASCII"));
  EXPECT_THAT(ReturnedId(compute_ctx), MatchesRegex("[0-9a-f]{16}"));
}

}  // namespace
}  // namespace lossd
