// SPDX-License-Identifier: Apache-2.0
// Runs the lossctl binary against a fake lossd service: exit codes, printed results, .npy
// outputs, and that every flag reaches the request header.
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "testing/client/fake_loss_service.h"
#include "testing/client/lossctl_test_fixture.h"
#include "client/host_tensor.h"
#include "client/npy.h"
#include "client/rendezvous.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "core/dtype.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;
using lossctl_testing::LossctlTest;
using lossctl_testing::RandomF32;
using lossctl_testing::Result;
using lossctl_testing::SameBytes;

TEST_F(LossctlTest, Health) {
  Result r = Lossctl("health");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("status      SERVING\n"));
  server_->GetHealthCheckService()->SetServingStatus(false);
  r = Lossctl("health");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("status      NOT_SERVING\n"));
  EXPECT_THAT(r.output, HasSubstr("lossctl health: UNAVAILABLE: the server is NOT_SERVING"));
  r = Lossctl("health --service=no.such.Service");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("lossctl health: NOT_FOUND: Health.Check: "));
}

TEST_F(LossctlTest, BenchPrintsProgressAsItGoes) {
  Result r = Lossctl("bench --bt=8 --h=4 --v=16 --calls=5 --warmup=0");
  ASSERT_EQ(r.code, 0) << r.output;
  // The last call always prints a progress line, before the summary.
  const size_t progress = r.output.find("progress    5/5 calls, 0 failed, last ");
  ASSERT_NE(progress, std::string::npos) << r.output;
  EXPECT_LT(progress, r.output.find("latency_ms  p50 ")) << r.output;
}

TEST_F(LossctlTest, JsonOutput) {
  Result r = Lossctl("info --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::StartsWith("{\"command\": \"info\", \"ok\": true, "
                                              "\"target\": \"127.0.0.1:"));
  EXPECT_THAT(r.output, HasSubstr("\"backend\": \"cpu\", \"device\": \"fake device\", "
                                  "\"compute_path\": \"cpu\""));
  EXPECT_THAT(r.output, ::testing::EndsWith("}\n"));
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  r = Lossctl("compute --bt=6 --h=4 --v=16 --want=dx --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"loss\": 1.5, "));
  EXPECT_THAT(r.output, HasSubstr("\"outputs\": [{\"name\": \"dx\", \"tensor\": "));
  // bench: progress lines, then the object.
  r = Lossctl("bench --bt=8 --h=4 --v=16 --calls=3 --warmup=0 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("{\"progress\": {\"done\": 3, \"calls\": 3, \"failed\": 0"));
  EXPECT_THAT(r.output, HasSubstr("{\"command\": \"bench\", \"ok\": true, "));
  EXPECT_THAT(r.output, HasSubstr("\"calls_ok\": 3, \"calls_failed\": 0"));
  // A failure is in the object too (and on stderr, as without --json).
  r = Lossctl("drop-weights --handle=w-nope --json");
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("{\"command\": \"drop-weights\", \"ok\": false, "
                                  "\"error\": {\"code\": \""));
}

// With --json, stdout is one JSON object whatever the command does: the files --out_dir
// wrote are listed in it ("wrote"), not printed before it, and an empty list is still there.
TEST_F(LossctlTest, JsonStdoutIsOneObject) {
  Result r = Lossctl("compute --bt=6 --h=4 --v=16 --want=dx --json --out_dir=" + Path("out"),
                     /*stdout_only=*/true);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::StartsWith("{\"command\": \"compute\", \"ok\": true, "));
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("\"wrote\": [{\"path\": \"", Path("out/dx.npy"),
                                               "\", \"tensor\": \"bf16[6, 4]\"}, {\"path\": \"",
                                               Path("out/scalars_loss_zloss_accuracy.npy"))));
  EXPECT_EQ(Read("out/dx.npy").num_elements(), 24);
  r = Lossctl("compute --bt=6 --h=4 --v=16 --want=dx --out_dir=" + Path("text"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("wrote       " + Path("text/dx.npy") + " bf16[6, 4]\n"));

  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"list_state"};
  }
  r = Lossctl("list --json", /*stdout_only=*/true);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, "{\"command\": \"list\", \"ok\": true, \"state\": []}\n");
  r = Lossctl("head list --json", /*stdout_only=*/true);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, "{\"command\": \"head list\", \"ok\": true, \"heads\": []}\n");
  r = Lossctl("compute --bt=6 --h=4 --v=16 --want=none --json", /*stdout_only=*/true);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"outputs\": []"));
}

