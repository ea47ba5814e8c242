// SPDX-License-Identifier: Apache-2.0
// Tests hosted heads through the Loss service over real gRPC on loopback (the CPU backend):
// create -> Compute on the head -> Step -> export -> import under a new name -> info -> list
// -> drop, the update checked against the gradient an inline Compute returns, the import
// checked bit for bit against its export, and every refusal the service adds (the exact code
// and the field it names).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "lossd/v1/lossd.grpc.pb.h"
#include "testing/server_harness.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

using testing_harness::ComputeReply;
using testing_harness::Harness;
using testing_harness::HeaderFor;
using testing_harness::MetricValue;
using testing_harness::PartsFor;
using testing_harness::RunCompute;

using Tensors = std::map<int, std::vector<uint8_t>>;  // by v1::TensorId

constexpr size_t kPartBytes = 1000;  // several parts per tensor, none of whole rows

void ExpectStatus(const grpc::Status& s, grpc::StatusCode code, const std::string& want) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_NE(s.error_message().find(want), std::string::npos) << s.error_message();
}

struct Created {
  grpc::Status status;
  v1::CreateHeadResponse response;
};

// A CreateHead stream: `first` messages as given, then each tensor in id order, in parts.
Created CreateHead(v1::Loss::Stub& stub, const v1::HeadHeader& header, const Tensors& tensors) {
  grpc::ClientContext ctx;
  Created c;
  auto stream = stub.CreateHead(&ctx, &c.response);
  v1::CreateHeadRequest r;
  *r.mutable_header() = header;
  stream->Write(r);
  for (const auto& [id, bytes] : tensors) {
    for (size_t at = 0; at < bytes.size(); at += kPartBytes) {
      v1::CreateHeadRequest p;
      p.mutable_part()->set_tensor(static_cast<v1::TensorId>(id));
      p.mutable_part()->set_offset(at);
      p.mutable_part()->set_data(bytes.data() + at, std::min(kPartBytes, bytes.size() - at));
      if (!stream->Write(p)) break;
    }
  }
  stream->WritesDone();
  c.status = stream->Finish();
  return c;
}

struct Exported {
  grpc::Status status;
  v1::ExportHeader header;
  Tensors tensors;
};

// Reads a whole export; every part must continue its tensor where the last one stopped.
Exported Export(v1::Loss::Stub& stub, const v1::ExportHeadRequest& request) {
  grpc::ClientContext ctx;
  Exported e;
  auto reader = stub.ExportHead(&ctx, request);
  v1::ExportHeadResponse r;
  bool first = true;
  while (reader->Read(&r)) {
    if (first) {
      EXPECT_TRUE(r.has_header()) << "the first message of an export is its header";
      e.header = r.header();
      first = false;
      continue;
    }
    EXPECT_TRUE(r.has_part());
    std::vector<uint8_t>& t = e.tensors[r.part().tensor()];
    EXPECT_EQ(r.part().offset(), t.size()) << "a part out of order";
    t.insert(t.end(), r.part().data().begin(), r.part().data().end());
  }
  e.status = reader->Finish();
  return e;
}

grpc::Status Step(v1::Loss::Stub& stub, const v1::StepRequest& r, v1::StepResponse* out,
                  double deadline_seconds = 60) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(deadline_seconds * 1000)));
  return stub.Step(&ctx, r, out);
}

v1::HeadHeader Header(const std::string& name, const RandomProblem& rp, v1::OptimizerKind kind) {
  const RandomProblemSpec& s = rp.spec();
  v1::HeadHeader h;
  h.set_name(name);
  h.mutable_w()->set_dtype(v1::DTYPE_FP32);
  h.mutable_w()->add_shape(s.v);
  h.mutable_w()->add_shape(s.h);
  if (!rp.bias.empty()) {
    h.mutable_bias()->set_dtype(v1::DTYPE_FP32);
    h.mutable_bias()->add_shape(s.v);
  }
  h.set_compute_dtype(v1::DTYPE_FP32);
  h.mutable_optimizer()->set_kind(kind);
  h.mutable_optimizer()->set_lr(0.05);
  return h;
}

