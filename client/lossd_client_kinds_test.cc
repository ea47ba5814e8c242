// SPDX-License-Identifier: Apache-2.0
// Tests the C++ client's requests of the loss kinds other than cross-entropy (logprob, policy,
// distill) against the in-process fake lossd service over real loopback gRPC: the header's
// kind, temperature and options, the new input tensors arriving whole (X last), the outputs
// logp and entropy and the summary's kl and clip_fraction read back, and the checks made
// before anything is sent. The math is the server's (its tests, and the Python end-to-end
// tests against torch).
#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "client/compute_call.h"
#include "client/lossd_client.h"
#include "testing/client/fake_loss_service.h"
#include "testing/client/lossd_client_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.pb.h"
#include "wire/part_codec.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

std::string Bytes(const HostTensor& t) {
  return std::string(reinterpret_cast<const char*>(t.data()), t.num_bytes());
}

std::vector<int64_t> Shape(const v1::TensorSpec& s) { return {s.shape().begin(), s.shape().end()}; }

HostTensor Fp32(int64_t n, uint32_t seed) {
  // Random finite floats (random bytes could be NaN, which nothing here minds, but a reader
  // of a failure would).
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> d(-2.0f, 2.0f);
  HostTensor t = HostTensor::Owned(DType::kF32, {n});
  for (int64_t i = 0; i < n; ++i) t.mutable_data_as<float>()[i] = d(gen);
  return t;
}

TEST_F(LossClientTest, LogprobSendsKindTemperatureAndUpstreamGradients) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(6, 5, 7);
  r.want = WantedOutputs{};
  r.want.dw = false;  // dX only
  r.want.entropy = true;
  r.kind = LossKind::kLogprob;
  r.options.temperature = 0.7f;
  r.dlogp = Fp32(6, 11);
  r.dentropy = Fp32(6, 12);
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::ComputeHeader& h = fake_.last_header;
    EXPECT_EQ(h.kind(), v1::LOSS_KIND_LOGPROB);
    EXPECT_TRUE(h.options().has_temperature());
    EXPECT_FLOAT_EQ(h.options().temperature(), 0.7f);
    EXPECT_TRUE(h.outputs().entropy());
    EXPECT_EQ(h.dlogp().dtype(), v1::DTYPE_FP32);
    EXPECT_EQ(Shape(h.dlogp()), std::vector<int64_t>{6});
    EXPECT_EQ(Shape(h.dentropy()), std::vector<int64_t>{6});
    EXPECT_FALSE(h.has_policy());
    EXPECT_FALSE(h.has_distill());
    EXPECT_FALSE(h.has_advantages());
    EXPECT_EQ(fake_.last_data[v1::TENSOR_DLOGP], Bytes(*r.dlogp));
    EXPECT_EQ(fake_.last_data[v1::TENSOR_DENTROPY], Bytes(*r.dentropy));
  }
  const HostTensor* logp = res->Find(OutputTensor::kLogp);
  const HostTensor* entropy = res->Find(OutputTensor::kEntropy);
  ASSERT_NE(logp, nullptr);
  ASSERT_NE(entropy, nullptr);
  ASSERT_EQ(logp->shape(), std::vector<int64_t>{6});
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(logp->data_as<float>()[i], -static_cast<float>(r.targets.data_as<int64_t>()[i]));
  }
  EXPECT_TRUE(SameBytes(*entropy, *r.dentropy));  // the fake echoes dentropy
  ASSERT_NE(res->Find(OutputTensor::kDx), nullptr);
  EXPECT_EQ(res->Find(OutputTensor::kDw), nullptr);
  EXPECT_STREQ(OutputTensorName(OutputTensor::kLogp), "logp");
  EXPECT_STREQ(OutputTensorName(OutputTensor::kEntropy), "entropy");
}

TEST_F(LossClientTest, LogprobOutputsLandInCallerBuffers) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(6, 5, 7);
  r.kind = LossKind::kLogprob;
  r.want = WantedOutputs{};
  r.want.entropy = true;
  std::vector<float> logp(6, 123.0f), entropy(6, 123.0f);
  r.output_into[OutputTensor::kLogp] = {logp.data(), logp.size() * 4};
  r.output_into[OutputTensor::kEntropy] = {entropy.data(), entropy.size() * 4};
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(logp[i], -static_cast<float>(r.targets.data_as<int64_t>()[i]));
    EXPECT_EQ(entropy[i], 1.0f);  // the fake's entropy without upstream gradients
  }
  EXPECT_EQ(res->Find(OutputTensor::kLogp)->data(), static_cast<const void*>(logp.data()));
}