TEST_F(LossctlTest, Info) {
  Result r = Lossctl("info");
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("backend             cpu"));
  EXPECT_THAT(r.output, HasSubstr("device              fake device\n"));
  EXPECT_THAT(r.output, HasSubstr("compute_path        cpu\n"));
  EXPECT_THAT(r.output, HasSubstr("version             0.0-fake"));
  // Sizes in GiB, the unit of the server's log ("23.54 GiB"), never decimal GB.
  EXPECT_THAT(r.output, HasSubstr("memory_total        1000 bytes (1000 B)\n"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr(" GB")));
  r = Lossctl("put-weights --v=1024 --h=1024 --dtype=fp16");  // 2 MiB
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex("upload      2.00 MiB in [0-9.]+ s"));
  r = Lossctl("bench --bt=8 --h=4 --v=16 --calls=2 --warmup=0 --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"gib_per_second_up\": "));
  EXPECT_THAT(r.output, HasSubstr("\"gib_per_second_down\": "));
}

TEST_F(LossctlTest, ComputeFromNpyFilesWritesEveryOutput) {
  HostTensor x = RandomF32({47, 31}, 1);
  HostTensor w = RandomF32({123, 31}, 2);
  HostTensor t = HostTensor::Owned(DType::kI64, {47});
  for (int i = 0; i < 47; ++i) t.mutable_data_as<int64_t>()[i] = (i * 37) % 123;
  t.mutable_data_as<int64_t>()[5] = -1;  // ignored with --ignore_index=-1
  ASSERT_TRUE(WriteNpy(Path("x.npy"), x).ok());
  ASSERT_TRUE(WriteNpy(Path("w.npy"), w).ok());
  ASSERT_TRUE(WriteNpy(Path("t.npy"), t).ok());
  Result r = Lossctl(absl::StrCat(
      "compute --x=", Path("x.npy"), " --w=", Path("w.npy"), " --targets=", Path("t.npy"),
      " --ignore_index=-1 --reduction=sum --label_smoothing=0.125 --lse_square_scale=0.001",
      " --softcap=15 --grad_scale=0.5 --chunk_rows=64 --want=dx,dw,lse,predictions,accuracy",
      " --out_dir=", Path("out")));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("loss        1.5\n"));
  EXPECT_THAT(r.output, HasSubstr("tokens      46\n"));
  EXPECT_THAT(r.output, HasSubstr("backend     fake\n"));
  EXPECT_TRUE(SameBytes(Read("out/dx.npy"), x));
  EXPECT_TRUE(SameBytes(Read("out/dw.npy"), w));
  EXPECT_TRUE(SameBytes(Read("out/predictions.npy"), t));
  HostTensor lse = Read("out/lse.npy");
  ASSERT_EQ(lse.num_elements(), 47);
  EXPECT_EQ(lse.data_as<float>()[7], static_cast<float>(t.data_as<int64_t>()[7]));
  HostTensor scalars = Read("out/scalars_loss_zloss_accuracy.npy");
  ASSERT_EQ(scalars.num_elements(), 3);
  EXPECT_EQ(scalars.data_as<float>()[0], 1.5f);
  EXPECT_EQ(scalars.data_as<float>()[1], 0.25f);
  EXPECT_EQ(scalars.data_as<float>()[2], 0.125f);

  absl::MutexLock lock(&fake_.mu);
  const v1::LossOptions& o = fake_.last_header.options();
  EXPECT_EQ(o.ignore_index(), -1);
  EXPECT_EQ(o.reduction(), v1::REDUCTION_SUM);
  EXPECT_EQ(o.label_smoothing(), 0.125f);
  EXPECT_EQ(o.lse_square_scale(), 0.001f);
  EXPECT_EQ(o.softcap(), 15.0f);
  EXPECT_EQ(o.grad_scale(), 0.5f);
  EXPECT_EQ(o.chunk_rows(), 64);
  EXPECT_EQ(o.grad_dtype(), v1::DTYPE_UNSPECIFIED);
  EXPECT_TRUE(fake_.last_header.outputs().accuracy());
  EXPECT_FALSE(fake_.last_header.outputs().db());
}

TEST_F(LossctlTest, DtypeFlagConvertsFloatFiles) {
  HostTensor x = RandomF32({9, 4}, 3);
  HostTensor w = RandomF32({6, 4}, 4);
  ASSERT_TRUE(WriteNpy(Path("x.npy"), x).ok());
  ASSERT_TRUE(WriteNpy(Path("w.npy"), w).ok());
  ExpectSentAsBf16(x);
}

