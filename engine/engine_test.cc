// SPDX-License-Identifier: Apache-2.0
// Engine-level tests (no gRPC): validation messages, data checks and the accumulator's
// failure rule, run against the CPU backend with the float64 reference as the oracle.
#include "engine/engine.h"

#include <cmath>
#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference.h"
#include "testing/engine_calls.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

// A random problem of shape (bt, h, v), the spec's defaults otherwise.
RandomProblem ProblemOf(int64_t bt, int64_t h, int64_t v, double ignore_fraction = 0) {
  RandomProblemSpec s;
  s.bt = bt;
  s.h = h;
  s.v = v;
  s.ignore_fraction = ignore_fraction;
  return RandomProblem::Make(s);
}

TEST(EngineTest, PlanComputesByteCountsAndOutputs) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblem rp = ProblemOf(5, 3, 7);
  auto plan = e.Plan(ComputeSpecFor(rp));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kX)], 5u * 3 * 2);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kW)], 7u * 3 * 2);
  EXPECT_EQ(plan->input_bytes[static_cast<int>(InputSlot::kTargets)], 5u * 8);
  ASSERT_EQ(plan->outputs.size(), 2u);
  EXPECT_EQ(plan->outputs[0].slot, OutputSlot::kDx);
  EXPECT_EQ(plan->outputs[1].slot, OutputSlot::kDw);
  EXPECT_GT(plan->admission_bytes(), plan->host_bytes);
}

TEST(EngineTest, ShapeLimitsAreNamed) {
  EngineOptions o;
  o.max_v = 100;
  Engine e(NewCpuBackend(1), o);
  RandomProblemSpec s;
  s.v = 101;
  RandomProblem rp = RandomProblem::Make(s);
  auto plan = e.Plan(ComputeSpecFor(rp));
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("V <= 100"), std::string::npos) << plan.status();
}

TEST(EngineTest, RunMatchesTheReference) {
  Engine e(NewCpuBackend(2), EngineOptions{});
  RandomProblem rp = ProblemOf(33, 17, 77, 0.2);
  auto plan = e.Plan(ComputeSpecFor(rp));
  ASSERT_TRUE(plan.ok());
  ComputeOutcome o = RunSync(e, *plan, InputBuffersFor(rp, *plan));
  ASSERT_TRUE(o.status.ok()) << o.status;
  ReferenceOutputs ref;
  LossProblem p = rp.problem();
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  LossOutputs got;
  got.grad_dtype = rp.spec().dtype;
  got.loss = &o.loss;
  got.tokens = &o.tokens;
  got.dx = o.outputs[0].get();
  got.dw = o.outputs[1].get();
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, got));
}

// Class weights of both signs are torch's too (its cross_entropy takes torch.randn(V) as
// weights): accepted, and mean divides by their sum over the non-ignored targets.
TEST(EngineTest, NegativeClassWeightsAreAcceptedWithTorchsMean) {
  Engine e(NewCpuBackend(2), EngineOptions{});
  RandomProblemSpec s;
  s.bt = 33;
  s.h = 17;
  s.v = 77;
  s.ignore_fraction = 0.2;
  s.class_weights = s.signed_class_weights = true;
  RandomProblem rp = RandomProblem::Make(s);
  int negative = 0;
  for (float w : rp.class_weights) negative += w < 0;
  ASSERT_GT(negative, 0);
  ComputeSpec spec = ComputeSpecFor(rp);
  TensorDesc& cw = spec.inputs[static_cast<int>(InputSlot::kClassWeights)];
  cw.present = true;
  cw.dtype = DType::kF32;
  cw.shape = {s.v};
  auto plan = e.Plan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto in = InputBuffersFor(rp, *plan);
  const int slot = static_cast<int>(InputSlot::kClassWeights);
  (*in)[slot] = NewHostBuffer(plan->input_bytes[slot]);
  std::memcpy((*in)[slot].get(), rp.class_weights.data(), plan->input_bytes[slot]);
  ComputeOutcome o = RunSync(e, *plan, in);
  ASSERT_TRUE(o.status.ok()) << o.status;
  ReferenceOutputs ref;
  LossProblem p = rp.problem();
  ASSERT_TRUE(ReferenceCompute(p, &ref).ok());
  LossOutputs got;
  got.grad_dtype = s.dtype;
  got.loss = &o.loss;
  got.tokens = &o.tokens;
  got.dx = o.outputs[0].get();
  got.dw = o.outputs[1].get();
  EXPECT_TRUE(MatchesReference(p, rp.stats(), ref, got));
}

