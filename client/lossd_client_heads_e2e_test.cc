// SPDX-License-Identifier: Apache-2.0
// Tests the client's hosted-head calls end to end against a real lossd server (engine, CPU
// backend, gRPC on loopback, in this process): create, Compute on the head from two ranks,
// the Step barrier, export in ranges, import and continue, info, list, drop, and the
// server's refusals as the client hands them back. The optimizer's math is the engine's
// tests' business (bit for bit against the backend's step); here SGD without momentum or
// weight decay, p + (-lr) * g, is checked bit for bit against the summed gradient an
// accumulator gives for the same Computes.
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/host_tensor.h"
#include "client/lossd_client.h"
#include "core/dtype.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/client/test_tensors.h"
#include "testing/server_harness.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;
using testing_harness::Harness;

constexpr int64_t kV = 67, kH = 24, kBT = 13;  // nothing a multiple of 8
constexpr double kLr = 0.05;

// The number of bytes that differ between two tensors, and the first of them.
std::string Mismatch(const HostTensor& got, const HostTensor& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype()) {
    return absl::StrCat(got.DebugString(), " vs ", want.DebugString());
  }
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < want.num_bytes(); ++i) {
    if (got.data()[i] != want.data()[i] && bad++ == 0) first = i;
  }
  return bad == 0 ? "" : absl::StrCat(bad, " bytes differ, first at ", first);
}

