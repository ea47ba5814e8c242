// SPDX-License-Identifier: Apache-2.0
// Tests that every Loss RPC refuses a request carrying a field this server does not know
// (INVALID_ARGUMENT naming the message and field number) and keeps serving afterwards.
#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "engine/engine.h"
#include "service/loss_server.h"
#include "service/metrics.h"

namespace lossd {
namespace {

template <typename M>
void AddUnknown(M* m, int number) {
  m->GetReflection()->MutableUnknownFields(m)->AddVarint(number, 1);
}

void ExpectRefused(const grpc::Status& s, const std::string& what) {
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find(what), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("which this server does not know"), std::string::npos)
      << s.error_message();
}

// Sends `request` as an upload stream's only message; the stream's status.
template <typename Request>
grpc::Status SendOnly(grpc::ClientWriter<Request>& stream, const Request& request) {
  stream.Write(request);
  stream.WritesDone();
  return stream.Finish();
}

// Reads a response stream to its end; its status.
template <typename Response>
grpc::Status ReadToEnd(grpc::ClientReader<Response>& reader) {
  Response r;
  while (reader.Read(&r)) {
  }
  return reader.Finish();
}

class RefuseUnknownFieldsTest : public ::testing::Test {
 protected:
  void SetUp() override {
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
    // The server still answers a well-formed request.
    grpc::ClientContext ctx;
    v1::ServerInfoRequest req;
    v1::ServerInfoResponse info;
    EXPECT_TRUE(stub_->ServerInfo(&ctx, req, &info).ok());
    stub_.reset();
    server_.reset();
    engine_.reset();
  }

  // Sends `messages` on a Compute stream and returns its status.
  grpc::Status Compute(const std::vector<v1::ComputeRequest>& messages) {
    grpc::ClientContext ctx;
    auto stream = stub_->Compute(&ctx);
    for (const v1::ComputeRequest& m : messages) {
      if (!stream->Write(m)) break;
    }
    stream->WritesDone();
    v1::ComputeResponse r;
    while (stream->Read(&r)) {
    }
    return stream->Finish();
  }