TEST(EngineTest, EveryIgnoredTargetGivesZeroLossAndZeroGradients) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblem rp = ProblemOf(9, 5, 11, 1.0);
  auto plan = e.Plan(ComputeSpecFor(rp));
  ASSERT_TRUE(plan.ok());
  ComputeOutcome o = RunSync(e, *plan, InputBuffersFor(rp, *plan));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.loss, 0.0f);
  EXPECT_EQ(o.tokens, 0);
  for (int k = 0; k < 2; ++k) {
    const uint16_t* g = reinterpret_cast<const uint16_t*>(o.outputs[k].get());
    for (uint64_t i = 0; i < plan->outputs[k].bytes / 2; ++i) ASSERT_EQ(g[i] & 0x7fff, 0) << i;
  }
}

TEST(EngineTest, AnAccumulatorOfAFailedMicroBatchIsNeverServedAsWhole) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblem rp = ProblemOf(4, 3, 5);
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.accumulator = "acc";
  auto plan = e.Plan(spec);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(RunSync(e, *plan, InputBuffersFor(rp, *plan)).status.ok());
  // A micro-batch refused before it touches the accumulator leaves it whole.
  auto bad = InputBuffersFor(rp, *plan);
  reinterpret_cast<int64_t*>((*bad)[static_cast<int>(InputSlot::kTargets)].get())[0] = 99;
  ComputeOutcome o = RunSync(e, *plan, bad);
  EXPECT_EQ(o.status.code(), absl::StatusCode::kInvalidArgument);
  auto g = e.FetchGradients("acc", false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 1u);
}


TEST(EngineTest, ARequestWhoseDeadlinePassedInTheQueueIsNotStarted) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblem rp = ProblemOf(4, 3, 5);
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.accumulator = "late";
  auto plan = e.Plan(spec);
  ASSERT_TRUE(plan.ok());
  std::promise<ComputeOutcome> done;
  e.Run(std::make_shared<const ComputePlan>(*plan), InputBuffersFor(rp, *plan),
        [&](ComputeOutcome o) { done.set_value(std::move(o)); },
        absl::Now() - absl::Seconds(1));
  ComputeOutcome o = done.get_future().get();
  EXPECT_EQ(o.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(o.status.message().find("not started"), std::string::npos) << o.status;
  // Not started: the accumulator was never even created.
  EXPECT_EQ(e.FetchGradients("late", false).status().code(), absl::StatusCode::kNotFound);
}

// A call cancelled while its job waited in the queue is not started: nothing is added, and
// the accumulator is not even created. One that ran says which accumulator it added to.
TEST(EngineTest, ARequestCancelledInTheQueueIsNotStartedAndAddsNothing) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblem rp = ProblemOf(4, 3, 5);
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.accumulator = "gone";
  auto plan = e.Plan(spec);
  ASSERT_TRUE(plan.ok());
  for (bool cancelled : {true, false}) {
    std::promise<ComputeOutcome> done;
    e.Run(std::make_shared<const ComputePlan>(*plan), InputBuffersFor(rp, *plan),
          [&](ComputeOutcome o) { done.set_value(std::move(o)); }, absl::InfiniteFuture(),
          false, OverlapIo{}, [cancelled] { return cancelled; });
    ComputeOutcome o = done.get_future().get();
    if (cancelled) {
      EXPECT_EQ(o.status.code(), absl::StatusCode::kCancelled);
      EXPECT_NE(o.status.message().find("not started"), std::string::npos) << o.status;
      EXPECT_EQ(o.added_to, nullptr);
      EXPECT_EQ(e.FetchGradients("gone", false).status().code(), absl::StatusCode::kNotFound);
    } else {
      ASSERT_TRUE(o.status.ok()) << o.status;
      ASSERT_NE(o.added_to, nullptr);
      EXPECT_EQ(o.added_to->name, "gone");
      // A call that fails after this marks the sum partial, unless a reset fetch has taken
      // the sum with the micro-batch in it since.
      auto taken = e.FetchGradients("gone", true);
      ASSERT_TRUE(taken.ok());
      EXPECT_NE(Engine::MarkPartial(*o.added_to, o.added_resets).find("a reset fetch has taken"),
                std::string::npos);
      EXPECT_TRUE(e.FetchGradients("gone", false).ok()) << "the new sum was poisoned";
      // As for a micro-batch added after that reset:
      const std::string said = Engine::MarkPartial(*o.added_to, o.added_resets + 1);
      EXPECT_NE(said.find("already been added into accumulator 'gone'"), std::string::npos);
      auto g = e.FetchGradients("gone", false);
      EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
    }
  }
}

