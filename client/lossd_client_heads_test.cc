// SPDX-License-Identifier: Apache-2.0
// Tests the client's hosted-head calls against the in-process fake lossd service over real
// loopback gRPC: what CreateHead, Step, ExportHead, GetHeadInfo, DropHead and a Compute naming
// a head put on the wire, what they make of the answers, the feature check, the head's
// instance, the export's ranges and its pinned version, and every refusal the client makes
// before sending. The fake's step adds 1 to every master value (fake_heads.h).
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/lossd_client.h"
#include "testing/client/fake_loss_service.h"
#include "testing/client/lossd_client_fixture.h"
#include "testing/client/test_tensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.pb.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

// The heads' tensors: uniform in [-2, 2).
HostTensor RandomFloats(DType dtype, std::vector<int64_t> shape, uint32_t seed) {
  return UniformTensor(dtype, std::move(shape), seed, 2.0f);
}

std::string Bytes(const HostTensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data()), t.num_bytes());
}

class HeadsTest : public LossClientTest {
 protected:
  void SetUp() override {
    LossClientTest::SetUp();
    {
      absl::MutexLock lock(&fake_.mu);
      fake_.features = {"hosted_head", "list_state"};
    }
    ClientOptions o = Options();
    o.part_bytes = 1000;
    client_ = Client(o);
  }

  // An fp32 AdamW head (V=37, H=11) with a bias and its optimizer state.
  CreateHeadRequest AdamWRequest(const std::string& name = "run/head-1") {
    CreateHeadRequest r;
    r.name = name;
    r.w = RandomFloats(DType::kF32, {37, 11}, 1);
    r.bias = RandomFloats(DType::kF32, {37}, 2);
    r.optimizer.lr = 3e-4;
    r.optimizer.beta2 = 0.95;
    r.optimizer.amsgrad = true;
    r.version = 5;
    r.optimizer_step = 5;
    uint32_t seed = 10;
    for (HeadTensor t : StateTensors(r.optimizer, true)) {
      r.state[t] = RandomFloats(DType::kF32, IsBiasTensor(t) ? std::vector<int64_t>{37}
                                                             : std::vector<int64_t>{37, 11},
                                seed++);
    }
    return r;
  }

  ComputeRequest HeadCompute(const std::string& head, uint64_t version, uint32_t rank,
                             uint64_t micro_batch) {
    ComputeRequest r;
    r.x = RandomTensor(DType::kBF16, {6, 11}, 40 + micro_batch);
    r.targets = Targets(6, 37, 41);
    r.head = head;
    r.head_version = version;
    r.rank = rank;
    r.micro_batch = micro_batch;
    r.want.dw = false;
    return r;
  }

  std::unique_ptr<LossClient> client_;
};

TEST_F(HeadsTest, EveryCallNeedsTheFeature) {
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"list_state"};
  }
  auto client = Client(Options());
  const std::string want = "does not support 'hosted_head'";
  EXPECT_THAT(client->CreateHead(AdamWRequest()).status().message(), HasSubstr(want));
  absl::Status s = client->Step({"h", 0}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr(want));
  EXPECT_THAT(client->ExportHead("h").status().message(), HasSubstr(want));
  EXPECT_THAT(client->GetHeadInfo("h").status().message(), HasSubstr(want));
  EXPECT_THAT(client->DropHead("h").message(), HasSubstr(want));
  s = client->Compute(HeadCompute("h", 0, 0, 0)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr(want));
  EXPECT_FALSE(fake_.heads.Has("run/head-1"));
}