Tensors Masters(const RandomProblem& rp) {
  Tensors t{{v1::TENSOR_HEAD_MASTER_W, rp.w}};
  if (!rp.bias.empty()) t[v1::TENSOR_HEAD_MASTER_BIAS] = rp.bias;
  return t;
}

// The Compute of `rp` on head `name` at `version`: the head's copy is the weight.
ComputeReply ComputeOnHead(v1::Loss::Stub& stub, const RandomProblem& rp,
                           const std::string& name, uint64_t version, uint64_t micro_batch) {
  v1::ComputeHeader h = HeaderFor(rp);
  h.clear_w();
  h.clear_bias();
  h.mutable_outputs()->set_dw(false);
  h.mutable_outputs()->set_db(false);
  h.set_head(name);
  h.set_head_version(version);
  h.set_micro_batch(micro_batch);
  return RunCompute(stub, h, PartsFor(rp, kPartBytes, /*include_weights=*/false));
}

std::vector<float> Floats(const std::vector<uint8_t>& b) {
  std::vector<float> f(b.size() / 4);
  std::memcpy(f.data(), b.data(), f.size() * 4);
  return f;
}

// |got - want| within `ulps` fp32 ulps of the larger magnitude, element by element; says how
// many differ and where the worst is.
::testing::AssertionResult NearUlps(const std::vector<float>& got, const std::vector<float>& want,
                                    double ulps) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " elements, want " << want.size();
  }
  size_t bad = 0, worst = 0;
  double worst_err = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double scale = std::max(std::fabs(got[i]), std::fabs(want[i]));
    const double tol = ulps * std::numeric_limits<float>::epsilon() * std::max(scale, 1e-30);
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol)) {
      ++bad;
      if (!(err <= worst_err)) worst_err = err, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << got.size() << " differ; worst ["
                                       << worst << "] " << got[worst] << " vs " << want[worst];
}

class HeadServiceTest : public ::testing::Test {
 public:
  static RandomProblem Problem(uint64_t seed) {
    RandomProblemSpec s;
    s.bt = 47, s.h = 31, s.v = 123;
    s.dtype = DType::kF32;
    s.bias = true;
    s.seed = seed;
    return RandomProblem::Make(s);
  }

 protected:
  Harness h_;
};

