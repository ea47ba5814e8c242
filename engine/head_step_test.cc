// SPDX-License-Identifier: Apache-2.0
// The Step barrier of a hosted head in the engine (CPU backend, no gRPC): versions and the
// next version's Computes waiting for the step, ranks that disagree, an empty step, skip,
// reduce then apply, a rank that never arrives.
#include <chrono>
#include <cmath>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "testing/heads_test_fixture.h"

namespace lossd {
namespace {

using heads_testing::AdamW;
using heads_testing::Floats;
using heads_testing::Has;
using heads_testing::HeadsTest;
using heads_testing::MicroBatch;
using heads_testing::Sgd;
using heads_testing::SmallHeadsTest;

TEST_F(HeadsTest, VersionsAreCheckedAndTheNextVersionWaitsForTheStep) {
  ASSERT_TRUE(Create("h", Sgd(), false).ok());
  ASSERT_TRUE(Compute("h", 0, 0, 0, 60, false).status.ok());
  ComputeOutcome ahead = Compute("h", 1, 0, 0, 61, false);
  EXPECT_TRUE(Has(ahead.status, absl::StatusCode::kFailedPrecondition, "not reached yet"))
      << ahead.status;
  // Rank 0 calls Step; rank 1 has not yet: rank 0's Compute of version 1 waits.
  std::promise<absl::StatusOr<StepResult>> r0;
  StepCall call{"h", 0, 0, 2};
  e_.heads().Step(call, "", [&](absl::StatusOr<StepResult> s) { r0.set_value(s); });
  std::promise<ComputeOutcome> next;
  {
    RandomProblem rp = MicroBatch(62, false);
    ComputeSpec spec = ComputeSpecFor(rp);
    spec.inputs[static_cast<int>(InputSlot::kW)].present = false;
    spec.head = "h";
    spec.head_version = 1;
    auto plan = e_.Plan(spec);
    ASSERT_TRUE(plan.ok()) << plan.status();
    e_.Run(std::make_shared<const ComputePlan>(*plan), InputBuffersFor(rp, *plan),
           [&](ComputeOutcome o) { next.set_value(std::move(o)); });
  }
  auto waiting = next.get_future();
  EXPECT_EQ(waiting.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->ranks_waiting, 1u);
  call.rank = 1;
  std::promise<absl::StatusOr<StepResult>> r1;
  e_.heads().Step(call, "", [&](absl::StatusOr<StepResult> s) { r1.set_value(s); });
  auto s0 = r0.get_future().get(), s1 = r1.get_future().get();
  ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status() << s1.status();
  EXPECT_EQ(s0->version, 1u);
  ComputeOutcome o = waiting.get();
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_TRUE(o.head_added);
  EXPECT_EQ(o.head_version, 1u);
  ComputeOutcome old = Compute("h", 0, 0, 1, 63, false);
  EXPECT_TRUE(Has(old.status, absl::StatusCode::kFailedPrecondition, "is at version 1"))
      << old.status;
  // A retried Step of the completed step gets its result again.
  auto again = StepAll(StepCall{"h", 0, 0, 2});
  ASSERT_TRUE(again[0].ok()) << again[0].status();
  EXPECT_EQ(again[0]->version, 1u);
  EXPECT_TRUE(again[0]->replayed);  // so metrics do not count the step twice
  EXPECT_FALSE(s0->replayed);
  EXPECT_EQ(e_.heads().Info("h", "")->version, 1u);
}

// Every rank of a step hears of a disagreement as soon as it is known, not after
// --head_step_timeout (10 minutes here); nothing runs and the step's sum is kept for a Step
// the ranks agree on.
TEST_F(HeadsTest, RanksThatDisagreeAreAllRefusedAtOnce) {
  ASSERT_TRUE(Create("h", AdamW(), false).ok());
  ASSERT_TRUE(Compute("h", 0, 0, 0, 40, false).status.ok());
  ASSERT_TRUE(Compute("h", 0, 1, 0, 41, false).status.ok());
  auto call = [&](StepCall c) {
    auto p = std::make_shared<std::promise<absl::StatusOr<StepResult>>>();
    e_.heads().Step(c, "", [p](absl::StatusOr<StepResult> s) { p->set_value(s); });
    return p->get_future();
  };
  auto answer = [](std::future<absl::StatusOr<StepResult>>& f) {
    if (f.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      return absl::DeadlineExceededError("no answer within 10 s");
    }
    return f.get().status();
  };
  StepCall a{"h", 0, 0, 2};
  a.lr = 0.25;
  StepCall b = a;
  b.rank = 1;
  b.lr = 0.5;
  auto f0 = call(a);
  auto f1 = call(b);  // another lr: both ranks are refused, each naming both argument sets
  for (auto* f : {&f0, &f1}) {
    absl::Status s = answer(*f);
    EXPECT_TRUE(Has(s, absl::StatusCode::kFailedPrecondition, "lr 0.5") &&
                Has(s, absl::StatusCode::kFailedPrecondition, "lr 0.25") &&
                Has(s, absl::StatusCode::kFailedPrecondition, "every rank of a step must agree") &&
                Has(s, absl::StatusCode::kFailedPrecondition, "gradient sum are kept"))
        << s;
  }
  EXPECT_EQ(e_.heads().Info("h", "")->ranks_waiting, 0u);
  // Another world_size, and a version ahead of the head's, the same way.
  f0 = call(a);
  StepCall wide = a;
  wide.rank = 1;
  wide.world_size = 3;
  EXPECT_TRUE(Has(answer(f1 = call(wide)), absl::StatusCode::kFailedPrecondition,
                  "world_size 3"));
  EXPECT_TRUE(Has(answer(f0), absl::StatusCode::kFailedPrecondition, "world_size 3"));
  StepCall ahead = b;
  ahead.lr = a.lr;
  ahead.version = 3;
  f0 = call(a);
  EXPECT_TRUE(Has(answer(f1 = call(ahead)), absl::StatusCode::kFailedPrecondition,
                  "is at version 0, not 3"));
  EXPECT_TRUE(Has(answer(f0), absl::StatusCode::kFailedPrecondition, "is at version 0, not 3"));
  // The other order: the rank ahead calls first, so the rank that arrives later is refused
  // at once, naming it, rather than waiting out the timeout for it.
  EXPECT_TRUE(Has(answer(f1 = call(ahead)), absl::StatusCode::kFailedPrecondition,
                  "is at version 0, not 3"));
  EXPECT_TRUE(Has(answer(f0 = call(a)), absl::StatusCode::kFailedPrecondition,
                  "rank 1 called it with (version 3"));
  // A phase the others do not share.
  StepCall reduce{"h", 0, 0, 2}, apply{"h", 0, 1, 2};
  reduce.phase = StepPhase::kReduce;
  apply.phase = StepPhase::kApply;
  f0 = call(reduce);
  EXPECT_TRUE(Has(answer(f1 = call(apply)), absl::StatusCode::kFailedPrecondition,
                  "before its STEP_REDUCE"));
  EXPECT_TRUE(Has(answer(f0), absl::StatusCode::kFailedPrecondition, "STEP_REDUCE"));
  EXPECT_TRUE(Has(answer(f1 = call(StepCall{"h", 0, 5, 2})), absl::StatusCode::kInvalidArgument,
                  "rank < world_size"));
  // Agreed at last: the kept sum of both Computes is applied.
  StepCall agreed = b;
  agreed.lr = a.lr;
  f0 = call(a);
  f1 = call(agreed);
  for (auto* f : {&f0, &f1}) {
    ASSERT_EQ(f->wait_for(std::chrono::seconds(10)), std::future_status::ready);
    auto r = f->get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->applied);
    EXPECT_EQ(r->contributions, 2u);
    EXPECT_EQ(r->version, 1u);
  }
}

// A Step with nothing added moves nothing (torch leaves a parameter without a gradient as it
// is): refused naming the head and the version; a skip still moves past it.
TEST_F(HeadsTest, AStepWithNoContributionsIsRefusedAndMovesNothing) {
  ASSERT_TRUE(Create("h", AdamW(), true).ok());  // weight decay 0.1 on W, 0.02 on the bias
  ASSERT_TRUE(Compute("h", 0, 0, 0, 30, true).status.ok());
  ASSERT_TRUE(StepAll(StepCall{"h", 0, 0, 1})[0].ok());  // the state is not zero any more
  const auto before = Export("h");
  auto full = StepAll(StepCall{"h", 1, 0, 1});
  EXPECT_TRUE(Has(full[0].status(), absl::StatusCode::kFailedPrecondition,
                  "the Step of head 'h' version 1 has no contributions") &&
              Has(full[0].status(), absl::StatusCode::kFailedPrecondition,
                  "redo the step's Computes at version 1 and call Step again, or call Step "
                  "with skip"))
      << full[0].status();
  // Two phases: the reduce reports the empty sum, the apply is refused.
  StepCall reduce{"h", 1, 0, 1}, apply{"h", 1, 0, 1};
  reduce.phase = StepPhase::kReduce;
  apply.phase = StepPhase::kApply;
  auto r = StepAll(reduce);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_EQ(r[0]->contributions, 0u);
  EXPECT_TRUE(Has(StepAll(apply)[0].status(), absl::StatusCode::kFailedPrecondition,
                  "has no contributions"));
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->version, 1u);
  EXPECT_EQ(info->optimizer_step, 1);
  EXPECT_EQ(Export("h"), before);  // W, the bias, the optimizer state and the copy
  StepCall skip{"h", 1, 0, 1};
  skip.skip = true;
  auto skipped = StepAll(skip);
  ASSERT_TRUE(skipped[0].ok()) << skipped[0].status();
  EXPECT_FALSE(skipped[0]->applied);
  EXPECT_EQ(skipped[0]->version, 2u);
  EXPECT_EQ(e_.heads().Info("h", "")->optimizer_step, 1);
  EXPECT_EQ(Export("h"), before);
  // The step's Computes redone, the Step applies.
  ASSERT_TRUE(Compute("h", 2, 0, 0, 31, true).status.ok());
  auto applied = StepAll(StepCall{"h", 2, 0, 1});
  ASSERT_TRUE(applied[0].ok()) << applied[0].status();
  EXPECT_TRUE(applied[0]->applied);
  EXPECT_EQ(e_.heads().Info("h", "")->optimizer_step, 2);
}