TEST_F(HeadsTest, CreateSendsTheHeaderAndEveryTensor) {
  const CreateHeadRequest r = AdamWRequest();
  absl::StatusOr<CreateHeadResult> res = client_->CreateHead(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_TRUE(res->created);
  EXPECT_EQ(res->head.name, r.name);
  EXPECT_EQ(res->head.v, 37);
  EXPECT_EQ(res->head.h, 11);
  EXPECT_TRUE(res->head.has_bias);
  EXPECT_EQ(res->head.compute_dtype, DType::kBF16);
  EXPECT_EQ(res->head.version, 5u);
  EXPECT_EQ(res->head.instance, "fake-instance");
  EXPECT_EQ(res->head.optimizer.lr, 3e-4);
  EXPECT_EQ(res->head.optimizer.beta2, 0.95);
  EXPECT_TRUE(res->head.optimizer.amsgrad);

  const v1::HeadHeader h = fake_.heads.last_create_header();
  EXPECT_EQ(h.w().dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(h.bias().shape(0), 37);
  EXPECT_EQ(h.compute_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(h.optimizer().kind(), v1::OPTIMIZER_ADAMW);
  EXPECT_EQ(h.optimizer().weight_decay(), 0.01);  // torch's AdamW default, sent explicitly
  EXPECT_EQ(h.optimizer().beta1(), 0.9);
  EXPECT_EQ(h.optimizer().eps(), 1e-8);
  EXPECT_EQ(h.optimizer_step(), 5);
  EXPECT_TRUE(h.with_state());
  // 37 * 11 * 4 bytes in parts of at most 1000.
  EXPECT_EQ(fake_.heads.last_create_parts().at(v1::TENSOR_HEAD_MASTER_W), 2);
  EXPECT_EQ(fake_.heads.Tensor(r.name, v1::TENSOR_HEAD_MASTER_W), Bytes(r.w));
  EXPECT_EQ(fake_.heads.Tensor(r.name, v1::TENSOR_HEAD_MASTER_BIAS), Bytes(*r.bias));
  for (const auto& [t, tensor] : r.state) {
    EXPECT_EQ(fake_.heads.Tensor(r.name, static_cast<int>(t)), Bytes(tensor)) << HeadTensorName(t);
  }

  // The same head again is no change; at another version it is refused by the server.
  res = client_->CreateHead(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_FALSE(res->created);
  CreateHeadRequest later = AdamWRequest();
  later.version = 6;
  absl::Status s = client_->CreateHead(later).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("exists (version 5)"));
}

TEST_F(HeadsTest, CreateRefusesBadRequestsBeforeSending) {
  struct Case {
    const char* what;
    std::function<void(CreateHeadRequest&)> change;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"empty name", [](CreateHeadRequest& r) { r.name = ""; }, "name must be 1 to 128"},
      {"bad name", [](CreateHeadRequest& r) { r.name = "a b"; },
       "holds ' ': only [A-Za-z0-9._:/-]"},
      {"rank-1 w", [](CreateHeadRequest& r) { r.w = RandomFloats(DType::kF32, {37}, 3); },
       "w must be (V, H), got fp32[37]"},
      {"int w",
       [](CreateHeadRequest& r) {
         r.w = Targets(37, 5, 3);
         r.state.clear();
         r.bias.reset();
       },
       "w must be (V, H)"},
      {"bias shape", [](CreateHeadRequest& r) { r.bias = RandomFloats(DType::kF32, {36}, 3); },
       "bias must be fp32[37] (w's dtype, V), got fp32[36]"},
      {"bias dtype", [](CreateHeadRequest& r) { r.bias = RandomFloats(DType::kBF16, {37}, 3); },
       "bias must be fp32[37]"},
      {"compute dtype", [](CreateHeadRequest& r) { r.compute_dtype = DType::kI64; },
       "compute_dtype must be bf16, fp16 or fp32, got int64"},
      {"negative lr", [](CreateHeadRequest& r) { r.optimizer.lr = -1; },
       "optimizer.lr must be >= 0, got -1"},
      {"beta1", [](CreateHeadRequest& r) { r.optimizer.beta1 = 1; },
       "optimizer.beta1 must be in [0, 1), got 1"},
      {"nan eps", [](CreateHeadRequest& r) { r.optimizer.eps = NAN; }, "optimizer.eps must be"},
      {"weight decay", [](CreateHeadRequest& r) { r.optimizer.weight_decay = -0.1; },
       "optimizer.weight_decay must be >= 0, got -0.1"},
      {"nesterov", [](CreateHeadRequest& r) {
         r.optimizer.kind = Optimizer::kSgd; r.optimizer.nesterov = true; r.state.clear(); },
       "nesterov needs momentum > 0 and dampening 0"},
      {"optimizer step", [](CreateHeadRequest& r) { r.optimizer_step = -1; },
       "optimizer_step must be >= 0, got -1"},
      {"missing state", [](CreateHeadRequest& r) { r.state.erase(HeadTensor::kMaxExpAvgSqBias); },
       "state[max_exp_avg_sq_bias] is missing"},
      {"state for no amsgrad", [](CreateHeadRequest& r) { r.optimizer.amsgrad = false; },
       "state[max_exp_avg_sq_w]: adamw keeps [exp_avg_w, exp_avg_bias, "
       "exp_avg_sq_w, exp_avg_sq_bias]"},
      {"state for plain sgd", [](CreateHeadRequest& r) { r.optimizer.kind = Optimizer::kSgd; },
       "state[exp_avg_w]: sgd with momentum 0 keeps []"},
      {"state shape", [](CreateHeadRequest& r) {
         r.state[HeadTensor::kExpAvgW] = RandomFloats(DType::kF32, {11, 37}, 4); },
       "state[exp_avg_w] must be fp32[37, 11], got fp32[11, 37]"},
      {"state dtype", [](CreateHeadRequest& r) {
         r.state[HeadTensor::kExpAvgBias] = RandomFloats(DType::kBF16, {37}, 4); },
       "state[exp_avg_bias] must be fp32[37], got bf16[37]"},
  };
  for (const Case& c : cases) {
    CreateHeadRequest r = AdamWRequest();
    c.change(r);
    absl::Status s = client_->CreateHead(r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.what;
  }
  EXPECT_EQ(fake_.heads.last_create_header().name(), "");  // nothing reached the server
}

TEST_F(HeadsTest, SgdMomentumStateAndABf16Master) {
  CreateHeadRequest r;
  r.name = "sgd";
  r.w = RandomFloats(DType::kBF16, {9, 4}, 5);
  r.compute_dtype = DType::kF16;
  r.optimizer.kind = Optimizer::kSgd;
  r.optimizer.momentum = 0.9;
  r.optimizer.nesterov = true;
  r.optimizer_step = 1;
  r.state[HeadTensor::kExpAvgW] = RandomFloats(DType::kF32, {9, 4}, 6);
  absl::StatusOr<CreateHeadResult> res = client_->CreateHead(r);
  ASSERT_TRUE(res.ok()) << res.status();
  const v1::HeadHeader h = fake_.heads.last_create_header();
  EXPECT_EQ(h.w().dtype(), v1::DTYPE_BF16);
  EXPECT_FALSE(h.has_bias());
  EXPECT_EQ(h.optimizer().kind(), v1::OPTIMIZER_SGD);
  EXPECT_EQ(h.optimizer().momentum(), 0.9);
  EXPECT_TRUE(h.optimizer().nesterov());
  EXPECT_EQ(h.optimizer().weight_decay(), 0.0);  // torch's SGD default
  EXPECT_FALSE(h.optimizer().has_beta1());       // AdamW's arguments stay off an SGD head
  EXPECT_EQ(fake_.heads.Tensor("sgd", v1::TENSOR_HEAD_EXP_AVG_W),
            Bytes(r.state[HeadTensor::kExpAvgW]));
}

TEST_F(HeadsTest, ComputeNamesTheHeadAndItsInstance) {
  ASSERT_TRUE(client_->CreateHead(AdamWRequest("h")).ok());
  ComputeRequest r = HeadCompute("h", 5, 3, 7);
  absl::StatusOr<ComputeResult> res = client_->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->head_version, 5u);
  EXPECT_TRUE(res->head_added);
  EXPECT_TRUE(SameBytes(*res->Find(OutputTensor::kDx), r.x));
  EXPECT_EQ(res->Find(OutputTensor::kDw), nullptr);
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::ComputeHeader& h = fake_.last_header;
    EXPECT_EQ(h.head(), "h");
    EXPECT_EQ(h.head_version(), 5u);
    EXPECT_EQ(h.rank(), 3u);
    EXPECT_EQ(h.micro_batch(), 7u);
    EXPECT_EQ(h.head_instance(), "fake-instance");
    EXPECT_FALSE(h.has_w());
    EXPECT_EQ(h.weight_handle(), "");
  }
  // A retry with the same key is answered but not added.
  res = client_->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_FALSE(res->head_added);
  absl::StatusOr<HeadInfo> info = client_->GetHeadInfo("h");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->contributions, 1u);
  // An older version is the server's refusal, passed on as it is.
  absl::Status s = client_->Compute(HeadCompute("h", 4, 0, 0)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("is at version 5, and this Compute names version 4"));
}

