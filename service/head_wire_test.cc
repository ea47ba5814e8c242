// SPDX-License-Identifier: Apache-2.0
// Tests the hosted-head wire conversions: torch's optimizer defaults, every refusal (code and
// the field it names), and that what goes out (an export's header, HeadInfo, StepResponse)
// reads back as what came in.
#include "service/head_wire.h"

#include <random>
#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace {

void ExpectRefused(const absl::Status& s, absl::StatusCode code, const std::string& want) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(want), std::string::npos) << s;
}

v1::HeadHeader AdamWHeader(int64_t v, int64_t h) {
  v1::HeadHeader hh;
  hh.set_name("run-7/head");
  hh.mutable_w()->set_dtype(v1::DTYPE_FP32);
  hh.mutable_w()->add_shape(v);
  hh.mutable_w()->add_shape(h);
  hh.set_compute_dtype(v1::DTYPE_BF16);
  hh.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  return hh;
}

TEST(HeadWireTest, AdamWTakesTorchDefaults) {
  auto spec = HeadSpecFromWire(AdamWHeader(123, 31), "header");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "run-7/head");
  EXPECT_EQ(spec->v, 123);
  EXPECT_EQ(spec->h, 31);
  EXPECT_FALSE(spec->has_bias);
  EXPECT_EQ(spec->master_dtype, DType::kF32);
  EXPECT_EQ(spec->compute_dtype, DType::kBF16);
  const HeadOptimizer& o = spec->optimizer;
  EXPECT_EQ(o.kind, OptimizerKind::kAdamW);
  EXPECT_EQ(o.lr, 1e-3);
  EXPECT_EQ(o.weight_decay, 0.01);
  EXPECT_EQ(o.bias_weight_decay, 0.0);
  EXPECT_EQ(o.beta1, 0.9);
  EXPECT_EQ(o.beta2, 0.999);
  EXPECT_EQ(o.eps, 1e-8);
  EXPECT_FALSE(o.amsgrad);
}

TEST(HeadWireTest, SgdDefaultsToNoWeightDecayAndKeepsWhatWasGiven) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> u(0.01, 0.99);
  v1::OptimizerConfig c;
  c.set_kind(v1::OPTIMIZER_SGD);
  auto o = OptimizerFromWire(c, "header.optimizer");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->kind, OptimizerKind::kSgd);
  EXPECT_EQ(o->weight_decay, 0.0);
  EXPECT_EQ(o->lr, 1e-3);
  const double lr = u(rng), wd = u(rng), bwd = u(rng), mom = u(rng), damp = u(rng);
  c.set_lr(lr);
  c.set_weight_decay(wd);
  c.set_bias_weight_decay(bwd);
  c.set_momentum(mom);
  c.set_dampening(damp);
  c.set_nesterov(true);
  o = OptimizerFromWire(c, "header.optimizer");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->lr, lr);
  EXPECT_EQ(o->weight_decay, wd);
  EXPECT_EQ(o->bias_weight_decay, bwd);
  EXPECT_EQ(o->momentum, mom);
  EXPECT_EQ(o->dampening, damp);
  EXPECT_TRUE(o->nesterov);
  // A weight decay of 0 given for AdamW is 0, not the default.
  v1::OptimizerConfig a;
  a.set_kind(v1::OPTIMIZER_ADAMW);
  a.set_weight_decay(0);
  o = OptimizerFromWire(a, "header.optimizer");
  ASSERT_TRUE(o.ok()) << o.status();
  EXPECT_EQ(o->weight_decay, 0.0);
}

TEST(HeadWireTest, OptimizerRefusals) {
  v1::OptimizerConfig c;
  ExpectRefused(OptimizerFromWire(c, "header.optimizer").status(),
                absl::StatusCode::kInvalidArgument,
                "header.optimizer.kind is OPTIMIZER_UNSPECIFIED");
  c.set_kind(static_cast<v1::OptimizerKind>(9));
  ExpectRefused(OptimizerFromWire(c, "header.optimizer").status(),
                absl::StatusCode::kInvalidArgument,
                "header.optimizer.kind 9 is not a known optimizer");
  c.set_kind(v1::OPTIMIZER_SGD);
  c.set_beta2(0.95);
  ExpectRefused(OptimizerFromWire(c, "header.optimizer").status(),
                absl::StatusCode::kInvalidArgument,
                "header.optimizer.beta2 is set, but SGD has no such argument");
  c.Clear();
  c.set_kind(v1::OPTIMIZER_ADAMW);
  c.set_momentum(0.9);
  ExpectRefused(OptimizerFromWire(c, "header.optimizer").status(),
                absl::StatusCode::kInvalidArgument,
                "header.optimizer.momentum is set, but AdamW has no such argument");
}