// np.save of a default (float64) array, as the help promises: read as fp32, then converted.
TEST_F(LossctlTest, Float64FilesAreConverted) {
  HostTensor x32 = RandomF32({9, 4}, 5);
  HostTensor w32 = RandomF32({6, 4}, 6);
  auto write_f64 = [&](const std::string& name, const HostTensor& t) {
    std::string file = EncodeNpyHeader(DType::kF32, t.shape());
    const size_t at = file.find("<f4");
    ASSERT_NE(at, std::string::npos);
    file.replace(at, 3, "<f8");
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      const double v = t.data_as<float>()[i];
      file.append(reinterpret_cast<const char*>(&v), sizeof(v));
    }
    FILE* f = std::fopen(Path(name).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(file.data(), 1, file.size(), f), file.size());
    std::fclose(f);
  };
  write_f64("x.npy", x32);
  write_f64("w.npy", w32);
  ExpectSentAsBf16(x32);
}

TEST_F(LossctlTest, RandomDataWithBias) {
  Result r = Lossctl(
      "compute --bt=16 --h=8 --v=32 --with_bias --target_dtype=int32 "
      "--grad_dtype=fp32 --out_dir=" +
      Path("out"));
  ASSERT_EQ(r.code, 0) << r.output;
  HostTensor dx = Read("out/dx.npy");
  EXPECT_EQ(dx.dtype(), DType::kF32);  // --grad_dtype
  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.x().dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(h.bias().shape(0), 32);
  EXPECT_EQ(h.targets().dtype(), v1::DTYPE_INT32);
  EXPECT_EQ(h.options().grad_dtype(), v1::DTYPE_FP32);
  EXPECT_TRUE(h.outputs().db());  // the default --want adds db when there is a bias
}

TEST_F(LossctlTest, LossKindsFlagsReachTheHeader) {
  HostTensor dlogp = RandomF32({6}, 41), adv = RandomF32({6}, 42), old = RandomF32({6}, 43);
  for (const auto& [name, t] : {std::pair<const char*, const HostTensor*>{"dlogp", &dlogp},
                                {"adv", &adv}, {"old", &old}}) {
    ASSERT_TRUE(WriteNpy(Path(absl::StrCat(name, ".npy")), *t).ok());
  }
  Result r = Lossctl("compute --kind=logprob --temperature=0.5 --bt=6 --h=4 --v=9 "
                     "--want=dx,entropy --dlogp=" + Path("dlogp.npy") + " --out_dir=" +
                     Path("lp"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(Read("lp/logp.npy").num_elements(), 6);
  EXPECT_TRUE(SameBytes(Read("lp/entropy.npy"), dlogp));  // the fake echoes dlogp there
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.kind(), v1::LOSS_KIND_LOGPROB);
    EXPECT_FLOAT_EQ(fake_.last_header.options().temperature(), 0.5f);
    EXPECT_TRUE(fake_.last_header.outputs().entropy());
    EXPECT_EQ(fake_.last_header.dlogp().shape(0), 6);
  }
  r = Lossctl("compute --kind=policy --bt=6 --h=4 --v=9 --loss_type=grpo --epsilon_low=0.1 "
              "--epsilon_high=0.3 --beta=0 --sequences=3 --advantages=" + Path("adv.npy") +
              " --old_logp=" + Path("old.npy") + " --is_ratio=" + Path("old.npy") + " --json");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"kl\": 0.375"));
  EXPECT_THAT(r.output, HasSubstr("\"clip_fraction\": 0.0625"));
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::ComputeHeader& h = fake_.last_header;
    EXPECT_EQ(h.kind(), v1::LOSS_KIND_POLICY);
    EXPECT_EQ(h.policy().loss_type(), v1::POLICY_LOSS_GRPO);
    EXPECT_FLOAT_EQ(h.policy().epsilon_low(), 0.1f);
    EXPECT_FLOAT_EQ(h.policy().epsilon_high(), 0.3f);
    EXPECT_TRUE(h.policy().has_beta());
    EXPECT_EQ(h.policy().beta(), 0.0f);
    EXPECT_EQ(h.policy().sequences(), 3);
    EXPECT_EQ(fake_.last_data[v1::TENSOR_ADVANTAGES].size(), 24u);
    EXPECT_EQ(0, std::memcmp(fake_.last_data[v1::TENSOR_OLD_LOGP].data(), old.data(), 24));
    // The same file as the rollout correction: its bytes travel as TENSOR_IS_RATIO.
    EXPECT_EQ(h.is_ratio().shape(0), 6);
    EXPECT_EQ(0, std::memcmp(fake_.last_data[v1::TENSOR_IS_RATIO].data(), old.data(), 24));
  }
  r = Lossctl("compute --kind=policy --bt=6 --h=4 --v=9 --loss_type=sapo "
              "--sapo_temperature_pos=2 --sapo_temperature_neg=0.5 --use_bias_correction_kl");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::PolicyOptions& p = fake_.last_header.policy();
    EXPECT_EQ(p.loss_type(), v1::POLICY_LOSS_SAPO);
    EXPECT_FLOAT_EQ(p.sapo_temperature_pos(), 2.0f);
    EXPECT_FLOAT_EQ(p.sapo_temperature_neg(), 0.5f);
    EXPECT_FALSE(p.has_delta());  // 0: none, not sent
    EXPECT_TRUE(p.use_bias_correction_kl());
  }
  r = Lossctl("compute --kind=policy --bt=6 --h=4 --v=9 --loss_type=luspo --delta=1.5");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::PolicyOptions& p = fake_.last_header.policy();
    EXPECT_EQ(p.loss_type(), v1::POLICY_LOSS_LUSPO);
    EXPECT_TRUE(p.has_delta());
    EXPECT_FLOAT_EQ(p.delta(), 1.5f);
    EXPECT_FLOAT_EQ(p.sapo_temperature_neg(), 1.05f);
    EXPECT_FALSE(p.use_bias_correction_kl());
    EXPECT_EQ(p.importance_sampling(), v1::IMPORTANCE_SAMPLING_TOKEN);
  }
  r = Lossctl("compute --kind=policy --bt=6 --h=4 --v=9 --sequences=2 "
              "--importance_sampling=sequence");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.policy().importance_sampling(),
              v1::IMPORTANCE_SAMPLING_SEQUENCE);
  }
  r = Lossctl("compute --kind=distill --jsd_beta=0.25 --bt=5 --h=4 --v=9 --teacher_h=3");
  ASSERT_EQ(r.code, 0) << r.output;
  absl::MutexLock lock(&fake_.mu);
  const v1::ComputeHeader& h = fake_.last_header;
  EXPECT_EQ(h.kind(), v1::LOSS_KIND_DISTILL);
  EXPECT_FLOAT_EQ(h.distill().jsd_beta(), 0.25f);
  EXPECT_EQ(h.teacher_x().shape(1), 3);
  EXPECT_EQ(h.teacher_w().shape(0), 9);
  EXPECT_EQ(h.teacher_x().dtype(), h.x().dtype());
  EXPECT_FALSE(h.distill().has_weight_hard_loss());  // the defaults stay unset
  EXPECT_FALSE(h.distill().has_weight_soft_loss());
}