TEST_F(HeadsTest, ComputeRefusesAHeadWithAnotherWeight) {
  const std::vector<std::pair<std::function<void(ComputeRequest&)>, std::string>> cases = {
      {[](ComputeRequest& r) { r.w = RandomTensor(DType::kBF16, {37, 11}, 1); }, "give no w"},
      {[](ComputeRequest& r) { r.weight_handle = "x"; }, "give no weight_handle"},
      {[](ComputeRequest& r) { r.bias = RandomTensor(DType::kBF16, {37}, 1); }, "give no bias"},
      {[](ComputeRequest& r) { r.accumulator = "acc"; }, "give no accumulator"},
      {[](ComputeRequest& r) { r.head = ""; r.w = RandomTensor(DType::kBF16, {37, 11}, 1); },
       "head_version (5), rank (1) and micro_batch (2) go with a head"},
      {[](ComputeRequest& r) { r.head = ""; r.head_version = r.rank = r.micro_batch = 0; },
       "give exactly one of w, weight_handle and head"},
      {[](ComputeRequest& r) { r.want.dw = true; r.output_into[OutputTensor::kDw] = {}; },
       "output_into[dw]: this call does not return dw"},
  };
  for (const auto& [change, message] : cases) {
    ComputeRequest r = HeadCompute("h", 5, 1, 2);
    change(r);
    absl::Status s = client_->Compute(r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(message));
  }
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.last_header.x().dtype(), v1::DTYPE_UNSPECIFIED);  // none was sent
}

