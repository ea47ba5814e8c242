// SPDX-License-Identifier: Apache-2.0
// Tests the engine's ownership of state: a weight handle and an accumulator made under one
// principal are refused (PERMISSION_DENIED) to another for every use, fetch and drop, and
// served to their owner; state made without a principal stays anyone's. ListState reports a
// caller's own state; DropIdleState drops what no call has named for the idle time.
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"
#include "testing/test_util.h"
#include "engine/engine.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 5, kH = 4, kV = 7;

RandomProblem Problem() {
  RandomProblemSpec s;
  s.bt = kBt;
  s.h = kH;
  s.v = kV;
  s.dtype = DType::kF32;
  return RandomProblem::Make(s);
}

// Uploads the problem's W under `owner`; returns the handle.
std::string Upload(Engine& e, const RandomProblem& rp, const std::string& owner) {
  auto h = UploadWeights(e, DType::kF32, kV, kH, rp.w, {}, owner);
  EXPECT_TRUE(h.ok()) << h.status();
  return *h;
}

// A Compute by `caller` with W by `handle`, adding into accumulator `acc`.
absl::Status Compute(Engine& e, const RandomProblem& rp, const std::string& handle,
                     const std::string& acc, const std::string& caller) {
  ComputeSpec c;
  c.inputs[static_cast<int>(InputSlot::kX)] = InputDesc(DType::kF32, {kBt, kH});
  c.inputs[static_cast<int>(InputSlot::kTargets)] = InputDesc(DType::kI64, {kBt});
  c.weight_handle = handle;
  c.accumulator = acc;
  c.owner = caller;
  c.wanted.dx = true;
  auto plan = e.Plan(c);
  if (!plan.ok()) return plan.status();
  auto in = std::make_shared<Engine::InputBuffers>();
  for (auto [slot, src] : {std::pair<InputSlot, const void*>{InputSlot::kX, rp.x.data()},
                           {InputSlot::kTargets, rp.targets.data()}}) {
    const uint64_t n = plan->input_bytes[static_cast<int>(slot)];
    (*in)[static_cast<int>(slot)] = NewHostBuffer(n);
    std::memcpy((*in)[static_cast<int>(slot)].get(), src, n);
  }
  std::promise<absl::Status> done;
  e.Run(std::make_shared<const ComputePlan>(*plan), in,
        [&](ComputeOutcome o) { done.set_value(o.status); });
  return done.get_future().get();
}

void ExpectDenied(const absl::Status& s, const std::string& what) {
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(s.message().find(what + " belongs to another credential"), std::string::npos) << s;
}

TEST(OwnershipTest, OnlyTheCreatorMayUseFetchOrDrop) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  const RandomProblem rp = Problem();
  const std::string handle = Upload(e, rp, "token:0");
  ASSERT_TRUE(Compute(e, rp, handle, "acc", "token:0").ok());

  const std::string h = "weight handle '" + handle + "'";
  ExpectDenied(Compute(e, rp, handle, "other-acc", "token:1"), h);
  ExpectDenied(e.DropWeights(handle, "token:1"), h);
  // The accumulator, with weights of the intruder's own.
  const std::string theirs = Upload(e, rp, "token:1");
  ExpectDenied(Compute(e, rp, theirs, "acc", "token:1"), "accumulator 'acc'");
  ExpectDenied(e.CheckFetch("acc", false, 0, 0, "token:1").status(), "accumulator 'acc'");
  ExpectDenied(e.FetchGradients("acc", true, 0, 0, "token:1").status(), "accumulator 'acc'");
  ExpectDenied(e.DropAccumulator("acc", "token:1"), "accumulator 'acc'");

  // Nothing of the owner's changed; it still may do everything.
  auto g = e.FetchGradients("acc", false, 0, 0, "token:0");
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 1u);
  EXPECT_TRUE(e.DropAccumulator("acc", "token:0").ok());
  EXPECT_TRUE(e.DropWeights(handle, "token:0").ok());
}

TEST(OwnershipTest, StateMadeWithoutAPrincipalIsAnyones) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  const RandomProblem rp = Problem();
  const std::string handle = Upload(e, rp, "");
  ASSERT_TRUE(Compute(e, rp, handle, "shared", "").ok());
  ASSERT_TRUE(Compute(e, rp, handle, "shared", "").ok());
  EXPECT_TRUE(e.FetchGradients("shared", false).ok());
  EXPECT_TRUE(e.DropAccumulator("shared").ok());
  EXPECT_TRUE(e.DropWeights(handle).ok());
}

TEST(OwnershipTest, ListShowsTheCallersOwnStateAndTheIdleSweepDropsIt) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  const RandomProblem rp = Problem();
  const std::string mine = Upload(e, rp, "token:0");
  const std::string theirs = Upload(e, rp, "token:1");
  ASSERT_TRUE(Compute(e, rp, mine, "mine", "token:0").ok());
  ASSERT_TRUE(Compute(e, rp, mine, "mine", "token:0").ok());
  const int64_t after = NowNs();

  std::vector<StateInfo> list = e.ListState("token:0");
  ASSERT_EQ(list.size(), 2u);
  for (const StateInfo& s : list) {
    EXPECT_GT(s.last_used_ns, 0);
    EXPECT_LE(s.last_used_ns, after);
    if (s.kind == StateInfo::Kind::kWeights) {
      EXPECT_EQ(s.name, mine);
      EXPECT_EQ(s.bytes, static_cast<uint64_t>(kV * kH * 4));
    } else {
      EXPECT_EQ(s.name, "mine");
      EXPECT_EQ(s.bytes, static_cast<uint64_t>(kV * kH * 4));
      EXPECT_EQ(s.micro_batches, 2u);
    }
  }
  ASSERT_EQ(e.ListState("token:1").size(), 1u);
  EXPECT_EQ(e.ListState("token:1")[0].name, theirs);
  EXPECT_TRUE(e.ListState("token:2").empty());

  // Nothing has been idle for an hour; everything has been for no time at all.
  EXPECT_TRUE(e.DropIdleState(absl::Hours(1)).empty());
  std::vector<std::string> dropped = e.DropIdleState(absl::ZeroDuration());
  ASSERT_EQ(dropped.size(), 3u);
  EXPECT_NE(dropped[2].find("accumulator mine ("), std::string::npos) << dropped[2];
  EXPECT_TRUE(e.ListState("token:0").empty());
  EXPECT_EQ(e.FetchGradients("mine", false, 0, 0, "token:0").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Compute(e, rp, mine, "", "token:0").code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace lossd