// LigerFusedLinearJSDLoss's hard-label term: the weights travel in DistillOptions; they are
// distill's flags only.
TEST_F(LossctlTest, DistillWeightsTravelAndAreDistillsOnly) {
  Result r = Lossctl(
      "compute --kind=distill --weight_hard_loss=0.25 --weight_soft_loss=0.75 --bt=5 --h=4 "
      "--v=9 --teacher_h=3");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::DistillOptions& d = fake_.last_header.distill();
    EXPECT_FLOAT_EQ(d.weight_hard_loss(), 0.25f);
    EXPECT_FLOAT_EQ(d.weight_soft_loss(), 0.75f);
  }
  ExpectFails("compute --kind=logprob --weight_hard_loss=0.5 --bt=4 --h=4 --v=4",
              "--kind=logprob does not take --weight_hard_loss (distill)");
}

// verl's menu: the estimator, straight-through, entropy bonus, aggregation, its divisor and
// gpg travel in PolicyOptions; left at their defaults they stay unset; policy's flags only.
TEST_F(LossctlTest, VerlPolicyOptionsTravelAndArePolicysOnly) {
  Result r = Lossctl(
      "compute --kind=policy --bt=6 --h=4 --v=9 --sequences=2 --loss_type=gpg "
      "--kl_estimator=low_var_kl --kl_straight_through --entropy_coeff=0.03 "
      "--aggregation=seq-mean-token-sum-norm --loss_scale_factor=4096");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::PolicyOptions& p = fake_.last_header.policy();
    EXPECT_EQ(p.loss_type(), v1::POLICY_LOSS_GPG);
    EXPECT_EQ(p.kl_estimator(), v1::KL_ESTIMATOR_LOW_VAR_KL);
    EXPECT_TRUE(p.kl_straight_through());
    EXPECT_FLOAT_EQ(p.entropy_coeff(), 0.03f);
    EXPECT_EQ(p.aggregation(), v1::AGGREGATION_SEQ_MEAN_TOKEN_SUM_NORM);
    EXPECT_EQ(p.loss_scale_factor(), 4096);
  }
  r = Lossctl("compute --kind=policy --bt=6 --h=4 --v=9 --kl_estimator=k1 "
              "--aggregation=token-mean");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::PolicyOptions& p = fake_.last_header.policy();
    EXPECT_EQ(p.kl_estimator(), v1::KL_ESTIMATOR_K1);
    EXPECT_EQ(p.aggregation(), v1::AGGREGATION_TOKEN_MEAN);
    EXPECT_FALSE(p.kl_straight_through());
    EXPECT_EQ(p.entropy_coeff(), 0.0f);
    EXPECT_FALSE(p.has_kl_cov_ratio());  // kl_cov's own, sent with it only
  }
  r = Lossctl("compute --kind=policy --bt=6 --h=4 --v=9 --loss_type=kl_cov --kl_cov_ratio=0.25 "
              "--ppo_kl_coef=0.5");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::PolicyOptions& p = fake_.last_header.policy();
    EXPECT_EQ(p.loss_type(), v1::POLICY_LOSS_KL_COV);
    EXPECT_EQ(p.kl_cov_ratio(), 0.25);
    EXPECT_FLOAT_EQ(p.ppo_kl_coef(), 0.5f);
    EXPECT_FALSE(p.has_vespo_k_pos());  // vespo's own, sent with it only
  }
  r = Lossctl("compute --kind=policy --bt=6 --h=4 --v=9 --loss_type=vespo --vespo_k_pos=1.5 "
              "--vespo_lambda_neg=0.5");
  ASSERT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    const v1::PolicyOptions& p = fake_.last_header.policy();
    EXPECT_EQ(p.loss_type(), v1::POLICY_LOSS_VESPO);
    EXPECT_FLOAT_EQ(p.vespo_k_pos(), 1.5f);
    EXPECT_FLOAT_EQ(p.vespo_lambda_pos(), 3.0f);  // the defaults go along, explicit
    EXPECT_FLOAT_EQ(p.vespo_k_neg(), 3.0f);
    EXPECT_FLOAT_EQ(p.vespo_lambda_neg(), 0.5f);
    EXPECT_FALSE(p.has_kl_cov_ratio());
  }
  ExpectFails("compute --kind=logprob --vespo_k_neg=1 --bt=4 --h=4 --v=4",
              "--kind=logprob does not take --vespo_k_neg (policy)");
  ExpectFails("compute --kind=policy --kl_estimator=k4 --bt=4 --h=4 --v=4",
              "--kl_estimator must be one of k3, k1, k2, abs, low_var_kl, got 'k4'");
  ExpectFails("compute --kind=policy --aggregation=token-sum --bt=4 --h=4 --v=4",
              "--aggregation must be one of loss_type, token-mean, seq-mean-token-sum, "
              "seq-mean-token-mean, seq-mean-token-sum-norm, got 'token-sum'");
  ExpectFails("compute --kind=logprob --entropy_coeff=0.1 --kl_straight_through --bt=4 --h=4 "
              "--v=4",
              "--kind=logprob does not take --kl_straight_through (policy), --entropy_coeff "
              "(policy)");
}