TEST(HeadWireTest, HeaderRefusalsNameTheField) {
  v1::HeadHeader h = AdamWHeader(10, 4);
  h.clear_w();
  ExpectRefused(HeadSpecFromWire(h, "header").status(), absl::StatusCode::kInvalidArgument,
                "header.w is missing");
  h = AdamWHeader(10, 4);
  h.mutable_w()->add_shape(2);
  ExpectRefused(HeadSpecFromWire(h, "header").status(), absl::StatusCode::kInvalidArgument,
                "header.w.shape must be (V, H), got [10, 4, 2]");
  h = AdamWHeader(10, 4);
  h.mutable_w()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectRefused(HeadSpecFromWire(h, "header").status(), absl::StatusCode::kInvalidArgument,
                "header.w.dtype is unspecified");
  h = AdamWHeader(10, 4);
  h.mutable_bias()->set_dtype(v1::DTYPE_FP32);
  h.mutable_bias()->add_shape(11);
  ExpectRefused(HeadSpecFromWire(h, "header").status(), absl::StatusCode::kInvalidArgument,
                "header.bias.shape must be (V) = [10], got [11]");
  h.mutable_bias()->set_shape(0, 10);
  h.mutable_bias()->set_dtype(v1::DTYPE_BF16);
  ExpectRefused(HeadSpecFromWire(h, "header").status(), absl::StatusCode::kInvalidArgument,
                "header.bias.dtype DTYPE_BF16 differs from header.w.dtype DTYPE_FP32");
  h = AdamWHeader(10, 4);
  h.set_compute_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectRefused(HeadSpecFromWire(h, "header").status(), absl::StatusCode::kInvalidArgument,
                "header.compute_dtype is unspecified");
  h = AdamWHeader(10, 4);
  h.mutable_optimizer()->set_kind(v1::OPTIMIZER_UNSPECIFIED);
  ExpectRefused(HeadSpecFromWire(h, "header").status(), absl::StatusCode::kInvalidArgument,
                "header.optimizer.kind is OPTIMIZER_UNSPECIFIED");
}

// An export's header, read back by CreateHead, is the head it described.
TEST(HeadWireTest, HeaderRoundTrips) {
  for (v1::OptimizerKind kind : {v1::OPTIMIZER_SGD, v1::OPTIMIZER_ADAMW}) {
    v1::HeadHeader h = AdamWHeader(47, 31);
    h.mutable_bias()->set_dtype(v1::DTYPE_FP32);
    h.mutable_bias()->add_shape(47);
    h.mutable_optimizer()->set_kind(kind);
    if (kind == v1::OPTIMIZER_SGD) h.mutable_optimizer()->set_momentum(0.9);
    if (kind == v1::OPTIMIZER_ADAMW) h.mutable_optimizer()->set_amsgrad(true);
    h.set_version(12);
    h.set_optimizer_step(11);
    h.set_with_state(true);
    auto spec = HeadSpecFromWire(h, "header");
    ASSERT_TRUE(spec.ok()) << spec.status();
    auto again = HeadSpecFromWire(HeadHeaderToWire(*spec), "header");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->name, spec->name);
    EXPECT_EQ(again->v, 47);
    EXPECT_EQ(again->h, 31);
    EXPECT_TRUE(again->has_bias);
    EXPECT_EQ(again->version, 12u);
    EXPECT_EQ(again->optimizer_step, 11);
    EXPECT_TRUE(again->with_state);
    const HeadOptimizer& a = again->optimizer;
    const HeadOptimizer& b = spec->optimizer;
    EXPECT_EQ(a.kind, b.kind);
    EXPECT_EQ(a.lr, b.lr);
    EXPECT_EQ(a.weight_decay, b.weight_decay);
    EXPECT_EQ(a.momentum, b.momentum);
    EXPECT_EQ(a.beta1, b.beta1);
    EXPECT_EQ(a.beta2, b.beta2);
    EXPECT_EQ(a.eps, b.eps);
    EXPECT_EQ(a.amsgrad, b.amsgrad);
  }
}

// A head group's members, this server's index and the id reach the engine, and HeadInfo
// gives them back (every rank routes by them); a one-server head's HeadInfo has no group.
TEST(HeadWireTest, HeadGroupRoundTrips) {
  v1::HeadHeader h = AdamWHeader(12, 4);
  h.mutable_group()->add_members("10.0.0.1:50051");
  h.mutable_group()->add_members("10.0.0.2:50051");
  h.mutable_group()->set_member(1);
  h.mutable_group()->set_id("job-3/head-group");
  auto spec = HeadSpecFromWire(h, "header");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->group.members, (std::vector<std::string>{"10.0.0.1:50051", "10.0.0.2:50051"}));
  EXPECT_EQ(spec->group.member, 1u);
  EXPECT_EQ(spec->group.id, "job-3/head-group");
  HeadSummary s;
  s.group = spec->group;
  v1::HeadInfo info = HeadInfoToWire(s, "i");
  EXPECT_EQ(info.group().members_size(), 2);
  EXPECT_EQ(info.group().member(), 1u);
  EXPECT_EQ(info.group().id(), "job-3/head-group");
  EXPECT_FALSE(HeadInfoToWire(HeadSummary{}, "i").has_group());
}