TEST_F(HeadsTest, SkipDropsTheGradientsAndKeepsW) {
  ASSERT_TRUE(Create("h", AdamW(), true).ok());
  auto before = Export("h");
  ASSERT_TRUE(Compute("h", 0, 0, 0, 70, true).status.ok());
  StepCall call{"h", 0, 0, 1};
  call.skip = true;
  auto r = StepAll(call);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_FALSE(r[0]->applied);
  EXPECT_EQ(r[0]->version, 1u);
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->optimizer_step, 0);
  EXPECT_EQ(info->contributions, 0u);
  EXPECT_EQ(Export("h"), before);
}

TEST_F(HeadsTest, ReduceGivesTheNormAndApplyTakesTheTrainersCoefficient) {
  ASSERT_TRUE(Create("h", Sgd(), true).ok());
  ASSERT_TRUE(Compute("h", 0, 0, 0, 80, true).status.ok());
  AddToOracle("oracle", 80, true);
  auto sum = e_.FetchGradients("oracle", false);
  ASSERT_TRUE(sum.ok());
  double ss = 0;
  for (float g : Floats(std::vector<uint8_t>(sum->data.get(),
                                             sum->data.get() + sum->end))) {
    ss += static_cast<double>(g) * g;
  }
  StepCall reduce{"h", 0, 0, 1};
  reduce.phase = StepPhase::kReduce;
  auto r = StepAll(reduce);
  ASSERT_TRUE(r[0].ok()) << r[0].status();
  EXPECT_FALSE(r[0]->applied);
  EXPECT_EQ(r[0]->version, 0u);
  EXPECT_TRUE(r[0]->finite);
  EXPECT_NEAR(r[0]->grad_norm, std::sqrt(ss), 1e-12 * std::sqrt(ss));
  // The sum is closed between reduce and apply.
  EXPECT_TRUE(Has(Compute("h", 0, 0, 1, 81, true).status, absl::StatusCode::kFailedPrecondition,
                  "closed"));
  StepCall apply{"h", 0, 0, 1};
  apply.phase = StepPhase::kApply;
  apply.clip_coef = 0.25f;
  apply.lr = 0.5;
  auto a = StepAll(apply);
  ASSERT_TRUE(a[0].ok()) << a[0].status();
  EXPECT_TRUE(a[0]->applied);
  EXPECT_EQ(a[0]->clip_coef, 0.25f);
  EXPECT_EQ(a[0]->grad_norm, r[0]->grad_norm);
  EXPECT_EQ(a[0]->version, 1u);
}

TEST_F(SmallHeadsTest, ARankThatNeverArrivesTimesTheStepOut) {
  ASSERT_TRUE(Create("h", AdamW(), false).ok());
  auto before = Export("h");
  ASSERT_TRUE(Compute("h", 0, 0, 0, 5, false).status.ok());
  std::promise<absl::StatusOr<StepResult>> r0;
  e_.heads().Step(StepCall{"h", 0, 0, 3}, "",
                  [&](absl::StatusOr<StepResult> s) { r0.set_value(s); });
  auto s = r0.get_future().get();
  EXPECT_TRUE(Has(s.status(), absl::StatusCode::kDeadlineExceeded, "waiting for ranks 1, 2"))
      << s.status();
  DrainExecutor(e_);
  auto info = e_.heads().Info("h", "");
  EXPECT_EQ(info->version, 0u);
  EXPECT_EQ(info->contributions, 0u);  // dropped
  EXPECT_EQ(Export("h"), before);
  EXPECT_TRUE(Compute("h", 0, 0, 0, 5, false).head_added);  // the step starts over
}

}  // namespace
}  // namespace lossd