TEST_F(LossctlTest, LossKindsUsageErrors) {
  ExpectFails("compute --kind=ppo --bt=4 --h=4 --v=4",
              "--kind must be cross_entropy, logprob, policy or distill, got 'ppo'");
  ExpectFails("compute --kind=policy --loss_type=ppo --bt=4 --h=4 --v=4",
              "--loss_type must be dapo, grpo, bnpo, dr_grpo, cispo, sapo, luspo, gpg, geo_mean, "
              "kl_cov, vespo or cispo_clamp, got 'ppo'");
  ExpectFails("compute --kind=logprob --delta=1.5 --use_bias_correction_kl --bt=4 --h=4 --v=4",
              "--kind=logprob does not take --delta (policy), --use_bias_correction_kl (policy)");
  ExpectFails("compute --kind=logprob --is_ratio=x.npy --bt=4 --h=4 --v=4",
              "--kind=logprob does not take --is_ratio (policy)");
  ExpectFails("compute --kind=policy --importance_sampling=group --bt=4 --h=4 --v=4",
              "--importance_sampling must be token or sequence, got 'group'");
  ExpectFails("compute --kind=logprob --importance_sampling=sequence --bt=4 --h=4 --v=4",
              "--kind=logprob does not take --importance_sampling (policy)");
  ExpectFails("compute --kind=logprob --beta=0.1 --teacher_h=3 --bt=4 --h=4 --v=4",
              "--kind=logprob does not take --beta (policy), --teacher_h (distill)");
  ExpectFails("compute --dlogp=x.npy --bt=4 --h=4 --v=4",
              "--kind=cross_entropy does not take --dlogp (logprob)");
  ExpectFails("compute --kind=distill --bt=4 --h=4 --v=4", "give --teacher_x (a .npy)");
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.peers.empty());  // none of these reached the server
}