TEST_F(HeadsTest, StepSendsEveryFieldAndReturnsTheResult) {
  ASSERT_TRUE(client_->CreateHead(AdamWRequest("h")).ok());
  ASSERT_TRUE(client_->Compute(HeadCompute("h", 5, 0, 0)).ok());
  ASSERT_TRUE(client_->Compute(HeadCompute("h", 5, 0, 1)).ok());
  StepRequest r{"h", 5};
  r.phase = StepPhase::kApply;
  r.lr = 2e-4;
  r.clip_coef = 0.5f;
  absl::StatusOr<StepResult> res = client_->Step(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->version, 6u);
  EXPECT_TRUE(res->applied);
  EXPECT_EQ(res->clip_coef, 0.5f);
  EXPECT_EQ(res->contributions, 2u);
  EXPECT_EQ(res->tokens, 12);
  EXPECT_EQ(res->instance, "fake-instance");
  const v1::StepRequest sent = fake_.heads.last_step();
  EXPECT_EQ(sent.phase(), v1::STEP_APPLY);
  EXPECT_EQ(sent.lr(), 2e-4);
  EXPECT_EQ(sent.clip_coef(), 0.5f);
  EXPECT_FALSE(sent.has_max_norm());
  EXPECT_EQ(sent.world_size(), 1u);
  EXPECT_EQ(sent.head_instance(), "fake-instance");

  r = StepRequest{"h", 6};
  r.skip = true;
  r.max_norm = 1.0;
  res = client_->Step(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_EQ(res->version, 7u);
  EXPECT_FALSE(res->applied);
  EXPECT_TRUE(fake_.heads.last_step().skip());
  EXPECT_EQ(fake_.heads.last_step().max_norm(), 1.0);
  EXPECT_FALSE(fake_.heads.last_step().has_lr());

  absl::Status s = client_->Step(StepRequest{"h", 6}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("is at version 7, not 6"));
}

TEST_F(HeadsTest, StepRefusesBadRequestsBeforeSending) {
  const std::vector<std::pair<std::function<void(StepRequest&)>, std::string>> cases = {
      {[](StepRequest& r) { r.head = ""; }, "head must be 1 to 128 characters, got 0"},
      {[](StepRequest& r) { r.rank = 2; r.world_size = 2; },
       "rank must be < world_size >= 1, got rank 2, world_size 2"},
      {[](StepRequest& r) { r.world_size = 0; }, "got rank 0, world_size 0"},
      {[](StepRequest& r) { r.clip_coef = 0.5f; r.max_norm = 1.0; },
       "give clip_coef (0.5) or max_norm (1), not both"},
      {[](StepRequest& r) { r.clip_coef = -1.0f; }, "clip_coef must be finite and >= 0, got -1"},
      {[](StepRequest& r) { r.max_norm = 0.0; }, "max_norm must be finite and > 0, got 0"},
      {[](StepRequest& r) { r.lr = INFINITY; }, "lr must be finite and >= 0, got inf"},
  };
  for (const auto& [change, message] : cases) {
    StepRequest r{"h", 0};
    change(r);
    absl::Status s = client_->Step(r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << message << ": " << s;
    EXPECT_THAT(s.message(), HasSubstr(message));
  }
  EXPECT_EQ(fake_.heads.last_step().head(), "");
}

TEST_F(HeadsTest, StepIsABarrierOverTheRanks) {
  ASSERT_TRUE(client_->CreateHead(AdamWRequest("h")).ok());
  auto other = Client(Options());
  absl::StatusOr<StepResult> first;
  std::thread rank1([&] {
    StepRequest r{"h", 5, 1, 2};
    first = other->Step(r);
  });
  absl::StatusOr<StepResult> second = client_->Step(StepRequest{"h", 5, 0, 2});
  rank1.join();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->version, 6u);
  EXPECT_EQ(second->version, 6u);
  EXPECT_TRUE(first->applied && second->applied);
}

TEST_F(HeadsTest, ExportInPinnedRangesAndImport) {
  CreateHeadRequest r = AdamWRequest("h");
  ASSERT_TRUE(client_->CreateHead(r).ok());
  ASSERT_TRUE(client_->Step(StepRequest{"h", 5}).ok());  // the fake's step: master + 1
  HostTensor master_into = HostTensor::Owned(DType::kF32, {37, 11});
  std::memset(master_into.mutable_data(), 0xff, master_into.num_bytes());  // poisoned
  ExportHeadOptions o;
  o.range_bytes = 1001;  // rounded down to 1000: ranges fall mid-tensor
  o.into[HeadTensor::kMasterW] = {master_into.mutable_data(), master_into.num_bytes()};
  absl::StatusOr<HeadExport> e = client_->ExportHead("h", o);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->spec.version, 6u);
  EXPECT_EQ(e->spec.optimizer_step, 6);
  EXPECT_TRUE(e->spec.with_state);
  EXPECT_EQ(e->spec.master_dtype, DType::kF32);
  const int64_t n = 37 * 11;
  // master, bias, 6 state tensors in fp32, the bf16 copies.
  EXPECT_EQ(e->bytes, static_cast<uint64_t>(4 * (n + 37) * 4 + 2 * (n + 37)));
  EXPECT_EQ(e->ranges, static_cast<int>((e->bytes + 999) / 1000));
  ASSERT_EQ(e->layout.size(), 10u);
  EXPECT_EQ(e->layout[9].id, HeadTensor::kCopyBias);
  EXPECT_EQ(e->layout[9].dtype, DType::kBF16);
  // The look names no version; every range names the one it saw.
  const std::vector<v1::ExportHeadRequest> reqs = fake_.heads.export_requests();
  ASSERT_EQ(reqs.size(), static_cast<size_t>(e->ranges) + 1);
  EXPECT_FALSE(reqs[0].has_version());
  EXPECT_EQ(reqs[0].range_end(), 4u);
  for (size_t i = 1; i < reqs.size(); ++i) {
    EXPECT_EQ(reqs[i].version(), 6u);
    EXPECT_EQ(reqs[i].range_begin(), 1000 * (i - 1));
    EXPECT_EQ(reqs[i].head_instance(), "fake-instance");
  }
  const HostTensor& master = e->tensors.at(HeadTensor::kMasterW);
  EXPECT_EQ(master.data(), master_into.data());  // landed in the caller's buffer
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(master.data_as<float>()[i], r.w.data_as<float>()[i] + 1.0f) << i;
  }
  EXPECT_EQ(Bytes(e->tensors.at(HeadTensor::kExpAvgSqW)), Bytes(r.state[HeadTensor::kExpAvgSqW]));
  const HostTensor& copy = e->tensors.at(HeadTensor::kCopyW);
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(copy.data_as<uint16_t>()[i], FloatToBf16(master.data_as<float>()[i])) << i;
  }

  ASSERT_TRUE(client_->DropHead("h").ok());
  absl::StatusOr<CreateHeadResult> imported = client_->ImportHead(*e);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_TRUE(imported->created);
  EXPECT_EQ(imported->head.version, 6u);
  EXPECT_EQ(fake_.heads.Tensor("h", v1::TENSOR_HEAD_MASTER_W), Bytes(master));
  EXPECT_EQ(fake_.heads.Tensor("h", v1::TENSOR_HEAD_MAX_EXP_AVG_SQ_BIAS),
            Bytes(r.state[HeadTensor::kMaxExpAvgSqBias]));
  EXPECT_EQ(fake_.heads.last_create_header().optimizer_step(), 6);
}