TEST_F(LossClientTest, PolicySendsItsOptionsAndReadsKlAndClipFraction) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(8, 5, 7);
  r.want = WantedOutputs{};
  r.want.db = false;
  r.kind = LossKind::kPolicy;
  r.options.temperature = 1.25f;
  r.advantages = Fp32(8, 21);
  r.old_logp = Fp32(8, 22);
  r.ref_logp = Fp32(8, 23);
  r.policy.loss_type = PolicyLossType::kDrGrpo;
  r.policy.epsilon_low = 0.1f;
  r.policy.epsilon_high = 0.28f;
  r.policy.beta = 0.5f;
  r.policy.sequences = 2;
  r.policy.max_completion_length = 9;
  r.policy.dapo_normalizer = 3.5;
  r.policy.sapo_temperature_pos = 1.5f;
  r.policy.delta = 1.75f;
  r.policy.use_bias_correction_kl = true;
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_FLOAT_EQ(res->kl, 0.375f);
  EXPECT_FLOAT_EQ(res->clip_fraction, 0.0625f);
  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.kind(), v1::LOSS_KIND_POLICY);
  EXPECT_FLOAT_EQ(h.options().temperature(), 1.25f);
  EXPECT_EQ(h.policy().loss_type(), v1::POLICY_LOSS_DR_GRPO);
  EXPECT_FLOAT_EQ(h.policy().epsilon_low(), 0.1f);
  EXPECT_FLOAT_EQ(h.policy().epsilon_high(), 0.28f);
  EXPECT_FLOAT_EQ(h.policy().beta(), 0.5f);
  EXPECT_EQ(h.policy().sequences(), 2);
  EXPECT_EQ(h.policy().max_completion_length(), 9);
  EXPECT_DOUBLE_EQ(h.policy().dapo_normalizer(), 3.5);
  EXPECT_FLOAT_EQ(h.policy().sapo_temperature_pos(), 1.5f);
  EXPECT_FLOAT_EQ(h.policy().sapo_temperature_neg(), 1.05f);
  EXPECT_FLOAT_EQ(h.policy().delta(), 1.75f);
  EXPECT_TRUE(h.policy().use_bias_correction_kl());
  EXPECT_FALSE(h.outputs().entropy());
  EXPECT_EQ(fake_.last_data[v1::TENSOR_ADVANTAGES], Bytes(*r.advantages));
  EXPECT_EQ(fake_.last_data[v1::TENSOR_OLD_LOGP], Bytes(*r.old_logp));
  EXPECT_EQ(fake_.last_data[v1::TENSOR_REF_LOGP], Bytes(*r.ref_logp));
}

TEST_F(LossClientTest, PolicyDefaultsAreLigersOnTheWire) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(4, 5, 7);
  r.kind = LossKind::kPolicy;
  r.advantages = Fp32(4, 24);
  ASSERT_TRUE(client->Compute(r).ok());
  absl::MutexLock lock(&fake_.mu);
  const v1::PolicyOptions& p = fake_.last_header.policy();
  EXPECT_EQ(p.loss_type(), v1::POLICY_LOSS_DAPO);
  EXPECT_TRUE(p.has_epsilon_low() && p.has_epsilon_high() && p.has_beta());
  EXPECT_FLOAT_EQ(p.epsilon_low(), 0.2f);
  EXPECT_FLOAT_EQ(p.epsilon_high(), 0.2f);
  EXPECT_FLOAT_EQ(p.beta(), 0.04f);
  EXPECT_EQ(p.sequences(), 1);
  EXPECT_FLOAT_EQ(fake_.last_header.options().temperature(), 1.0f);
}