TEST_F(LossctlTest, ServerErrorsExitNonZeroWithTheCodeName) {
  fake_.error_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  fake_.error_message = "needs 9 GiB, budget 8 GiB";
  fake_.mode = Mode::kError;  // last: publishes the two above to the server's threads
  ExpectFails("compute --bt=4 --h=4 --v=4",
              "lossctl compute: RESOURCE_EXHAUSTED: needs 9 GiB, budget 8 GiB");
}

TEST_F(LossctlTest, UsageErrors) {
  EXPECT_EQ(Lossctl("").code, 2);
  Result r = Lossctl("frobnicate");
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.output, HasSubstr("unknown command 'frobnicate'"));
  ExpectFails("compute --bt=4 --h=4 --v=4 --reduction=avg",
              "INVALID_ARGUMENT: --reduction must be mean, sum or none");
  ExpectFails("compute --v=4", "give --w (a .npy file) or random shape --v and --h");
  r = Lossctl("compute --bt=4 --h=4 --v=4 --want=dx,gradients");
  EXPECT_THAT(r.output, HasSubstr("unknown output 'gradients'"));
  ExpectFails("compute --x=" + Path("missing.npy") + " --w=" + Path("missing.npy"), "NOT_FOUND");
  // W beside a handle would be ignored: refused.
  ExpectFails("compute --weight_handle=fake-0 --with_bias --bt=3 --h=4 --v=10",
              "--weight_handle carries W and its bias");
  // Dtypes of the wrong kind: random fp32 targets would be written past their buffer, and
  // random int X left unwritten.
  ExpectFails("compute --bt=4096 --h=8 --v=100 --target_dtype=fp32",
              "--target_dtype must be int32 or int64, got 'fp32'");
  ExpectFails("compute --bt=4 --h=8 --v=100 --dtype=int32",
              "--dtype must be bf16, fp16 or fp32, got 'int32'");
  ExpectFails("compute --bt=4 --h=8 --v=100 --grad_dtype=int64",
              "--grad_dtype must be bf16, fp16 or fp32, got 'int64'");
  ExpectFails("compute --bt=4 --h=8 --v=100 --dtype=fp8", "--dtype: unknown dtype 'fp8'");
  // A bias flag that would be ignored: refused.
  HostTensor w = RandomF32({10, 4}, 3);
  ASSERT_TRUE(WriteNpy(Path("w.npy"), w).ok());
  ExpectFails("compute --bt=3 --w=" + Path("w.npy") + " --with_bias",
              "--with_bias adds a random bias to random weights");
  ExpectFails("put-weights --v=10 --h=4 --bias=" + Path("w.npy"), "--bias goes with --w");
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.peers.empty());  // none of these reached the server
}

// Inputs from files take their targets from a file: random targets beside real X were used
// silently and gave a loss that meant nothing.
TEST_F(LossctlTest, FileInputsNeedTargets) {
  ASSERT_TRUE(WriteNpy(Path("x.npy"), RandomF32({5, 4}, 7)).ok());
  ASSERT_TRUE(WriteNpy(Path("w.npy"), RandomF32({10, 4}, 8)).ok());
  ExpectFails("compute --x=" + Path("x.npy") + " --w=" + Path("w.npy"),
              "INVALID_ARGUMENT: --x and --w are files but --targets is not given: give "
              "--targets (a .npy of the (BT) target ids)");
  ExpectFails("compute --x=" + Path("x.npy") + " --v=10 --h=4",
              "INVALID_ARGUMENT: --x is a file but --targets is not given");
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.peers.empty());
}