TEST_F(HeadsTest, ExportRefusals) {
  ASSERT_TRUE(client_->CreateHead(AdamWRequest("h")).ok());
  ExportHeadOptions o;
  std::vector<uint8_t> small(100);
  o.into[HeadTensor::kMasterW] = {small.data(), small.size()};
  absl::Status s = client_->ExportHead("h", o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("options.into[master_w] holds 100 bytes; the fp32[37, 11] "
                                     "tensor needs 1628"));
  EXPECT_EQ(fake_.heads.export_requests().size(), 1u);  // the look alone
  CreateHeadRequest sgd;
  sgd.name = "sgd";
  sgd.w = RandomFloats(DType::kF32, {5, 3}, 1);
  sgd.optimizer.kind = Optimizer::kSgd;
  ASSERT_TRUE(client_->CreateHead(sgd).ok());
  ExportHeadOptions state;
  state.into[HeadTensor::kExpAvgW] = {small.data(), small.size()};
  s = client_->ExportHead("sgd", state).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("the export of head 'sgd' holds no exp_avg_w"));
  s = client_->ExportHead("missing").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("head 'missing' not found on this server"));
  s = client_->ExportHead("bad name").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("head 'bad name' holds ' '"));
}

TEST_F(HeadsTest, AStepBetweenRangesFailsTheExport) {
  ASSERT_TRUE(client_->CreateHead(AdamWRequest("h")).ok());
  auto other = Client(Options());
  ExportHeadOptions o;
  o.range_bytes = 4000;
  bool stepped = false;
  int calls = 0;
  auto on_layout = [](const HeadExport& e) {
    return e.spec.version == 5 ? absl::OkStatus() : absl::InternalError("version");
  };
  auto sink = [&](HeadTensor, uint64_t, const uint8_t*, size_t) {
    ++calls;
    if (!stepped) stepped = other->Step(StepRequest{"h", 5}).ok();
    return absl::OkStatus();
  };
  absl::Status s = client_->ExportHeadTo("h", on_layout, sink, o).status();
  ASSERT_TRUE(stepped);
  EXPECT_GT(calls, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("is at version 6, not 5"));
}