// SGD without momentum: the step is p - lr * g, with g the dW | db an inline Compute of the
// same problem returns in fp32.
TEST_F(HeadServiceTest, CreateComputeStepExportImportListDrop) {
  RandomProblem rp = Problem(11);
  Created c = CreateHead(h_.stub(), Header("run/a", rp, v1::OPTIMIZER_SGD), Masters(rp));
  ASSERT_TRUE(c.status.ok()) << c.status.error_message();
  EXPECT_TRUE(c.response.created());
  EXPECT_EQ(c.response.head().name(), "run/a");
  EXPECT_EQ(c.response.head().version(), 0u);
  EXPECT_EQ(c.response.head().optimizer().weight_decay(), 0.0);  // SGD's default, filled in
  EXPECT_GT(c.response.head().bytes(), 2 * rp.w.size());
  // The same head again: nothing changes.
  Created again = CreateHead(h_.stub(), Header("run/a", rp, v1::OPTIMIZER_SGD), Masters(rp));
  ASSERT_TRUE(again.status.ok()) << again.status.error_message();
  EXPECT_FALSE(again.response.created());

  // The gradient an inline Compute gives, in fp32.
  v1::ComputeHeader inline_header = HeaderFor(rp);
  inline_header.mutable_options()->set_grad_dtype(v1::DTYPE_FP32);
  ComputeReply inline_reply = RunCompute(h_.stub(), inline_header, PartsFor(rp, kPartBytes));
  ASSERT_TRUE(inline_reply.status.ok()) << inline_reply.status.error_message();
  ComputeReply on_head = ComputeOnHead(h_.stub(), rp, "run/a", 0, 0);
  ASSERT_TRUE(on_head.status.ok()) << on_head.status.error_message();
  EXPECT_EQ(on_head.summary.head_version(), 0u);
  EXPECT_TRUE(on_head.summary.head_added());
  EXPECT_EQ(on_head.summary.loss(), inline_reply.summary.loss());
  EXPECT_EQ(on_head.tensors[v1::TENSOR_DX], inline_reply.tensors[v1::TENSOR_DX]);
  EXPECT_EQ(on_head.tensors.count(v1::TENSOR_DW), 0u);
  // A retry of the same (rank, micro-batch) is answered but not added again.
  ComputeReply retry = ComputeOnHead(h_.stub(), rp, "run/a", 0, 0);
  ASSERT_TRUE(retry.status.ok()) << retry.status.error_message();
  EXPECT_FALSE(retry.summary.head_added());

  v1::StepRequest step;
  step.set_head("run/a");
  step.set_version(0);
  step.set_world_size(1);
  v1::StepResponse stepped;
  grpc::Status s = Step(h_.stub(), step, &stepped);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(stepped.version(), 1u);
  EXPECT_TRUE(stepped.applied());
  EXPECT_TRUE(stepped.finite());
  EXPECT_EQ(stepped.contributions(), 1u);
  EXPECT_EQ(stepped.tokens(), on_head.summary.tokens());
  // A retry (the reply was lost) gets the same answer and is not counted again (metrics below).
  v1::StepResponse retried;
  s = Step(h_.stub(), step, &retried);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(retried.version(), 1u);
  EXPECT_EQ(retried.contributions(), 1u);
  const std::vector<float> dw = Floats(inline_reply.tensors[v1::TENSOR_DW]);
  const std::vector<float> db = Floats(inline_reply.tensors[v1::TENSOR_DB]);
  double norm2 = 0;
  for (float g : dw) norm2 += static_cast<double>(g) * g;
  for (float g : db) norm2 += static_cast<double>(g) * g;
  EXPECT_NEAR(stepped.grad_norm(), std::sqrt(norm2), 1e-5 * std::sqrt(norm2));

  v1::ExportHeadRequest ex;
  ex.set_head("run/a");
  ex.set_response_part_bytes(1024);
  Exported e = Export(h_.stub(), ex);
  ASSERT_TRUE(e.status.ok()) << e.status.error_message();
  EXPECT_EQ(e.header.head().version(), 1u);
  EXPECT_EQ(e.header.instance(), h_.engine().options().instance);
  const float lr = 0.05f;
  std::vector<float> want_w = Floats(rp.w), want_b = Floats(rp.bias);
  for (size_t i = 0; i < want_w.size(); ++i) want_w[i] -= lr * dw[i];
  for (size_t i = 0; i < want_b.size(); ++i) want_b[i] -= lr * db[i];
  EXPECT_TRUE(NearUlps(Floats(e.tensors[v1::TENSOR_HEAD_MASTER_W]), want_w, 2));
  EXPECT_TRUE(NearUlps(Floats(e.tensors[v1::TENSOR_HEAD_MASTER_BIAS]), want_b, 2));
  // The fp32 compute copy is the master itself.
  EXPECT_EQ(e.tensors[v1::TENSOR_HEAD_COPY_W], e.tensors[v1::TENSOR_HEAD_MASTER_W]);
  ASSERT_EQ(e.header.tensors_size(), static_cast<int>(e.tensors.size()));

  // Imported under a new name, and exported again: the same bytes.
  v1::HeadHeader import = e.header.head();
  import.set_name("run/b");
  Tensors sent;
  for (const auto& [id, bytes] : e.tensors) {
    if (id != v1::TENSOR_HEAD_COPY_W && id != v1::TENSOR_HEAD_COPY_BIAS) sent[id] = bytes;
  }
  Created imported = CreateHead(h_.stub(), import, sent);
  ASSERT_TRUE(imported.status.ok()) << imported.status.error_message();
  EXPECT_TRUE(imported.response.created());
  EXPECT_EQ(imported.response.head().version(), 1u);
  ex.set_head("run/b");
  Exported e2 = Export(h_.stub(), ex);
  ASSERT_TRUE(e2.status.ok()) << e2.status.error_message();
  EXPECT_EQ(e2.tensors, e.tensors);

  {
    grpc::ClientContext ctx;
    v1::HeadRequest r;
    r.set_head("run/b");
    v1::HeadInfo info;
    ASSERT_TRUE(h_.stub().GetHeadInfo(&ctx, r, &info).ok());
    EXPECT_EQ(info.version(), 1u);
    EXPECT_EQ(info.optimizer_step(), e.header.head().optimizer_step());
    EXPECT_EQ(info.instance(), h_.engine().options().instance);
  }
  {
    grpc::ClientContext ctx;
    v1::ServerInfoResponse si;
    ASSERT_TRUE(h_.stub().ServerInfo(&ctx, v1::ServerInfoRequest(), &si).ok());
    EXPECT_NE(std::find(si.features().begin(), si.features().end(), "hosted_head"),
              si.features().end());
  }
  {
    grpc::ClientContext ctx;
    v1::ListResponse list;
    ASSERT_TRUE(h_.stub().List(&ctx, v1::ListRequest(), &list).ok());
    std::map<std::string, uint64_t> heads;
    for (const v1::StateEntry& x : list.entries()) {
      if (x.kind() == v1::STATE_HEAD) heads[x.name()] = x.version();
    }
    EXPECT_EQ(heads, (std::map<std::string, uint64_t>{{"run/a", 1}, {"run/b", 1}}));
  }
  const std::string page = h_.ScrapeMetrics();
  EXPECT_EQ(MetricValue(page, "lossd_head_steps_total", R"(outcome="applied")"), 1);
  EXPECT_EQ(MetricValue(page, "lossd_head_step_contributions_total"), 1);
  EXPECT_EQ(MetricValue(page, "lossd_head_last_version"), 1);
  EXPECT_EQ(MetricValue(page, "lossd_heads"), 2);
  EXPECT_EQ(MetricValue(page, "lossd_head_bytes"),
            static_cast<double>(2 * c.response.head().bytes()));
  for (const char* name : {"run/a", "run/b"}) {
    grpc::ClientContext ctx;
    v1::HeadRequest r;
    r.set_head(name);
    v1::DropHeadResponse dropped;
    ASSERT_TRUE(h_.stub().DropHead(&ctx, r, &dropped).ok()) << name;
  }
  grpc::ClientContext ctx;
  v1::HeadRequest r;
  r.set_head("run/a");
  v1::HeadInfo info;
  EXPECT_EQ(h_.stub().GetHeadInfo(&ctx, r, &info).error_code(), grpc::StatusCode::NOT_FOUND);
}