// A .npy whose header claims far more than the file holds: refused, naming the file, the
// shape and the sizes (lossctl died of std::bad_alloc allocating the claimed 37 GiB first).
TEST_F(LossctlTest, NpyHeaderLargerThanTheFileIsRefused) {
  std::string file = EncodeNpyHeader(DType::kF32, {100000, 100000});
  file += "12345678";
  FILE* f = std::fopen(Path("huge.npy").c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(std::fwrite(file.data(), 1, file.size(), f), file.size());
  std::fclose(f);
  ExpectFails("compute --x=" + Path("huge.npy") + " --v=10 --h=4",
              absl::StrCat("INVALID_ARGUMENT: ", Path("huge.npy"), " (", file.size(),
                           " bytes): malformed .npy: shape fp32[100000, 100000] needs "
                           "40000000000 data bytes, the file holds 8"));
}

// Numbers lossctl reads itself are checked against their range, naming the flag and the value,
// before anything is sent.
TEST_F(LossctlTest, FlagsOutsideTheirRangeAreRefused) {
  const std::pair<const char*, const char*> cases[] = {
      {"compute --bt=4 --h=4 --v=8 --ignore_fraction=2",
       "--ignore_fraction must be in [0, 1], got 2"},
      {"compute --bt=4 --h=4 --v=8 --ignore_fraction=-0.5",
       "--ignore_fraction must be in [0, 1], got -0.5"},
      {"compute --bt=-4 --h=4 --v=8", "--bt must be >= 0, got -4"},
      {"compute --bt=4 --h=4 --v=8 --deadline_seconds=-1",
       "--deadline_seconds must be finite and >= 0 (0 = none), got -1"},
      {"compute --bt=4 --h=4 --v=8 --response_part_bytes=100",
       "--response_part_bytes must be 0 (the server's default) or in [1024, 4294967295], got 100"},
      {"compute --bt=4 --h=4 --v=8 --part_bytes=0", "--part_bytes must be > 0, got 0"},
      {"bench --bt=4 --h=4 --v=8 --calls=0", "--calls must be >= 1, got 0"},
      {"bench --bt=4 --h=4 --v=8 --concurrency=0", "--concurrency must be >= 1, got 0"},
      {"bench --bt=4 --h=4 --v=8 --warmup=-1", "--warmup must be >= 0, got -1"},
      {"info --connections=0", "--connections must be >= 1, got 0"},
      {"head export --head=lm --out_dir=/tmp/x --range_bytes=0",
       "--range_bytes must be > 0, got 0"},
      {"compute --kind=distill --bt=4 --h=4 --v=8 --teacher_h=-3",
       "--teacher_h must be >= 0, got -3"},
  };
  for (const auto& [args, message] : cases) {
    ExpectFails(args, absl::StrCat("INVALID_ARGUMENT: ", message));
  }
  Result r = Lossctl("compute --bt=4 --h=4 --v=8 --ignore_fraction=2 --json", /*stdout_only=*/true);
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.output, HasSubstr("\"message\": \"--ignore_fraction must be in [0, 1], got 2\""));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_TRUE(fake_.peers.empty());  // none of these reached the server
}

// --help lists the loss kinds' flags (client/lossctl_kinds.cc) beside lossctl.cc's, as the
// docs say it lists every flag.
TEST_F(LossctlTest, HelpListsTheFlagsOfEveryCommand) {
  const Result r = Lossctl("--help");
  EXPECT_EQ(r.code, 0) << r.output;  // the help asked for is a success
  EXPECT_EQ(Lossctl("--helpfull").code, 0);
  std::vector<std::string> missing;
  for (const char* flag : {"--target (", "--range_bytes (", "--kind (", "--temperature (",
                           "--keep_ms (", "--ticket (", "--loss_type (", "--jsd_beta (",
                           "--teacher_h ("}) {
    if (r.output.find(flag) == std::string::npos) missing.push_back(flag);
  }
  EXPECT_TRUE(missing.empty()) << absl::StrJoin(missing, " ") << " not in:\n" << r.output;
  EXPECT_THAT(r.output, HasSubstr("Flags from client/lossctl_kinds.cc"));
}

TEST_F(LossctlTest, WeightHandleLifecycle) {
  Result r = Lossctl("put-weights --v=10 --h=4 --dtype=fp16");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("handle      fake-0\n"));
  r = Lossctl("compute --weight_handle=fake-0 --bt=3 --h=4 --v=10 --dtype=fp16");
  EXPECT_EQ(r.code, 0) << r.output;
  {
    absl::MutexLock lock(&fake_.mu);
    EXPECT_EQ(fake_.last_header.weight_handle(), "fake-0");
    EXPECT_FALSE(fake_.last_header.has_w());
  }
  EXPECT_EQ(Lossctl("drop-weights --handle=fake-0").code, 0);
  ExpectFails("drop-weights --handle=fake-0", "NOT_FOUND: unknown weight handle 'fake-0'");
  EXPECT_EQ(Lossctl("drop-weights").code, 1);
}