TEST(HeadWireTest, StepRequestAndResponse) {
  v1::StepRequest r;
  r.set_head("h");
  r.set_version(5);
  r.set_rank(3);
  r.set_world_size(4);
  r.set_phase(v1::STEP_APPLY);
  r.set_clip_coef(0.25f);
  r.set_skip(true);
  auto c = StepCallFromWire(r);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head, "h");
  EXPECT_EQ(c->version, 5u);
  EXPECT_EQ(c->rank, 3u);
  EXPECT_EQ(c->world_size, 4u);
  EXPECT_EQ(c->phase, StepPhase::kApply);
  EXPECT_FALSE(c->lr.has_value());
  ASSERT_TRUE(c->clip_coef.has_value());
  EXPECT_EQ(*c->clip_coef, 0.25f);
  EXPECT_FALSE(c->max_norm.has_value());
  EXPECT_TRUE(c->skip);
  r.set_phase(static_cast<v1::StepPhase>(3));
  ExpectRefused(StepCallFromWire(r).status(), absl::StatusCode::kInvalidArgument,
                "StepRequest.phase 3 is not STEP_FULL, STEP_REDUCE or STEP_APPLY");

  StepResult s;
  s.version = 6;
  s.grad_norm = 3.5;
  s.finite = true;
  s.applied = true;
  s.clip_coef = 0.5f;
  s.contributions = 16;
  s.tokens = 8192;
  s.step_seconds = 0.002;
  const v1::StepResponse w = StepResponseToWire(s, "inst");
  EXPECT_EQ(w.version(), 6u);
  EXPECT_EQ(w.grad_norm(), 3.5);
  EXPECT_TRUE(w.finite());
  EXPECT_TRUE(w.applied());
  EXPECT_EQ(w.clip_coef(), 0.5f);
  EXPECT_EQ(w.contributions(), 16u);
  EXPECT_EQ(w.tokens(), 8192);
  EXPECT_EQ(w.step_seconds(), 0.002);
  EXPECT_EQ(w.instance(), "inst");
}

TEST(HeadWireTest, HeadTensorIds) {
  for (int i = 0; i < static_cast<int>(HeadTensor::kCount); ++i) {
    const HeadTensor t = static_cast<HeadTensor>(i);
    auto back = HeadTensorFromWire(HeadTensorToWire(t), "part.tensor");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(HeadTensorToWire(HeadTensor::kExpAvgSqBias), v1::TENSOR_HEAD_EXP_AVG_SQ_BIAS);
  ExpectRefused(HeadTensorFromWire(v1::TENSOR_W, "part.tensor").status(),
                absl::StatusCode::kInvalidArgument,
                "part.tensor TENSOR_W is not a head tensor");
  ExpectRefused(HeadTensorFromWire(static_cast<v1::TensorId>(77), "part.tensor").status(),
                absl::StatusCode::kInvalidArgument, "part.tensor 77 is not a head tensor");
  const v1::TensorSpec w = HeadTensorSpec(HeadTensor::kExpAvgW, 47, 31, DType::kBF16);
  EXPECT_EQ(w.dtype(), v1::DTYPE_FP32);
  ASSERT_EQ(w.shape_size(), 2);
  EXPECT_EQ(w.shape(0), 47);
  EXPECT_EQ(w.shape(1), 31);
  const v1::TensorSpec b = HeadTensorSpec(HeadTensor::kCopyBias, 47, 31, DType::kBF16);
  EXPECT_EQ(b.dtype(), v1::DTYPE_BF16);
  ASSERT_EQ(b.shape_size(), 1);
  EXPECT_EQ(b.shape(0), 47);
}

TEST(HeadWireTest, ListEntries) {
  StateInfo s;
  s.kind = StateInfo::Kind::kHead;
  s.name = "h";
  s.bytes = 1000;
  s.last_used_ns = 5'000'000'123;
  s.micro_batches = 3;
  s.version = 9;
  v1::StateEntry e;
  StateEntryToWire(s, &e);
  EXPECT_EQ(e.kind(), v1::STATE_HEAD);
  EXPECT_EQ(e.name(), "h");
  EXPECT_EQ(e.bytes(), 1000u);
  EXPECT_EQ(e.last_used_unix_ms(), 5000);
  EXPECT_EQ(e.micro_batches(), 3u);
  EXPECT_EQ(e.version(), 9u);
  s.kind = StateInfo::Kind::kAccumulator;
  StateEntryToWire(s, &e);
  EXPECT_EQ(e.kind(), v1::STATE_ACCUMULATOR);
}

}  // namespace
}  // namespace lossd