// A micro-batch whose dW overflows (grad_scale 3e38, reduction sum) is added and reported
// (stats.nonfinite); from then on the accumulator refuses Computes and fetches, naming that
// micro-batch, until a reset fetch (which returns nothing) or a drop; then it sums anew.
TEST(EngineTest, AnOverflowedAccumulatorRefusesUseUntilResetOrDropped) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblemSpec s;
  s.bt = 6;
  s.h = 4;
  s.v = 9;
  s.dtype = DType::kF32;
  s.options.reduction = Reduction::kSum;
  RandomProblem fine = RandomProblem::Make(s);
  s.options.grad_scale = 3e38f;
  RandomProblem huge = RandomProblem::Make(s);
  ComputeSpec spec = ComputeSpecFor(fine);
  spec.accumulator = "step";
  auto plan = e.Plan(spec);
  ASSERT_TRUE(plan.ok()) << plan.status();
  spec.options.grad_scale = 3e38f;
  auto huge_plan = e.Plan(spec);
  ASSERT_TRUE(huge_plan.ok()) << huge_plan.status();

  ComputeOutcome o = RunSync(e, *plan, InputBuffersFor(fine, *plan));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.stats.nonfinite, 0u);
  o = RunSync(e, *huge_plan, InputBuffersFor(huge, *huge_plan));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_NE(o.stats.nonfinite & kNonFiniteDw, 0u);
  EXPECT_EQ(o.accumulated_micro_batches, 2u);

  auto expect_refused = [](const absl::Status& st) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("accumulator 'step' holds a non-finite sum: micro-batch 2 (a "
                                "Compute at "),
              std::string::npos)
        << st;
    EXPECT_NE(st.message().find(") left NaN or Inf in dW"), std::string::npos) << st;
  };
  expect_refused(RunSync(e, *plan, InputBuffersFor(fine, *plan)).status);
  expect_refused(e.FetchGradients("step", false).status());
  expect_refused(e.FetchGradients("step", false, 0, 8).status());
  // The reset fetch skips the step: refused, but zeroed.
  absl::Status reset = e.FetchGradients("step", true).status();
  expect_refused(reset);
  EXPECT_NE(reset.message().find("this reset fetch returned nothing and zeroed it"),
            std::string::npos)
      << reset;
  o = RunSync(e, *plan, InputBuffersFor(fine, *plan));
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.accumulated_micro_batches, 1u);
  auto g = e.FetchGradients("step", false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->micro_batches, 1u);
  const float* dw = reinterpret_cast<const float*>(g->data.get());
  for (int64_t k = 0; k < s.v * s.h; ++k) ASSERT_TRUE(std::isfinite(dw[k])) << k;
  // Overflowed again, then dropped: the name begins a new sum.
  ASSERT_TRUE(RunSync(e, *huge_plan, InputBuffersFor(huge, *huge_plan)).status.ok());
  EXPECT_EQ(e.FetchGradients("step", false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(e.DropAccumulator("step").ok());
  ASSERT_TRUE(RunSync(e, *plan, InputBuffersFor(fine, *plan)).status.ok());
  EXPECT_TRUE(e.FetchGradients("step", false).ok());
}

// UndoReset puts a reset snapshot back while nothing has been added since, and marks the
// accumulator partial once something has (the two sums can no longer be told apart).
TEST(EngineTest, UndoResetRestoresTheSumOrMarksItPartial) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  RandomProblem rp = ProblemOf(4, 3, 5);
  ComputeSpec spec = ComputeSpecFor(rp);
  spec.accumulator = "undo";
  auto plan = e.Plan(spec);
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(RunSync(e, *plan, InputBuffersFor(rp, *plan)).status.ok());
  auto whole = e.FetchGradients("undo", false);
  ASSERT_TRUE(whole.ok());
  auto reset = e.FetchGradients("undo", true);
  ASSERT_TRUE(reset.ok());
  ASSERT_NE(reset->reset_of, nullptr);
  EXPECT_NE(e.UndoReset(*reset, reset->data.get()).find("its reset was undone"),
            std::string::npos);
  auto back = e.FetchGradients("undo", false);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->micro_batches, 1u);
  EXPECT_EQ(std::memcmp(back->data.get(), whole->data.get(), whole->end - whole->begin), 0);
  // Reset again, then a Compute adds before the undo comes: partial.
  reset = e.FetchGradients("undo", true);
  ASSERT_TRUE(reset.ok());
  ASSERT_TRUE(RunSync(e, *plan, InputBuffersFor(rp, *plan)).status.ok());
  EXPECT_NE(e.UndoReset(*reset, reset->data.get()).find("could not be undone"),
            std::string::npos);
  EXPECT_EQ(e.FetchGradients("undo", false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // A new accumulator of one micro-batch, reset by a fetch: the snapshot to undo.
  auto fresh_and_reset = [&] {
    EXPECT_TRUE(e.DropAccumulator("undo").ok());
    EXPECT_TRUE(RunSync(e, *plan, InputBuffersFor(rp, *plan)).status.ok());
    return e.FetchGradients("undo", true);
  };
  // A fetch that read the reset sum (zeros) before the undo: partial too, or that reader's
  // zeros and the sum put back would both stand.
  reset = fresh_and_reset();
  ASSERT_TRUE(reset.ok());
  ASSERT_TRUE(e.FetchGradients("undo", false).ok());
  EXPECT_NE(e.UndoReset(*reset, reset->data.get()).find("or a fetch has read it since"),
            std::string::npos);
  EXPECT_EQ(e.FetchGradients("undo", false).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Dropped since: nothing to put back, and the next sum of that name is not touched.
  reset = fresh_and_reset();
  ASSERT_TRUE(reset.ok());
  ASSERT_TRUE(e.DropAccumulator("undo").ok());
  ASSERT_TRUE(RunSync(e, *plan, InputBuffersFor(rp, *plan)).status.ok());
  EXPECT_NE(e.UndoReset(*reset, reset->data.get()).find("has been dropped since"),
            std::string::npos);
  auto fresh = e.FetchGradients("undo", false);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->micro_batches, 1u);
  // A fetch without reset has nothing to undo.
  ASSERT_TRUE(e.DropAccumulator("undo").ok());
  ASSERT_TRUE(RunSync(e, *plan, InputBuffersFor(rp, *plan)).status.ok());
  auto plain = e.FetchGradients("undo", false);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->reset_of, nullptr);
  EXPECT_EQ(e.UndoReset(*plain, plain->data.get()), "");
}