TEST_F(LossctlTest, AccumulateFetchAndDrop) {
  for (int i = 0; i < 2; ++i) {
    Result r = Lossctl("compute --bt=4 --h=3 --v=5 --accumulator=acc --want=dx");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr(absl::StrCat("micro_batches ", i + 1)));
  }
  Result r = Lossctl("fetch-gradients --accumulator=acc --reset --out_dir=" + Path("g"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("micro_batches 2\n"));
  HostTensor dw = Read("g/dw.npy");
  ASSERT_EQ(dw.shape(), (std::vector<int64_t>{5, 3}));
  for (int i = 0; i < 15; ++i) EXPECT_EQ(dw.data_as<float>()[i], static_cast<float>(i + 2));
  EXPECT_EQ(Lossctl("drop-accumulator --accumulator=acc").code, 0);
  ExpectFails("drop-accumulator --accumulator=acc", "NOT_FOUND: no accumulator 'acc'");
}

TEST_F(LossctlTest, ListShowsHandlesAndAccumulatorsOnlyWhereTheServerHasIt) {
  ExpectFails("list", "UNIMPLEMENTED: the server (lossd 0.0-fake) does not support 'list_state'");
  {
    absl::MutexLock lock(&fake_.mu);
    fake_.features = {"list_state"};
  }
  ASSERT_EQ(Lossctl("put-weights --v=10 --h=4 --dtype=fp16").code, 0);
  ASSERT_EQ(Lossctl("compute --bt=4 --h=3 --v=5 --accumulator=acc --want=dx").code, 0);
  Result r = Lossctl("list");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("weights     fake-0"));
  EXPECT_THAT(r.output, HasSubstr("accumulator acc"));
  EXPECT_THAT(r.output, ::testing::ContainsRegex("fake-0 +80 "));  // 10 x 4 fp16
  EXPECT_THAT(r.output, ::testing::ContainsRegex("acc +60 +[0-9.]+ 1\n"));  // 5 x 3 fp32
}

TEST_F(LossctlTest, Bench) {
  Result r =
      Lossctl("bench --bt=8 --h=8 --v=16 --calls=6 --concurrency=2 --connections=2 --put_weights");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("put_weights "));
  EXPECT_THAT(r.output, HasSubstr("calls       6 ok, 0 failed"));
  EXPECT_THAT(r.output, HasSubstr("latency_ms  p50 "));
  EXPECT_THAT(r.output, HasSubstr("tokens/s "));
  EXPECT_THAT(r.output, HasSubstr("GiB/s "));
  EXPECT_THAT(r.output,
              ::testing::ContainsRegex("put_weights 256 B in [0-9.]+ s \\([0-9.]+ GiB/s\\)"));
  absl::MutexLock lock(&fake_.mu);
  EXPECT_EQ(fake_.peers.size(), 2u);   // two connections
  EXPECT_TRUE(fake_.weights.empty());  // the uploaded weights were dropped at the end
}

TEST_F(LossctlTest, ReplicasShowsEachReplicaAndWhereKeysLive) {
  const std::string up = absl::StrCat("127.0.0.1:", port_);
  Result r = Lossctl(absl::StrCat("replicas --replicas=", up, " --keys=head:lm,rank:3"));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr(up));
  EXPECT_THAT(r.output, HasSubstr("fake-instance"));
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("head:lm", std::string(22, ' '), "-> ", up,
                                               " (then none)")));
  // A second replica where nothing listens: listed as unreachable, exit 1, and each key's
  // order over both as the pools of trainers compute it.
  const std::string down = "127.0.0.2:1";
  r = Lossctl(absl::StrCat("replicas --replicas=", up, ",", down, " --keys=acc:step-7"));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat(down, std::string(28 - down.size() + 1, ' '),
                                               "unreachable: UNAVAILABLE")));
  EXPECT_THAT(r.output, HasSubstr("1 of 2 replicas did not answer"));
  const std::vector<std::string> order = RendezvousOrder("acc:step-7", {up, down});
  EXPECT_THAT(r.output, HasSubstr(absl::StrCat("-> ", order[0], " (then ", order[1], ")")));
  ExpectFails("replicas", "replicas needs --replicas=");
  ExpectFails("replicas --replicas=a:0", "--replicas: targets entry 'a:0': port '0'");
}

TEST_F(LossctlTest, UnreachableServer) {
  ExpectFails("info --target=127.0.0.1:1", "lossctl info: UNAVAILABLE");
}

}  // namespace
}  // namespace client
}  // namespace lossd