// AdamW's state travels with an export: exp_avg after one step is (1 - beta1) g.
TEST_F(HeadServiceTest, AdamWStateIsExported) {
  RandomProblem rp = Problem(12);
  ASSERT_TRUE(CreateHead(h_.stub(), Header("adam", rp, v1::OPTIMIZER_ADAMW), Masters(rp)).status.ok());
  v1::ComputeHeader inline_header = HeaderFor(rp);
  inline_header.mutable_options()->set_grad_dtype(v1::DTYPE_FP32);
  ComputeReply g = RunCompute(h_.stub(), inline_header, PartsFor(rp, kPartBytes));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  ASSERT_TRUE(ComputeOnHead(h_.stub(), rp, "adam", 0, 3).status.ok());
  v1::StepRequest step;
  step.set_head("adam");
  step.set_world_size(1);
  v1::StepResponse stepped;
  ASSERT_TRUE(Step(h_.stub(), step, &stepped).ok());
  v1::ExportHeadRequest ex;
  ex.set_head("adam");
  Exported e = Export(h_.stub(), ex);
  ASSERT_TRUE(e.status.ok()) << e.status.error_message();
  EXPECT_TRUE(e.header.head().with_state());
  EXPECT_EQ(e.header.head().optimizer_step(), 1);
  std::vector<float> m = Floats(g.tensors[v1::TENSOR_DW]);
  for (float& x : m) x *= static_cast<float>(1 - 0.9);
  EXPECT_TRUE(NearUlps(Floats(e.tensors[v1::TENSOR_HEAD_EXP_AVG_W]), m, 2));
  EXPECT_EQ(e.tensors.count(v1::TENSOR_HEAD_EXP_AVG_SQ_BIAS), 1u);
}