class HeadsE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClientOptions o;
    o.target = absl::StrCat("127.0.0.1:", harness_.port());
    o.deadline = absl::Seconds(60);
    o.part_bytes = 1000;  // every tensor travels as several parts
    auto c = LossClient::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }

  CreateHeadRequest Head(const std::string& name, Optimizer kind, DType master = DType::kF32) {
    CreateHeadRequest r;
    r.name = name;
    r.w = UniformTensor(master, {kV, kH}, 1, 0.5f);
    r.bias = UniformTensor(master, {kV}, 2, 0.5f);
    r.optimizer.kind = kind;
    r.optimizer.lr = kLr;
    r.optimizer.amsgrad = kind == Optimizer::kAdamW;
    return r;
  }

  // Micro-batch `seed` of a data-parallel step: averaging over 2 ranks is grad_scale 0.5.
  ComputeRequest MicroBatch(uint32_t seed) {
    ComputeRequest r;
    r.x = UniformTensor(DType::kBF16, {kBT, kH}, 100 + seed, 2.0f);
    r.targets = HostTensor::Owned(DType::kI64, {kBT});
    std::mt19937 gen(200 + seed);
    for (int64_t i = 0; i < kBT; ++i) r.targets.mutable_data_as<int64_t>()[i] = gen() % kV;
    r.targets.mutable_data_as<int64_t>()[3] = -100;  // one ignored row
    r.options.grad_scale = 0.5f;
    r.want.dx = true;
    r.want.dw = false;
    return r;
  }

  ComputeRequest OnHead(ComputeRequest r, const std::string& head, uint64_t version,
                        uint32_t rank, uint64_t mb) {
    r.head = head;
    r.head_version = version;
    r.rank = rank;
    r.micro_batch = mb;
    return r;
  }

  // Steps `head` at `version` from `world` ranks at once; every rank's result.
  std::vector<absl::StatusOr<StepResult>> StepAll(const std::string& head, uint64_t version,
                                                  uint32_t world) {
    std::vector<absl::StatusOr<StepResult>> out(world, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (uint32_t rank = 0; rank < world; ++rank) {
      threads.emplace_back(
          [&, rank] { out[rank] = client_->Step({head, version, rank, world}); });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  absl::StatusOr<HeadExport> Export(const std::string& head, uint64_t range_bytes = 1 << 20) {
    ExportHeadOptions o;
    o.range_bytes = range_bytes;
    return client_->ExportHead(head, o);
  }

  // Micro-batch (rank, mb) of version 0 on head "sgd", and the same Compute on the head's
  // copy into accumulator "oracle": dX must agree bit for bit. *tokens grows by its tokens.
  void ComputeWithOracle(uint32_t rank, uint64_t mb, const HostTensor& copy_w,
                         const HostTensor& copy_b, int64_t* tokens) {
    const ComputeRequest plain = MicroBatch(rank * 2 + mb);
    absl::StatusOr<ComputeResult> on_head = client_->Compute(OnHead(plain, "sgd", 0, rank, mb));
    ASSERT_TRUE(on_head.ok()) << on_head.status();
    EXPECT_TRUE(on_head->head_added);
    EXPECT_EQ(on_head->head_version, 0u);
    EXPECT_EQ(on_head->Find(OutputTensor::kDw), nullptr);
    ComputeRequest oracle = plain;
    oracle.w = HostTensor::View(DType::kBF16, {kV, kH}, copy_w.data());
    oracle.bias = HostTensor::View(DType::kBF16, {kV}, copy_b.data());
    oracle.accumulator = "oracle";
    absl::StatusOr<ComputeResult> want = client_->Compute(oracle);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(Mismatch(*on_head->Find(OutputTensor::kDx), *want->Find(OutputTensor::kDx)), "");
    *tokens += on_head->tokens;
  }

  Harness harness_;
  std::unique_ptr<LossClient> client_;
};

// Two ranks, two micro-batches each, a retry, then the barrier: the update is applied once,
// to the sum of the four, as SGD would; the copy is the master's cast.
TEST_F(HeadsE2eTest, TwoRanksComputeAndStepOnce) {
  absl::StatusOr<ServerInfoResult> server = client_->ServerInfo();
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<CreateHeadResult> created = client_->CreateHead(Head("sgd", Optimizer::kSgd));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_TRUE(created->created);
  EXPECT_EQ(created->head.version, 0u);
  EXPECT_EQ(created->head.instance, server->instance);
  EXPECT_EQ(created->head.optimizer.WeightDecay(), 0.0);  // torch's SGD default
  absl::StatusOr<HeadExport> before = Export("sgd");
  ASSERT_TRUE(before.ok()) << before.status();
  const HostTensor& copy_w = before->tensors.at(HeadTensor::kCopyW);
  const HostTensor& copy_b = before->tensors.at(HeadTensor::kCopyBias);

  int64_t tokens = 0;
  for (uint32_t rank = 0; rank < 2; ++rank) {
    for (uint64_t mb = 0; mb < 2; ++mb) {
      ASSERT_NO_FATAL_FAILURE(ComputeWithOracle(rank, mb, copy_w, copy_b, &tokens));
    }
  }
  absl::StatusOr<ComputeResult> retry = client_->Compute(OnHead(MicroBatch(3), "sgd", 0, 1, 1));
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_FALSE(retry->head_added);
  absl::StatusOr<FetchGradientsResult> sum = client_->FetchGradients("oracle", true);
  ASSERT_TRUE(sum.ok()) << sum.status();
  ASSERT_TRUE(sum->db.has_value());
  EXPECT_EQ(sum->micro_batches, 4u);
  double sq = 0;
  for (int64_t i = 0; i < kV * kH; ++i) sq += std::pow(double{sum->dw.data_as<float>()[i]}, 2);
  for (int64_t i = 0; i < kV; ++i) sq += std::pow(double{sum->db->data_as<float>()[i]}, 2);

  for (const absl::StatusOr<StepResult>& r : StepAll("sgd", 0, 2)) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->version, 1u);
    EXPECT_TRUE(r->applied);
    EXPECT_TRUE(r->finite);
    EXPECT_EQ(r->contributions, 4u);
    EXPECT_EQ(r->tokens, tokens);
    EXPECT_EQ(r->clip_coef, 1.0f);
    EXPECT_NEAR(r->grad_norm, std::sqrt(sq), 1e-12 * std::sqrt(sq));
  }
  absl::StatusOr<HeadExport> after = Export("sgd", 1000);  // ranges fall mid-tensor
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->spec.version, 1u);
  EXPECT_GT(after->ranges, 10);
  const float neg_lr = static_cast<float>(-kLr);
  auto expect_step = [&](HeadTensor master, HeadTensor copy, const float* g, int64_t n) {
    const float* p0 = before->tensors.at(master).data_as<float>();
    const float* p1 = after->tensors.at(master).data_as<float>();
    const uint16_t* c1 = after->tensors.at(copy).data_as<uint16_t>();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float scaled = neg_lr * g[i];  // two roundings, as torch's add_(g, alpha=-lr)
      const float want = p0[i] + scaled;
      bad += std::memcmp(&p1[i], &want, 4) != 0 || c1[i] != FloatToBf16(p1[i]);
    }
    EXPECT_EQ(bad, 0) << HeadTensorName(master);
  };
  expect_step(HeadTensor::kMasterW, HeadTensor::kCopyW, sum->dw.data_as<float>(), kV * kH);
  expect_step(HeadTensor::kMasterBias, HeadTensor::kCopyBias, sum->db->data_as<float>(), kV);

  // Version 0 is over: a Compute or Step naming it is refused, naming the current one.
  absl::Status s = client_->Compute(OnHead(MicroBatch(0), "sgd", 0, 0, 9)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(),
              HasSubstr("head 'sgd' is at version 1, and this Compute names version 0"));
  s = client_->Step({"sgd", 2}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("head 'sgd' is at version 1, not 2"));
}