// The W of the striped-upload tests: fp32 (64, 32), 8 KiB.
TensorDesc StripedW() {
  TensorDesc w;
  w.present = true;
  w.dtype = DType::kF32;
  w.shape = {64, 32};
  return w;
}

// A stripe whose header arrives after its upload was aborted (a sibling failed) or completed
// is refused, and starts no fresh upload under the same id: nothing stays reserved.
TEST(EngineTest, AStripeOfAnEndedUploadIsRefusedAndReservesNothing) {
  EngineOptions o;
  o.weight_cache_bytes = 1 << 20;
  Engine e(NewCpuBackend(1), o);
  const TensorDesc w = StripedW(), bias;
  const uint64_t bytes = 64 * 32 * 4;
  auto first = e.JoinStripedUpload("client-a", "u1", 2, w, bias, 0, bytes / 2, false);
  ASSERT_TRUE(first.ok()) << first.status();
  e.FailStripedUpload("client-a", "u1",
                      absl::InvalidArgumentError("w contains a non-finite value"));
  auto late = e.JoinStripedUpload("client-a", "u1", 2, w, bias, bytes / 2, bytes, false);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted) << late.status();
  EXPECT_NE(late.status().message().find("already ended"), std::string::npos) << late.status();
  EXPECT_TRUE(e.weights().Reserve(e.weights().budget()).ok()) << "a reservation was left held";
  e.weights().Unreserve(e.weights().budget());
  // A new id works as before.
  auto fresh = e.JoinStripedUpload("client-a", "u2", 2, w, bias, 0, bytes / 2, false);
  EXPECT_TRUE(fresh.ok()) << fresh.status();
  e.FailStripedUpload("client-a", "u2", absl::CancelledError("test done"));
}

// An upload belongs to the client that began it: the same upload_id from another client is
// another upload, which can neither join this one's ranges nor abort it.
TEST(EngineTest, AnUploadIdIsTheClientsOwn) {
  EngineOptions o;
  o.weight_cache_bytes = 1 << 20;
  Engine e(NewCpuBackend(1), o);
  const TensorDesc w = StripedW(), bias;
  const uint64_t bytes = 64 * 32 * 4;
  auto mine = e.JoinStripedUpload("client-a", "u1", 2, w, bias, 0, bytes / 2, false);
  ASSERT_TRUE(mine.ok()) << mine.status();
  // Another client, the same id, the other half: a fresh upload of its own (its own first
  // stripe), not the second stripe of client-a's.
  auto theirs = e.JoinStripedUpload("client-b", "u1", 2, w, bias, bytes / 2, bytes, false);
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_NE(mine->get(), theirs->get());
  // Its failure aborts its own upload only.
  e.FailStripedUpload("client-b", "u1", absl::InvalidArgumentError("bad header"));
  auto second = e.JoinStripedUpload("client-a", "u1", 2, w, bias, bytes / 2, bytes, false);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(mine->get(), second->get());
  e.FailStripedUpload("client-a", "u1", absl::CancelledError("test done"));
}

}  // namespace
}  // namespace lossd