TEST_F(HeadServiceTest, CreateHeadRefusals) {
  RandomProblem rp = Problem(13);
  v1::HeadHeader h = Header("bad", rp, v1::OPTIMIZER_ADAMW);
  h.mutable_optimizer()->set_kind(v1::OPTIMIZER_UNSPECIFIED);
  ExpectStatus(CreateHead(h_.stub(), h, {}).status, grpc::StatusCode::INVALID_ARGUMENT,
               "header.optimizer.kind is OPTIMIZER_UNSPECIFIED");
  h = Header("bad", rp, v1::OPTIMIZER_SGD);
  h.mutable_optimizer()->set_beta1(0.8);
  ExpectStatus(CreateHead(h_.stub(), h, {}).status, grpc::StatusCode::INVALID_ARGUMENT,
               "header.optimizer.beta1 is set, but SGD has no such argument");
  h = Header(std::string(70 << 10, 'n'), rp, v1::OPTIMIZER_SGD);
  ExpectStatus(CreateHead(h_.stub(), h, {}).status, grpc::StatusCode::INVALID_ARGUMENT,
               "the CreateHead header");
  ExpectStatus(CreateHead(h_.stub(), Header("bad", rp, v1::OPTIMIZER_SGD),
                          {{v1::TENSOR_W, rp.w}})
                   .status,
               grpc::StatusCode::INVALID_ARGUMENT, "part.tensor TENSOR_W is not a head tensor");
  {
    // A part first, and a stream that closes before any header.
    grpc::ClientContext ctx;
    v1::CreateHeadResponse resp;
    auto stream = h_.stub().CreateHead(&ctx, &resp);
    v1::CreateHeadRequest p;
    p.mutable_part()->set_tensor(v1::TENSOR_HEAD_MASTER_W);
    p.mutable_part()->set_data("abcd");
    stream->Write(p);
    stream->WritesDone();
    ExpectStatus(stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
                 "the first message of a CreateHead stream must be a header");
  }
  {
    grpc::ClientContext ctx;
    v1::CreateHeadResponse resp;
    auto stream = h_.stub().CreateHead(&ctx, &resp);
    stream->WritesDone();
    ExpectStatus(stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
                 "the CreateHead stream closed before its header");
  }
  {
    grpc::ClientContext ctx;
    v1::CreateHeadResponse resp;
    auto stream = h_.stub().CreateHead(&ctx, &resp);
    v1::CreateHeadRequest r;
    *r.mutable_header() = Header("twice", rp, v1::OPTIMIZER_SGD);
    stream->Write(r);
    stream->Write(r);
    stream->WritesDone();
    ExpectStatus(stream->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
                 "the CreateHead stream carries a second header");
  }
  // Nothing was left behind.
  grpc::ClientContext ctx;
  v1::ListResponse list;
  ASSERT_TRUE(h_.stub().List(&ctx, v1::ListRequest(), &list).ok());
  EXPECT_EQ(list.entries_size(), 0);
  EXPECT_EQ(h_.WaitForIdleMemory(), 0u);
}

