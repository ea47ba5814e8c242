// SPDX-License-Identifier: Apache-2.0
// The plugin ABI's conversions: every field survives a round trip through its C struct, and a
// status crosses as its code and message (cut to the caller's buffer).
#include "kernels/plugin_abi_convert.h"

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "core/loss_problem.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/optimizer.h"
#include "kernels/plugin_abi.h"

namespace lossd {
namespace {

TEST(PluginAbiConvertTest, StatusCrossesAsCodeAndMessage) {
  StatusBuffer buf;
  const absl::Status s = absl::ResourceExhaustedError("cuda: this problem needs 5 bytes");
  const int32_t code = WriteStatus(s, buf.get());
  EXPECT_EQ(code, 8);
  EXPECT_EQ(buf.ToStatus(code), s);
  EXPECT_EQ(WriteStatus(absl::OkStatus(), buf.get()), 0);
  EXPECT_TRUE(buf.ToStatus(0).ok());
}

TEST(PluginAbiConvertTest, LongMessagesAreCutToTheCallersBuffer) {
  char small[8];
  LossdStatus st{0, small, sizeof(small)};
  EXPECT_EQ(WriteStatus(absl::InvalidArgumentError("0123456789"), &st), 3);
  EXPECT_EQ(st.code, 3);
  EXPECT_STREQ(small, "0123456");
}

TEST(PluginAbiConvertTest, ShapeRoundTrips) {
  WorkspaceShape s;
  s.bt = 47;
  s.h = 31;
  s.v = 123;
  s.dtype = DType::kF16;
  s.grad_dtype = DType::kF32;
  s.w_memory = Memory::kBackend;
  s.has_bias = true;
  s.has_class_weights = true;
  s.has_grad_output = true;
  s.rows_streamed = true;
  s.chunk_rows = 9;
  s.want_dx = true;
  s.dw = GradOut::kAccumulated;
  s.db = GradOut::kWritten;
  s.accum_memory = Memory::kBackend;
  s.kind = LossKind::kDistill;
  s.teacher_h = 17;
  s.teacher_w_memory = Memory::kBackend;
  s.want_entropy = true;
  const WorkspaceShape r = FromC(ToC(s));
  EXPECT_EQ(r.bt, 47);
  EXPECT_EQ(r.h, 31);
  EXPECT_EQ(r.v, 123);
  EXPECT_EQ(r.dtype, DType::kF16);
  EXPECT_EQ(r.grad_dtype, DType::kF32);
  EXPECT_EQ(r.w_memory, Memory::kBackend);
  EXPECT_TRUE(r.has_bias);
  EXPECT_TRUE(r.has_class_weights);
  EXPECT_TRUE(r.has_grad_output);
  EXPECT_TRUE(r.rows_streamed);
  EXPECT_EQ(r.chunk_rows, 9);
  EXPECT_TRUE(r.want_dx);
  EXPECT_EQ(r.dw, GradOut::kAccumulated);
  EXPECT_EQ(r.db, GradOut::kWritten);
  EXPECT_EQ(r.accum_memory, Memory::kBackend);
  EXPECT_EQ(r.kind, LossKind::kDistill);
  EXPECT_EQ(r.teacher_h, 17);
  EXPECT_EQ(r.teacher_w_memory, Memory::kBackend);
  EXPECT_TRUE(r.want_entropy);
}

// A problem with every field set to something other than its default; its pointers point into
// f (4 floats) and i (2 ints), which the caller keeps alive.
LossProblem EveryFieldSet(float* f, int64_t* i) {
  LossProblem p;
  p.bt = 3;
  p.h = 5;
  p.v = 7;
  p.dtype = DType::kF32;
  p.x = &f[0];
  p.w = &f[1];
  p.w_memory = Memory::kBackend;
  p.bias = &f[2];
  p.targets = &i[0];
  p.target_dtype = DType::kI32;
  p.class_weights = &f[3];
  p.grad_output = &f[0];
  p.options.ignore_index = -7;
  p.options.reduction = Reduction::kNone;
  p.options.label_smoothing = 0.25f;
  p.options.z_loss_scale = 1e-4f;
  p.options.softcap = 30.0f;
  p.options.grad_scale = 0.5f;
  p.options.chunk_rows = 2;
  p.options.token_scaling = true;
  p.options.temperature = 0.7f;
  p.kind = LossKind::kPolicy;
  p.dlogp = &f[1];
  p.dentropy = &f[2];
  p.advantages = &f[3];
  p.old_logp = &f[0];
  p.ref_logp = &f[1];
  p.policy.loss_type = PolicyLossType::kDrGrpo;
  p.policy.epsilon_low = 0.1f;
  p.policy.epsilon_high = 0.3f;
  p.policy.beta = 0.05f;
  p.policy.sequences = 3;
  p.policy.max_completion_length = 11;
  p.policy.dapo_normalizer = 2.5;
  p.policy.sapo_temperature_pos = 1.5f;
  p.policy.sapo_temperature_neg = 0.75f;
  p.policy.delta = 1.75f;
  p.policy.use_bias_correction_kl = true;
  p.teacher_h = 13;
  p.teacher_x = &f[2];
  p.teacher_w = &f[3];
  p.teacher_w_memory = Memory::kBackend;
  p.teacher_bias = &f[0];
  p.distill.jsd_beta = 0.25f;
  p.is_ratio = &f[2];
  p.policy.importance_sampling = ImportanceSampling::kSequence;
  p.policy.kl_estimator = KlEstimator::kLowVarKl;
  p.policy.kl_straight_through = true;
  p.policy.entropy_coeff = -0.125f;
  p.policy.aggregation = PolicyAggregation::kSeqMeanTokenSumNorm;
  p.policy.loss_scale_factor = 48.5;
  p.distill.weight_hard_loss = 0.375f;
  p.distill.weight_soft_loss = 0.625f;
  p.policy.kl_cov_ratio = 0.0625;
  p.policy.ppo_kl_coef = 0.875f;
  p.policy.vespo_k_pos = 1.25f;  // none of them the default
  p.policy.vespo_lambda_pos = 2.75f;
  p.policy.vespo_k_neg = -0.5f;
  p.policy.vespo_lambda_neg = 0.25f;
  return p;
}

TEST(PluginAbiConvertTest, ProblemRoundTrips) {
  float f[4] = {1, 2, 3, 4};
  int64_t i[2] = {5, 6};
  const LossProblem p = EveryFieldSet(f, i);
  const LossdRowStream rows{nullptr, nullptr, nullptr};
  const LossdProblem c = ToC(p, &rows);
  EXPECT_EQ(c.rows, &rows);
  const LossProblem r = FromC(c, nullptr);
  EXPECT_EQ(r.bt, p.bt);
  EXPECT_EQ(r.h, p.h);
  EXPECT_EQ(r.v, p.v);
  EXPECT_EQ(r.dtype, p.dtype);
  EXPECT_EQ(r.x, p.x);
  EXPECT_EQ(r.w, p.w);
  EXPECT_EQ(r.w_memory, p.w_memory);
  EXPECT_EQ(r.bias, p.bias);
  EXPECT_EQ(r.targets, p.targets);
  EXPECT_EQ(r.target_dtype, p.target_dtype);
  EXPECT_EQ(r.class_weights, p.class_weights);
  EXPECT_EQ(r.grad_output, p.grad_output);
  EXPECT_EQ(r.options.ignore_index, -7);
  EXPECT_EQ(r.options.reduction, Reduction::kNone);
  EXPECT_EQ(r.options.label_smoothing, 0.25f);
  EXPECT_EQ(r.options.z_loss_scale, 1e-4f);
  EXPECT_EQ(r.options.softcap, 30.0f);
  EXPECT_EQ(r.options.grad_scale, 0.5f);
  EXPECT_EQ(r.options.chunk_rows, 2);
  EXPECT_TRUE(r.options.token_scaling);
  EXPECT_EQ(r.options.temperature, 0.7f);
  EXPECT_EQ(c.kind, LOSSD_LOSS_POLICY);
  EXPECT_EQ(c.policy.loss_type, LOSSD_POLICY_DR_GRPO);
  EXPECT_EQ(r.kind, LossKind::kPolicy);
  EXPECT_EQ(r.dlogp, p.dlogp);
  EXPECT_EQ(r.dentropy, p.dentropy);
  EXPECT_EQ(r.advantages, p.advantages);
  EXPECT_EQ(r.old_logp, p.old_logp);
  EXPECT_EQ(r.ref_logp, p.ref_logp);
  EXPECT_EQ(r.policy.loss_type, PolicyLossType::kDrGrpo);
  EXPECT_EQ(r.policy.epsilon_low, 0.1f);
  EXPECT_EQ(r.policy.epsilon_high, 0.3f);
  EXPECT_EQ(r.policy.beta, 0.05f);
  EXPECT_EQ(r.policy.sequences, 3);
  EXPECT_EQ(r.policy.max_completion_length, 11);
  EXPECT_EQ(r.policy.dapo_normalizer, 2.5);
  EXPECT_EQ(c.policy.use_bias_correction_kl, 1);
  EXPECT_EQ(r.is_ratio, p.is_ratio);
  EXPECT_EQ(c.importance_sampling, LOSSD_IMPORTANCE_SAMPLING_SEQUENCE);
  EXPECT_EQ(r.policy.importance_sampling, ImportanceSampling::kSequence);
  EXPECT_EQ(c.kl_estimator, LOSSD_KL_LOW_VAR_KL);
  EXPECT_EQ(r.policy.kl_estimator, KlEstimator::kLowVarKl);
  EXPECT_EQ(c.kl_straight_through, 1);
  EXPECT_TRUE(r.policy.kl_straight_through);
  EXPECT_EQ(r.policy.entropy_coeff, -0.125f);
  EXPECT_EQ(c.aggregation, LOSSD_AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM);
  EXPECT_EQ(r.policy.aggregation, PolicyAggregation::kSeqMeanTokenSumNorm);
  EXPECT_EQ(r.policy.loss_scale_factor, 48.5);
  EXPECT_EQ(r.distill.weight_hard_loss, 0.375f);
  EXPECT_EQ(r.distill.weight_soft_loss, 0.625f);
  EXPECT_EQ(c.kl_cov_ratio, 0.0625);
  EXPECT_EQ(r.policy.kl_cov_ratio, 0.0625);
  EXPECT_EQ(r.policy.ppo_kl_coef, 0.875f);
  EXPECT_EQ(c.vespo_lambda_pos, 2.75f);
  EXPECT_EQ(r.policy.vespo_k_pos, 1.25f);
  EXPECT_EQ(r.policy.vespo_lambda_pos, 2.75f);
  EXPECT_EQ(r.policy.vespo_k_neg, -0.5f);
  EXPECT_EQ(r.policy.vespo_lambda_neg, 0.25f);
  EXPECT_EQ(r.policy.sapo_temperature_pos, 1.5f);
  EXPECT_EQ(r.policy.sapo_temperature_neg, 0.75f);
  EXPECT_EQ(r.policy.delta, 1.75f);
  EXPECT_TRUE(r.policy.use_bias_correction_kl);
  EXPECT_EQ(r.teacher_h, 13);
  EXPECT_EQ(r.teacher_x, p.teacher_x);
  EXPECT_EQ(r.teacher_w, p.teacher_w);
  EXPECT_EQ(r.teacher_w_memory, Memory::kBackend);
  EXPECT_EQ(r.teacher_bias, p.teacher_bias);
  EXPECT_EQ(r.distill.jsd_beta, 0.25f);
  EXPECT_EQ(r.rows, nullptr);
}

TEST(PluginAbiConvertTest, OutputsRoundTrip) {
  float f[4] = {1, 2, 3, 4};
  int64_t i[2] = {5, 6};
  LossOutputs o;
  o.grad_dtype = DType::kF16;
  o.loss = &f[0];
  o.z_loss = &f[1];
  o.lse = &f[2];
  o.predictions = &i[0];
  o.accuracy = &f[3];
  o.tokens = &i[1];
  o.dx = &f[0];
  o.dw = &f[1];
  o.db = &f[2];
  o.dw_accum = &f[3];
  o.db_accum = &f[0];
  o.accum_memory = Memory::kBackend;
  o.logp = &f[1];
  o.entropy = &f[2];
  o.kl = &f[3];
  o.clip_fraction = &f[0];
  const LossOutputs ro = FromC(ToC(o));
  EXPECT_EQ(ro.grad_dtype, o.grad_dtype);
  EXPECT_EQ(ro.loss, o.loss);
  EXPECT_EQ(ro.z_loss, o.z_loss);
  EXPECT_EQ(ro.lse, o.lse);
  EXPECT_EQ(ro.predictions, o.predictions);
  EXPECT_EQ(ro.accuracy, o.accuracy);
  EXPECT_EQ(ro.tokens, o.tokens);
  EXPECT_EQ(ro.dx, o.dx);
  EXPECT_EQ(ro.dw, o.dw);
  EXPECT_EQ(ro.db, o.db);
  EXPECT_EQ(ro.dw_accum, o.dw_accum);
  EXPECT_EQ(ro.db_accum, o.db_accum);
  EXPECT_EQ(ro.accum_memory, o.accum_memory);
  EXPECT_EQ(ro.logp, o.logp);
  EXPECT_EQ(ro.entropy, o.entropy);
  EXPECT_EQ(ro.kl, o.kl);
  EXPECT_EQ(ro.clip_fraction, o.clip_fraction);
}

TEST(PluginAbiConvertTest, StatsRoundTrip) {
  LossStats s;
  s.compute_seconds = 0.125;
  s.peak_extra_bytes = 1ull << 40;
  s.chunk_rows = 3;
  s.gemm_tunings = 4;
  s.nonfinite = kNonFiniteDw;
  const LossStats rs = FromC(ToC(s));
  EXPECT_EQ(rs.compute_seconds, s.compute_seconds);
  EXPECT_EQ(rs.peak_extra_bytes, s.peak_extra_bytes);
  EXPECT_EQ(rs.chunk_rows, s.chunk_rows);
  EXPECT_EQ(rs.gemm_tunings, s.gemm_tunings);
  EXPECT_EQ(rs.nonfinite, s.nonfinite);
}

TEST(PluginAbiConvertTest, OptimizerParamsRoundTrip) {
  OptimizerParams p;
  p.kind = OptimizerKind::kSgd;
  p.lr = 0.25;
  p.weight_decay = 0.125;
  p.momentum = 0.875;
  p.dampening = 0.0625;
  p.nesterov = true;
  p.momentum_initialised = true;
  p.beta1 = 0.5;
  p.beta2 = 0.75;
  p.eps = 1e-6;
  p.amsgrad = true;
  p.step = (int64_t{1} << 40) + 3;
  p.grad_scale = 0.3f;
  const LossdOptimizerParams c = ToC(p);
  EXPECT_EQ(c.kind, LOSSD_OPTIMIZER_SGD);
  EXPECT_EQ(c.nesterov, 1);
  const OptimizerParams r = FromC(c);
  EXPECT_EQ(r.kind, p.kind);
  EXPECT_EQ(r.lr, p.lr);
  EXPECT_EQ(r.weight_decay, p.weight_decay);
  EXPECT_EQ(r.momentum, p.momentum);
  EXPECT_EQ(r.dampening, p.dampening);
  EXPECT_TRUE(r.nesterov);
  EXPECT_TRUE(r.momentum_initialised);
  EXPECT_EQ(r.beta1, p.beta1);
  EXPECT_EQ(r.beta2, p.beta2);
  EXPECT_EQ(r.eps, p.eps);
  EXPECT_TRUE(r.amsgrad);
  EXPECT_EQ(r.step, p.step);
  EXPECT_EQ(r.grad_scale, p.grad_scale);
  // The other value of every enum and flag.
  p.kind = OptimizerKind::kAdamW;
  p.nesterov = p.momentum_initialised = p.amsgrad = false;
  const OptimizerParams r2 = FromC(ToC(p));
  EXPECT_EQ(ToC(p).kind, LOSSD_OPTIMIZER_ADAMW);
  EXPECT_EQ(r2.kind, OptimizerKind::kAdamW);
  EXPECT_FALSE(r2.nesterov);
  EXPECT_FALSE(r2.momentum_initialised);
  EXPECT_FALSE(r2.amsgrad);
}

TEST(PluginAbiConvertTest, OptimizerTensorsRoundTrip) {
  float f[5];
  uint16_t copy[1];
  OptimizerTensors t;
  t.n = 12345678901;
  t.param = &f[0];
  t.grad = &f[1];
  t.state1 = &f[2];
  t.state2 = &f[3];
  t.state3 = &f[4];
  t.copy = copy;
  t.copy_dtype = DType::kF16;
  const LossdOptimizerTensors c = ToC(t);
  EXPECT_EQ(c.copy_dtype, LOSSD_DTYPE_F16);
  const OptimizerTensors r = FromC(c);
  EXPECT_EQ(r.n, t.n);
  EXPECT_EQ(r.param, t.param);
  EXPECT_EQ(r.grad, t.grad);
  EXPECT_EQ(r.state1, t.state1);
  EXPECT_EQ(r.state2, t.state2);
  EXPECT_EQ(r.state3, t.state3);
  EXPECT_EQ(r.copy, t.copy);
  EXPECT_EQ(r.copy_dtype, DType::kF16);
}

TEST(PluginAbiConvertTest, InfoRoundTripsAndLongNamesAreCut) {
  BackendInfo i;
  i.name = "cuda";
  i.device = "NVIDIA H200";
  i.memory_total_bytes = 1;
  i.memory_used_bytes = 2;
  i.memory_peak_bytes = 3;
  i.memory_held_bytes = 4;
  i.memory_budget_bytes = 5;
  i.healthy = false;
  i.loss_kinds = LossKindBit(LossKind::kCrossEntropy) | LossKindBit(LossKind::kPolicy);
  i.compute_path = "reference-exp for bf16 cross-entropy (row-chunk otherwise), 2048-row chunks";
  const BackendInfo r = FromC(ToC(i));
  EXPECT_EQ(r.name, "cuda");
  EXPECT_EQ(r.device, "NVIDIA H200");
  EXPECT_EQ(r.memory_total_bytes, 1u);
  EXPECT_EQ(r.memory_used_bytes, 2u);
  EXPECT_EQ(r.memory_peak_bytes, 3u);
  EXPECT_EQ(r.memory_held_bytes, 4u);
  EXPECT_EQ(r.memory_budget_bytes, 5u);
  EXPECT_FALSE(r.healthy);
  EXPECT_EQ(r.loss_kinds, 5u);
  EXPECT_EQ(r.compute_path, i.compute_path);
  i.device = std::string(1000, 'd');
  i.compute_path = std::string(1000, 'p');
  EXPECT_EQ(FromC(ToC(i)).device, std::string(255, 'd'));
  EXPECT_EQ(FromC(ToC(i)).compute_path, std::string(127, 'p'));
}

}  // namespace
}  // namespace lossd