TEST_F(HeadsTest, InfoListDropAndTheInstance) {
  ASSERT_TRUE(client_->CreateHead(AdamWRequest("h")).ok());
  absl::StatusOr<std::vector<StateEntry>> list = client_->List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].kind, StateEntry::Kind::kHead);
  EXPECT_EQ((*list)[0].name, "h");
  EXPECT_EQ((*list)[0].version, 5u);
  EXPECT_GT((*list)[0].bytes, 0u);
  // A restarted server (another instance) refuses what names the old one.
  fake_.heads.set_instance("restarted");
  absl::Status s = client_->Step(StepRequest{"h", 5}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("head_instance 'fake-instance' is not this server"));
  // Info learns the new one (there the head exists: it was imported).
  absl::StatusOr<HeadInfo> info = client_->GetHeadInfo("h");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->instance, "restarted");
  EXPECT_EQ(info->version, 5u);
  EXPECT_TRUE(client_->Step(StepRequest{"h", 5}).ok());
  ASSERT_TRUE(client_->DropHead("h").ok());
  s = client_->GetHeadInfo("h").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("head 'h' not found on this server"));
  s = client_->DropHead("h");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  s = client_->DropHead("");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("head must be 1 to 128 characters"));
}

}  // namespace
}  // namespace client
}  // namespace lossd