  static v1::ComputeRequest Header() {
    v1::ComputeRequest r;
    v1::ComputeHeader* h = r.mutable_header();
    for (v1::TensorSpec* s : {h->mutable_x(), h->mutable_w()}) {
      s->set_dtype(v1::DTYPE_FP32);
      s->add_shape(2);
      s->add_shape(3);
    }
    h->mutable_targets()->set_dtype(v1::DTYPE_INT32);
    h->mutable_targets()->add_shape(2);
    return r;
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<LossServer> server_;
  std::unique_ptr<v1::Loss::Stub> stub_;
};

TEST_F(RefuseUnknownFieldsTest, ComputeHeaderAndNestedMessages) {
  v1::ComputeRequest r = Header();
  AddUnknown(r.mutable_header()->mutable_options(), 77);
  ExpectRefused(Compute({r}), "header.options (lossd.v1.LossOptions) carries field number 77");

  r = Header();
  AddUnknown(r.mutable_header()->mutable_outputs(), 50);
  ExpectRefused(Compute({r}), "header.outputs (lossd.v1.Outputs) carries field number 50");

  r = Header();
  AddUnknown(r.mutable_header()->mutable_targets(), 9);
  ExpectRefused(Compute({r}), "header.targets (lossd.v1.TensorSpec) carries field number 9");

  r = Header();
  AddUnknown(r.mutable_header(), 99);
  ExpectRefused(Compute({r}), "header (lossd.v1.ComputeHeader) carries field number 99");
}

TEST_F(RefuseUnknownFieldsTest, ComputeStreamMessageAndParts) {
  v1::ComputeRequest r = Header();
  AddUnknown(&r, 3);
  ExpectRefused(Compute({r}), "ComputeRequest (lossd.v1.ComputeRequest) carries field number 3");

  v1::ComputeRequest part;
  part.mutable_part()->set_tensor(v1::TENSOR_W);
  part.mutable_part()->set_data(std::string(24, '\x01'));
  AddUnknown(part.mutable_part(), 4);
  ExpectRefused(Compute({Header(), part}), "part (lossd.v1.TensorPart) carries field number 4");
}

TEST_F(RefuseUnknownFieldsTest, PutWeightsAndFetchGradients) {
  {
    grpc::ClientContext ctx;
    v1::PutWeightsResponse resp;
    v1::PutWeightsRequest r;
    r.mutable_header()->mutable_w()->set_dtype(v1::DTYPE_FP32);
    r.mutable_header()->mutable_w()->add_shape(2);
    r.mutable_header()->mutable_w()->add_shape(3);
    AddUnknown(r.mutable_header(), 30);
    ExpectRefused(SendOnly(*stub_->PutWeights(&ctx, &resp), r),
                  "PutWeightsRequest.header (lossd.v1.WeightsHeader) carries field number 30");
  }
  {
    grpc::ClientContext ctx;
    v1::FetchGradientsRequest r;
    r.set_accumulator("a");
    AddUnknown(&r, 20);
    ExpectRefused(ReadToEnd(*stub_->FetchGradients(&ctx, r)),
                  "FetchGradientsRequest (lossd.v1.FetchGradientsRequest) carries field "
                  "number 20");
  }
}

TEST_F(RefuseUnknownFieldsTest, UnaryCalls) {
  {
    grpc::ClientContext ctx;
    v1::DropWeightsRequest r;
    AddUnknown(&r, 2);
    v1::DropWeightsResponse resp;
    ExpectRefused(stub_->DropWeights(&ctx, r, &resp),
                  "DropWeightsRequest (lossd.v1.DropWeightsRequest) carries field number 2");
  }
  {
    grpc::ClientContext ctx;
    v1::DropAccumulatorRequest r;
    AddUnknown(&r, 2);
    v1::DropAccumulatorResponse resp;
    ExpectRefused(stub_->DropAccumulator(&ctx, r, &resp),
                  "DropAccumulatorRequest (lossd.v1.DropAccumulatorRequest) carries field "
                  "number 2");
  }
  {
    grpc::ClientContext ctx;
    v1::ServerInfoRequest r;
    AddUnknown(&r, 1);
    v1::ServerInfoResponse resp;
    ExpectRefused(stub_->ServerInfo(&ctx, r, &resp),
                  "ServerInfoRequest (lossd.v1.ServerInfoRequest) carries field number 1");
  }
}

TEST_F(RefuseUnknownFieldsTest, HostedHeadCalls) {
  {
    grpc::ClientContext ctx;
    v1::CreateHeadResponse resp;
    v1::CreateHeadRequest r;
    r.mutable_header()->set_name("h");
    AddUnknown(r.mutable_header()->mutable_optimizer(), 40);
    ExpectRefused(SendOnly(*stub_->CreateHead(&ctx, &resp), r),
                  "CreateHeadRequest.header.optimizer (lossd.v1.OptimizerConfig) carries "
                  "field number 40");
  }
  {
    grpc::ClientContext ctx;
    v1::StepRequest r;
    r.set_head("h");
    AddUnknown(&r, 30);
    v1::StepResponse resp;
    ExpectRefused(stub_->Step(&ctx, r, &resp),
                  "StepRequest (lossd.v1.StepRequest) carries field number 30");
  }
  {
    grpc::ClientContext ctx;
    v1::ExportHeadRequest r;
    r.set_head("h");
    AddUnknown(&r, 31);
    ExpectRefused(ReadToEnd(*stub_->ExportHead(&ctx, r)),
                  "ExportHeadRequest (lossd.v1.ExportHeadRequest) carries field number 31");
  }
  for (bool drop : {false, true}) {
    grpc::ClientContext ctx;
    v1::HeadRequest r;
    r.set_head("h");
    AddUnknown(&r, 2);
    v1::HeadInfo info;
    v1::DropHeadResponse dropped;
    ExpectRefused(drop ? stub_->DropHead(&ctx, r, &dropped) : stub_->GetHeadInfo(&ctx, r, &info),
                  "HeadRequest (lossd.v1.HeadRequest) carries field number 2");
  }
}

}  // namespace
}  // namespace lossd