TEST_F(LossClientTest, DistillSendsTheTeacherInline) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(6, 5, 7);
  r.want = WantedOutputs{};
  r.kind = LossKind::kDistill;
  r.distill.jsd_beta = 0.25f;
  r.teacher_x = RandomTensor(DType::kBF16, {6, 3}, 31);
  r.teacher_w = RandomTensor(DType::kBF16, {7, 3}, 32);
  r.teacher_bias = RandomTensor(DType::kBF16, {7}, 33);
  ASSERT_TRUE(client->Compute(r).ok());
  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.kind(), v1::LOSS_KIND_DISTILL);
  EXPECT_FLOAT_EQ(h.distill().jsd_beta(), 0.25f);
  EXPECT_FALSE(h.has_policy());
  EXPECT_EQ(Shape(h.teacher_x()), (std::vector<int64_t>{6, 3}));
  EXPECT_EQ(Shape(h.teacher_w()), (std::vector<int64_t>{7, 3}));
  EXPECT_EQ(h.teacher_w().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(Shape(h.teacher_bias()), std::vector<int64_t>{7});
  EXPECT_TRUE(h.teacher_weight_handle().empty());
  EXPECT_EQ(fake_.last_data[v1::TENSOR_TEACHER_X], Bytes(*r.teacher_x));
  EXPECT_EQ(fake_.last_data[v1::TENSOR_TEACHER_W], Bytes(*r.teacher_w));
  EXPECT_EQ(fake_.last_data[v1::TENSOR_TEACHER_BIAS], Bytes(*r.teacher_bias));
}

TEST_F(LossClientTest, DistillMayLeaveTheTargetsOut) {
  auto client = Client(Options());
  ComputeRequest r = SmallRequest(6, 5, 7);
  r.want = WantedOutputs{};
  r.want.dw = false;
  r.targets = HostTensor();
  r.kind = LossKind::kDistill;
  r.teacher_x = RandomTensor(DType::kBF16, {6, 3}, 34);
  r.teacher_w = RandomTensor(DType::kBF16, {7, 3}, 35);
  ASSERT_TRUE(client->Compute(r).ok());
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_FALSE(fake_.last_header.has_targets());
    EXPECT_EQ(fake_.last_parts.count(v1::TENSOR_TARGETS), 0u);
  }
  r.kind = LossKind::kLogprob;  // the other kinds need them
  r.teacher_x.reset();
  r.teacher_w.reset();
  absl::StatusOr<ComputeResult> res = client->Compute(r);
  ASSERT_FALSE(res.ok());
  EXPECT_THAT(std::string(res.status().message()), HasSubstr("targets"));
}

TEST_F(LossClientTest, DistillNamesATeacherWeightHandle) {
  auto client = Client(Options());
  HostTensor tw = RandomTensor(DType::kBF16, {7, 3}, 41);
  absl::StatusOr<PutWeightsResult> put = client->PutWeights(tw, nullptr);
  ASSERT_TRUE(put.ok()) << put.status();
  ComputeRequest r = SmallRequest(6, 5, 7);
  r.kind = LossKind::kDistill;
  r.teacher_x = RandomTensor(DType::kBF16, {6, 3}, 42);
  r.teacher_weight_handle = put->handle;
  ASSERT_TRUE(client->Compute(r).ok());
  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.teacher_weight_handle(), put->handle);
  EXPECT_FALSE(h.has_teacher_w());
  EXPECT_EQ(fake_.last_parts.count(v1::TENSOR_TEACHER_W), 0u);
  EXPECT_FLOAT_EQ(h.distill().jsd_beta(), 0.5f);  // Liger's default
}

TEST_F(LossClientTest, CrossEntropyLeavesTheKindsFieldsUnset) {
  auto client = Client(Options());
  ASSERT_TRUE(client->Compute(SmallRequest()).ok());
  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.kind(), v1::LOSS_KIND_CROSS_ENTROPY);
  EXPECT_FALSE(h.options().has_temperature());
  EXPECT_FALSE(h.outputs().entropy());
  EXPECT_FALSE(h.has_policy() || h.has_distill() || h.has_dlogp() || h.has_teacher_x());
}

