// SPDX-License-Identifier: Apache-2.0
// The two-phase log-prob on the CUDA backend (the plugin, as the server loads it), through the
// engine: the backward of a ticket gives the bits of the one-phase call with the same dlogp
// and dentropy, with W inline (the ticket's copy in device memory, the one-phase call's W
// from the host) and by weight handle, bf16, at a shape of several chunks. GPU only.
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gtest/gtest.h"
#include "kernels/plugin_loader.h"
#include "testing/engine_calls.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 1000, kH = 256, kV = 5003;  // nothing a multiple of 8 but H

class TwoPhaseGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b = LoadCudaBackend("", DefaultCudaOptions());
    ASSERT_TRUE(b.ok()) << b.status();
    EngineOptions o;
    o.instance = "0123abcd";
    e_ = std::make_unique<Engine>(std::move(*b), o);
    RandomProblemSpec s = ShapeSpec(kBt, kH, kV);
    s.bias = true;
    s.ignore_fraction = 0.1;
    s.seed = 3;
    rp_ = std::make_unique<RandomProblem>(RandomProblem::Make(s));
    std::mt19937_64 g(4);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    dlogp_.resize(kBt);
    dentropy_.resize(kBt);
    for (int64_t i = 0; i < kBt; ++i) {
      dlogp_[i] = u(g) / kBt;
      dentropy_[i] = u(g) / kBt;
    }
  }

  ComputeSpec Spec(const std::string& handle, bool keep, bool grads) const {
    ComputeSpec s;
    s.kind = LossKind::kLogprob;
    s.inputs[static_cast<int>(InputSlot::kX)] = InputDesc(DType::kBF16, {kBt, kH});
    s.inputs[static_cast<int>(InputSlot::kTargets)] = InputDesc(DType::kI64, {kBt});
    if (handle.empty()) {
      s.inputs[static_cast<int>(InputSlot::kW)] = InputDesc(DType::kBF16, {kV, kH});
      s.inputs[static_cast<int>(InputSlot::kBias)] = InputDesc(DType::kBF16, {kV});
    }
    s.weight_handle = handle;
    s.options.temperature = 0.7f;
    s.options.softcap = 30.0f;
    s.wanted.entropy = true;
    s.keep_ms = keep ? 60000 : 0;
    if (grads) {
      s.inputs[static_cast<int>(InputSlot::kDlogp)] = InputDesc(DType::kF32, {kBt});
      s.inputs[static_cast<int>(InputSlot::kDentropy)] = InputDesc(DType::kF32, {kBt});
      s.wanted.dx = s.wanted.dw = s.wanted.db = true;
    }
    return s;
  }

  ComputeOutcome Go(const ComputeSpec& spec, ComputePlan* plan_out = nullptr) {
    auto plan = e_->Plan(spec);
    if (!plan.ok()) {
      ComputeOutcome o;
      o.status = plan.status();
      return o;
    }
    InputSources src = InputSourcesOf(rp_->problem());
    src[static_cast<int>(InputSlot::kDlogp)] = dlogp_.data();
    src[static_cast<int>(InputSlot::kDentropy)] = dentropy_.data();
    if (plan_out != nullptr) *plan_out = *plan;
    return RunSync(*e_, *plan, InputBuffersFrom(*plan, src));
  }

  // Forward with keep, its backward, and the one-phase call: the same bits.
  void ExpectTwoPhaseIsOnePhase(const std::string& handle) {
    const ComputeOutcome f = Go(Spec(handle, true, false));
    ASSERT_TRUE(f.status.ok()) << f.status;
    ASSERT_FALSE(f.ticket.empty());
    ComputeSpec back;
    back.kind = LossKind::kLogprob;
    back.ticket = f.ticket;
    back.inputs[static_cast<int>(InputSlot::kDlogp)] = InputDesc(DType::kF32, {kBt});
    back.inputs[static_cast<int>(InputSlot::kDentropy)] = InputDesc(DType::kF32, {kBt});
    back.wanted.dx = back.wanted.dw = back.wanted.db = back.wanted.entropy = true;
    const ComputeOutcome b = Go(back);
    ComputePlan plan;
    const ComputeOutcome o = Go(Spec(handle, false, true), &plan);
    ASSERT_TRUE(b.status.ok()) << b.status;
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(std::memcmp(&b.loss, &o.loss, sizeof(float)), 0) << b.loss << " vs " << o.loss;
    EXPECT_NE(o.loss, 0.0f);
    ASSERT_EQ(b.outputs.size(), plan.outputs.size());
    for (size_t i = 0; i < plan.outputs.size(); ++i) {
      EXPECT_EQ(std::memcmp(b.outputs[i].get(), o.outputs[i].get(), plan.outputs[i].bytes), 0)
          << OutputSlotName(plan.outputs[i].slot);
    }
    // The forward's logp (the first output of both) too.
    EXPECT_EQ(std::memcmp(f.outputs[0].get(), o.outputs[0].get(), kBt * 4), 0);
    EXPECT_EQ(e_->tickets().count(), 0u);
  }

  std::unique_ptr<Engine> e_;
  std::unique_ptr<RandomProblem> rp_;
  std::vector<float> dlogp_, dentropy_;
};

TEST_F(TwoPhaseGpuTest, InlineWeightsKeptOnTheDevice) { ExpectTwoPhaseIsOnePhase(""); }

TEST_F(TwoPhaseGpuTest, AWeightHandle) {
  auto p = e_->BeginPutWeights(InputDesc(DType::kBF16, {kV, kH}), InputDesc(DType::kBF16, {kV}));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_TRUE(e_->WriteWeights(**p, false, 0, rp_->w.data(), rp_->w.size()).ok());
  ASSERT_TRUE(e_->WriteWeights(**p, true, 0, rp_->bias.data(), rp_->bias.size()).ok());
  auto handle = e_->CommitWeights(std::move(*p));
  ASSERT_TRUE(handle.ok()) << handle.status();
  ExpectTwoPhaseIsOnePhase(*handle);
}

}  // namespace
}  // namespace lossd