TEST_F(HeadServiceTest, StepAndExportRefusals) {
  RandomProblem rp = Problem(14);
  ASSERT_TRUE(CreateHead(h_.stub(), Header("h", rp, v1::OPTIMIZER_SGD), Masters(rp)).status.ok());
  v1::StepRequest step;
  step.set_head("h");
  step.set_world_size(1);
  step.set_head_instance("another-instance");
  v1::StepResponse out;
  // Head 'h' is here, but no call learned of it as on 'another-instance': the head of that
  // name here may not be the one the caller means.
  ExpectStatus(Step(h_.stub(), step, &out), grpc::StatusCode::FAILED_PRECONDITION,
               "head 'h' lived on server instance 'another-instance'; a head of that name is "
               "here (version 0)");
  step.clear_head_instance();
  step.set_phase(static_cast<v1::StepPhase>(7));
  ExpectStatus(Step(h_.stub(), step, &out), grpc::StatusCode::INVALID_ARGUMENT,
               "StepRequest.phase 7 is not STEP_FULL, STEP_REDUCE or STEP_APPLY");

  // A rank that waits for a peer that never comes, cut off by its deadline: the call ends
  // (the reactor finishes once, on the cancel) and the server goes on serving.
  step.set_phase(v1::STEP_FULL);
  step.set_world_size(2);
  ExpectStatus(Step(h_.stub(), step, &out, 0.3), grpc::StatusCode::DEADLINE_EXCEEDED, "");
  double cancelled = -1;
  for (int i = 0; i < 50 && cancelled != 1; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    cancelled = MetricValue(h_.ScrapeMetrics(), "lossd_requests_total",
                            R"(code="CANCELLED",method="Step")");
  }
  EXPECT_EQ(cancelled, 1) << "the server ends the waiting Step once, as CANCELLED";

  v1::ExportHeadRequest ex;
  ex.set_head("h");
  ex.set_response_part_bytes(5);
  ExpectStatus(Export(h_.stub(), ex).status, grpc::StatusCode::INVALID_ARGUMENT,
               "response_part_bytes");
  ex.set_response_part_bytes(0);
  ex.set_head_instance("another-instance");
  ExpectStatus(Export(h_.stub(), ex).status, grpc::StatusCode::FAILED_PRECONDITION,
               "ExportHeadRequest.head_instance 'another-instance' is not this server");
  ex.clear_head_instance();
  ex.set_version(5);
  ExpectStatus(Export(h_.stub(), ex).status, grpc::StatusCode::FAILED_PRECONDITION,
               "is at version 0, not 5");
  ex.clear_version();
  ex.set_head("missing");
  EXPECT_EQ(Export(h_.stub(), ex).status.error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext ctx;
  v1::HeadRequest r;
  r.set_head("h");
  v1::HeadInfo info;
  ASSERT_TRUE(h_.stub().GetHeadInfo(&ctx, r, &info).ok());
  EXPECT_EQ(h_.WaitForIdleMemory(), 0u);
}

// Ranks that disagree on a Step: the rank already waiting at the barrier gets the same
// FAILED_PRECONDITION at once (it waited out --head_step_timeout, then its own deadline).
TEST_F(HeadServiceTest, ARankWaitingAtTheBarrierHearsOfADisagreementAtOnce) {
  RandomProblem rp = Problem(17);
  ASSERT_TRUE(
      CreateHead(h_.stub(), Header("agree", rp, v1::OPTIMIZER_SGD), Masters(rp)).status.ok());
  ASSERT_TRUE(ComputeOnHead(h_.stub(), rp, "agree", 0, 0).status.ok());
  v1::StepRequest step;
  step.set_head("agree");
  step.set_world_size(2);
  step.set_lr(0.125);
  v1::StepResponse r0, r1;
  grpc::Status s0;
  std::thread rank0([&, step] { s0 = Step(h_.stub(), step, &r0, 20); });
  for (int i = 0; i < 300; ++i) {  // rank 0 is at the barrier before rank 1 comes
    grpc::ClientContext ctx;
    v1::HeadRequest r;
    r.set_head("agree");
    v1::HeadInfo info;
    if (h_.stub().GetHeadInfo(&ctx, r, &info).ok() && info.ranks_waiting() == 1) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  step.set_rank(1);
  step.set_lr(0.25);
  const grpc::Status s1 = Step(h_.stub(), step, &r1);
  rank0.join();
  ExpectStatus(s1, grpc::StatusCode::FAILED_PRECONDITION, "every rank of a step must agree");
  ExpectStatus(s0, grpc::StatusCode::FAILED_PRECONDITION, "lr 0.25");
  ExpectStatus(s0, grpc::StatusCode::FAILED_PRECONDITION, "lr 0.125");
}

// Ranks waiting at a barrier take no in-flight slot: a job wider than
// --max_in_flight_per_client (here 1, its ranks one client) still completes its step.
TEST(HeadServiceLimitsTest, WaitingRanksTakeNoInFlightSlot) {
  testing_harness::HarnessOptions o;
  o.service.max_in_flight_per_client = 1;
  Harness h(o);
  RandomProblem rp = HeadServiceTest::Problem(15);
  ASSERT_TRUE(CreateHead(h.stub(), Header("wide", rp, v1::OPTIMIZER_SGD), Masters(rp)).status.ok());
  ASSERT_TRUE(ComputeOnHead(h.stub(), rp, "wide", 0, 0).status.ok());
  v1::StepRequest step;
  step.set_head("wide");
  step.set_world_size(2);
  v1::StepResponse r0, r1;
  grpc::Status s0;
  std::thread rank0([&, step] { s0 = Step(h.stub(), step, &r0); });
  // Rank 0 is at the barrier before rank 1 comes (its call stays open until then).
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  step.set_rank(1);
  const grpc::Status s1 = Step(h.stub(), step, &r1);
  rank0.join();
  ASSERT_TRUE(s0.ok()) << s0.error_message();
  ASSERT_TRUE(s1.ok()) << s1.error_message();
  EXPECT_EQ(r0.version(), 1u);
  EXPECT_EQ(r1.version(), 1u);
  EXPECT_TRUE(r0.applied());
  EXPECT_EQ(r0.grad_norm(), r1.grad_norm());
  EXPECT_EQ(r0.contributions(), 1u);
}

// An export larger than the memory budget goes out a budget-sized window at a time (here
// 4998 bytes: windows that split elements), each part still within one tensor and in order,
// the bytes those of the head.
TEST(HeadServiceLimitsTest, ExportGoesOutInWindowsOfTheMemoryBudget) {
  testing_harness::HarnessOptions o;
  o.engine.memory_budget_bytes = 4998;
  Harness h(o);
  RandomProblem rp = HeadServiceTest::Problem(16);
  ASSERT_TRUE(CreateHead(h.stub(), Header("big", rp, v1::OPTIMIZER_ADAMW), Masters(rp)).status.ok());
  v1::ExportHeadRequest ex;
  ex.set_head("big");
  ex.set_response_part_bytes(1024);
  Exported e = Export(h.stub(), ex);
  ASSERT_TRUE(e.status.ok()) << e.status.error_message();
  uint64_t total = 0;
  for (const auto& [id, bytes] : e.tensors) total += bytes.size();
  EXPECT_GT(total, 4 * uint64_t{4998}) << "several windows";
  EXPECT_EQ(e.header.range_end(), total);
  EXPECT_EQ(e.tensors[v1::TENSOR_HEAD_MASTER_W], rp.w);
  EXPECT_EQ(e.tensors[v1::TENSOR_HEAD_MASTER_BIAS], rp.bias);
  EXPECT_EQ(e.tensors[v1::TENSOR_HEAD_COPY_W], rp.w);
  EXPECT_EQ(e.tensors[v1::TENSOR_HEAD_EXP_AVG_W], std::vector<uint8_t>(rp.w.size(), 0));
  // A range that starts and ends inside tensors: every part (offsets within its tensor) is
  // the whole export's bytes there, and together they cover the range.
  const uint64_t begin = rp.w.size() - 3, end = rp.w.size() + rp.bias.size() + 7001;
  ex.set_range_begin(begin);
  ex.set_range_end(end);
  grpc::ClientContext ctx;
  auto reader = h.stub().ExportHead(&ctx, ex);
  v1::ExportHeadResponse r;
  uint64_t covered = 0;
  std::map<int, uint64_t> next = {{v1::TENSOR_HEAD_MASTER_W, begin}};
  while (reader->Read(&r)) {
    if (r.has_header()) {
      EXPECT_EQ(r.header().range_begin(), begin);
      EXPECT_EQ(r.header().range_end(), end);
      continue;
    }
    const std::vector<uint8_t>& whole = e.tensors[r.part().tensor()];
    const uint64_t at = r.part().offset(), n = r.part().data().size();
    ASSERT_LE(at + n, whole.size()) << "a part past its tensor";
    EXPECT_EQ(at, next[r.part().tensor()]) << "a part out of order";
    next[r.part().tensor()] = at + n;
    EXPECT_EQ(std::memcmp(whole.data() + at, r.part().data().data(), n), 0);
    covered += n;
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(covered, end - begin);
  EXPECT_EQ(h.WaitForIdleMemory(), 0u);
}

}  // namespace
}  // namespace lossd