// An export in ranges equals a whole one; imported under another name, both heads take the
// same next step and stay equal bit for bit (AdamW with amsgrad, every state tensor).
TEST_F(HeadsE2eTest, ExportImportAndContinueEqualsNeverStopping) {
  ASSERT_TRUE(client_->CreateHead(Head("a", Optimizer::kAdamW)).ok());
  ASSERT_TRUE(client_->Compute(OnHead(MicroBatch(0), "a", 0, 0, 0)).ok());
  ASSERT_TRUE(client_->Step({"a", 0}).ok());
  absl::StatusOr<HeadExport> whole = Export("a");
  absl::StatusOr<HeadExport> ranged = Export("a", 700);
  ASSERT_TRUE(whole.ok()) << whole.status();
  ASSERT_TRUE(ranged.ok()) << ranged.status();
  EXPECT_EQ(whole->ranges, 1);
  EXPECT_EQ(whole->spec.optimizer_step, 1);
  ASSERT_EQ(whole->layout.size(), 10u);  // master, 3 states, copy; W and bias each
  for (const auto& [id, t] : whole->tensors) {
    EXPECT_EQ(Mismatch(ranged->tensors.at(id), t), "") << HeadTensorName(id);
  }
  HeadExport as_b = *std::move(ranged);
  as_b.spec.name = "b";
  absl::StatusOr<CreateHeadResult> b = client_->ImportHead(as_b);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE(b->created);
  EXPECT_EQ(b->head.version, 1u);
  EXPECT_EQ(b->head.optimizer_step, 1);
  // Importing it again at the same version changes nothing; another version is refused.
  b = client_->ImportHead(as_b);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_FALSE(b->created);
  for (const std::string head : {"a", "b"}) {
    ASSERT_TRUE(client_->Compute(OnHead(MicroBatch(1), head, 1, 0, 0)).ok());
    ASSERT_TRUE(client_->Compute(OnHead(MicroBatch(2), head, 1, 0, 1)).ok());
    ASSERT_TRUE(client_->Step({head, 1}).ok());
  }
  absl::StatusOr<HeadExport> a2 = Export("a");
  absl::StatusOr<HeadExport> b2 = Export("b");
  ASSERT_TRUE(a2.ok() && b2.ok());
  EXPECT_EQ(a2->spec.version, 2u);
  for (const auto& [id, t] : a2->tensors) {
    EXPECT_EQ(Mismatch(b2->tensors.at(id), t), "") << HeadTensorName(id);
    if (id == HeadTensor::kMasterW) EXPECT_NE(Mismatch(t, whole->tensors.at(id)), "");
  }
  absl::Status s = client_->ImportHead(as_b).status();  // version 1; b is at 2
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("head 'b' exists (version 2"));
}

TEST_F(HeadsE2eTest, InfoListSkipDropAndRefusals) {
  // A bf16 master is its upcast: exported as fp32 with the same values.
  CreateHeadRequest r = Head("h", Optimizer::kSgd, DType::kBF16);
  r.compute_dtype = DType::kBF16;
  ASSERT_TRUE(client_->CreateHead(r).ok());
  absl::StatusOr<HeadExport> e = Export("h");
  ASSERT_TRUE(e.ok()) << e.status();
  const HostTensor& master = e->tensors.at(HeadTensor::kMasterW);
  ASSERT_EQ(master.dtype(), DType::kF32);
  for (int64_t i = 0; i < kV * kH; ++i) {
    ASSERT_EQ(master.data_as<float>()[i], Bf16ToFloat(r.w.data_as<uint16_t>()[i])) << i;
  }
  ASSERT_TRUE(client_->Compute(OnHead(MicroBatch(0), "h", 0, 0, 0)).ok());
  absl::StatusOr<HeadInfo> info = client_->GetHeadInfo("h");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->v, kV);
  EXPECT_EQ(info->h, kH);
  EXPECT_TRUE(info->has_bias);
  EXPECT_EQ(info->contributions, 1u);
  EXPECT_GT(info->bytes, static_cast<uint64_t>(kV * kH * 4));
  absl::StatusOr<std::vector<StateEntry>> list = client_->List();
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].kind, StateEntry::Kind::kHead);
  EXPECT_EQ((*list)[0].name, "h");
  EXPECT_EQ((*list)[0].bytes, info->bytes);

  // A skipped step (GradScaler found an Inf): the version moves, W does not.
  StepRequest skip{"h", 0};
  skip.skip = true;
  absl::StatusOr<StepResult> skipped = client_->Step(skip);
  ASSERT_TRUE(skipped.ok()) << skipped.status();
  EXPECT_EQ(skipped->version, 1u);
  EXPECT_FALSE(skipped->applied);
  absl::StatusOr<HeadExport> after = Export("h");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(Mismatch(after->tensors.at(HeadTensor::kMasterW), master), "");

  ComputeRequest fp32 = OnHead(MicroBatch(1), "h", 1, 0, 0);
  fp32.x = UniformTensor(DType::kF32, {kBT, kH}, 5, 1.0f);
  absl::Status s = client_->Compute(fp32).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("does not fit head 'h'"));
  CreateHeadRequest other = Head("h", Optimizer::kSgd, DType::kBF16);
  s = client_->CreateHead(other).status();  // version 0; h is at 1
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(s.message(), HasSubstr("head 'h' exists (version 1"));

  ASSERT_TRUE(client_->DropHead("h").ok());
  s = client_->GetHeadInfo("h").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("head 'h' not found on this server"));
  s = client_->DropHead("h");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  s = client_->Compute(OnHead(MicroBatch(1), "h", 1, 0, 1)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("head 'h' not found on this server"));
  list = client_->List();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_TRUE(list->empty());
}

}  // namespace
}  // namespace client
}  // namespace lossd