TEST_F(LossClientTest, KindInputsAreCheckedBeforeSending) {
  auto client = Client(Options());
  struct Case {
    const char* what;
    void (*edit)(ComputeRequest&);
    const char* message;
  };
  const Case cases[] = {
      {"teacher twice",
       [](ComputeRequest& r) {
         r.kind = LossKind::kDistill;
         r.teacher_x = RandomTensor(DType::kBF16, {6, 3}, 51);
         r.teacher_w = RandomTensor(DType::kBF16, {7, 3}, 52);
         r.teacher_weight_handle = "h-1";
       },
       "give one of teacher_w and teacher_weight_handle ('h-1')"},
      {"teacher bias with a handle",
       [](ComputeRequest& r) {
         r.kind = LossKind::kDistill;
         r.teacher_weight_handle = "h-1";
         r.teacher_bias = RandomTensor(DType::kBF16, {7}, 53);
       },
       "teacher_bias goes with an inline teacher_w"},
      {"no teacher", [](ComputeRequest& r) { r.kind = LossKind::kDistill; },
       "kind distill needs the teacher's head"},
      {"bad dlogp",
       [](ComputeRequest& r) {
         r.kind = LossKind::kLogprob;
         r.dlogp = HostTensor::FromBytes(DType::kF32, {6}, ByteVector(10));
       },
       "dlogp"},
      {"logp from policy",
       [](ComputeRequest& r) {
         static float buf[6];
         r.kind = LossKind::kPolicy;
         r.advantages = HostTensor::Owned(DType::kF32, {6});
         r.output_into[OutputTensor::kLogp] = {buf, sizeof(buf)};
       },
       "output_into[logp]: this call does not return logp"},
      {"entropy not wanted",
       [](ComputeRequest& r) {
         static float buf[6];
         r.kind = LossKind::kLogprob;
         r.output_into[OutputTensor::kEntropy] = {buf, sizeof(buf)};
       },
       "output_into[entropy]: this call does not return entropy"},
      {"logp buffer too small",
       [](ComputeRequest& r) {
         static float buf[5];
         r.kind = LossKind::kLogprob;
         r.output_into[OutputTensor::kLogp] = {buf, sizeof(buf)};
       },
       "output_into[logp] holds 20 bytes"},
  };
  for (const Case& c : cases) {
    ComputeRequest r = SmallRequest(6, 5, 7);
    c.edit(r);
    absl::StatusOr<ComputeResult> res = client->Compute(r);
    ASSERT_FALSE(res.ok()) << c.what;
    EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(std::string(res.status().message()), HasSubstr(c.message)) << c.what;
  }
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.last_data.empty()) << "a refused request reached the server";
}

TEST(ComputeInputsTest, EverythingElseIsSentBeforeX) {
  ComputeRequest r;
  r.x = RandomTensor(DType::kF32, {4, 3}, 61);
  r.w = RandomTensor(DType::kF32, {5, 3}, 62);
  r.targets = Targets(4, 5, 63);
  r.kind = LossKind::kDistill;
  r.teacher_x = RandomTensor(DType::kF32, {4, 2}, 64);
  r.teacher_w = RandomTensor(DType::kF32, {5, 2}, 65);
  r.teacher_bias = RandomTensor(DType::kF32, {5}, 66);
  r.dlogp = RandomTensor(DType::kF32, {4}, 67);
  r.advantages = RandomTensor(DType::kF32, {4}, 68);
  r.old_logp = RandomTensor(DType::kF32, {4}, 69);
  r.ref_logp = RandomTensor(DType::kF32, {4}, 70);
  r.dentropy = RandomTensor(DType::kF32, {4}, 71);
  wire::SliceTracker tracker;
  std::vector<grpc::ByteBuffer> out;
  uint64_t bytes = 0;
  AppendComputeInputs(r, 8, &tracker, &out, &bytes);
  std::vector<int32_t> order;
  uint64_t data = 0;
  for (const grpc::ByteBuffer& b : out) {
    wire::StreamFrame f;
    ASSERT_TRUE(f.Parse(b).ok());
    ASSERT_EQ(f.kind(), wire::StreamFrame::Kind::kPart);
    data += f.data_size();
    if (order.empty() || order.back() != f.tensor()) order.push_back(f.tensor());
  }
  EXPECT_EQ(order, (std::vector<int32_t>{
                       v1::TENSOR_W, v1::TENSOR_TEACHER_W, v1::TENSOR_TEACHER_BIAS,
                       v1::TENSOR_TARGETS, v1::TENSOR_DLOGP, v1::TENSOR_DENTROPY,
                       v1::TENSOR_ADVANTAGES, v1::TENSOR_OLD_LOGP, v1::TENSOR_REF_LOGP,
                       v1::TENSOR_TEACHER_X, v1::TENSOR_X}));
  EXPECT_EQ(bytes, data);
  EXPECT_EQ(bytes, r.x.num_bytes() + r.w->num_bytes() + r.targets.num_bytes() +
                       r.teacher_x->num_bytes() + r.teacher_w->num_bytes() +
                       r.teacher_bias->num_bytes() + 5 * 16);
}

}  // namespace
}  // namespace client
}  // namespace lossd
