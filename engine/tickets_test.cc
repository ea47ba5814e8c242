// SPDX-License-Identifier: Apache-2.0
// The two-phase log-prob through the engine on the CPU backend: a forward with keep_ms keeps a
// ticket, its backward (dlogp, dentropy only) gives the bits of a one-phase call; the TTL on
// an injected clock, the budget and count, consumption, a retry after a failed backward, the
// refused fields (overlap among them, refused by the plan), a head that moved on, a weight
// handle dropped under a ticket, another instance's and another owner's tickets, and List.
#include <atomic>
#include <cstring>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "engine/engine.h"
#include "engine/streamed_rows.h"
#include "engine/tickets.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "testing/engine_calls.h"
#include "testing/test_util.h"

namespace lossd {
namespace {

constexpr int64_t kBt = 7, kH = 5, kV = 11;
constexpr char kInstance[] = "0123abcd";
constexpr int64_t kMs = 1000000;  // ns

void ExpectStatus(const absl::Status& s, absl::StatusCode code, const std::string& part) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_NE(s.message().find(part), std::string::npos) << s;
}

class TicketsTest : public ::testing::Test {
 protected:
  explicit TicketsTest(EngineOptions o = {})
      : e_(NewCpuBackend(2), Options(std::move(o), &now_ns_)),
        rp_(RandomProblem::Make([] {
          RandomProblemSpec s = ShapeSpec(kBt, kH, kV);
          s.bias = true;
          s.options.ignore_index = 3;
          s.ignore_fraction = 0.25;
          s.seed = 5;
          return s;
        }())),
        dlogp_(RandomRows(kBt, 21)),
        dentropy_(RandomRows(kBt, 22)) {}

  static EngineOptions Options(EngineOptions o, std::atomic<int64_t>* now) {
    o.instance = kInstance;
    o.ticket_clock_ns = [now] { return now->load(); };
    return o;
  }

  // A logprob call over rp_ at temperature 0.7 and softcap 3 with entropy; W inline (and the
  // bias) unless `handle`.
  ComputeSpec Spec(const std::string& handle = "") const {
    ComputeSpec s;
    s.kind = LossKind::kLogprob;
    SetInput(&s, InputSlot::kX, InputDesc(DType::kBF16, {kBt, kH}));
    SetInput(&s, InputSlot::kTargets, InputDesc(DType::kI64, {kBt}));
    if (handle.empty()) {
      SetInput(&s, InputSlot::kW, InputDesc(DType::kBF16, {kV, kH}));
      SetInput(&s, InputSlot::kBias, InputDesc(DType::kBF16, {kV}));
    } else {
      s.weight_handle = handle;
    }
    s.options.ignore_index = 3;
    s.options.temperature = 0.7f;
    s.options.softcap = 3.0f;
    s.wanted.entropy = true;
    return s;
  }
  ComputeSpec Forward(const std::string& handle = "", uint32_t keep_ms = 60000) const {
    ComputeSpec s = Spec(handle);
    s.keep_ms = keep_ms;
    return s;
  }
  // One phase: the same with the upstream gradients and every gradient asked.
  ComputeSpec OnePhase(const std::string& handle = "") const {
    ComputeSpec s = Spec(handle);
    SetInput(&s, InputSlot::kDlogp, InputDesc(DType::kF32, {kBt}));
    SetInput(&s, InputSlot::kDentropy, InputDesc(DType::kF32, {kBt}));
    s.wanted.dx = s.wanted.dw = s.wanted.db = true;
    s.options.grad_scale = 0.5f;
    return s;
  }
  static ComputeSpec Backward(const std::string& ticket) {
    ComputeSpec s;
    s.kind = LossKind::kLogprob;
    s.ticket = ticket;
    SetInput(&s, InputSlot::kDlogp, InputDesc(DType::kF32, {kBt}));
    SetInput(&s, InputSlot::kDentropy, InputDesc(DType::kF32, {kBt}));
    s.wanted.dx = s.wanted.dw = s.wanted.db = s.wanted.entropy = true;
    s.options.grad_scale = 0.5f;
    return s;
  }
  std::shared_ptr<Engine::InputBuffers> Inputs(const ComputePlan& plan) const {
    InputSources src = InputSourcesOf(rp_.problem());
    src[static_cast<int>(InputSlot::kDlogp)] = dlogp_.data();
    src[static_cast<int>(InputSlot::kDentropy)] = dentropy_.data();
    return InputBuffersFrom(plan, src);
  }

  ComputeOutcome Go(const ComputeSpec& spec) {
    return PlanAndRun(e_, spec, [this](const ComputePlan& plan) { return Inputs(plan); });
  }

  // A forward that must keep; returns its ticket.
  std::string Keep(const std::string& handle = "", uint32_t keep_ms = 60000) {
    ComputeOutcome f = Go(Forward(handle, keep_ms));
    EXPECT_TRUE(f.status.ok()) << f.status;
    EXPECT_FALSE(f.ticket.empty());
    return f.ticket;
  }

  std::string Upload() {
    auto h = UploadWeights(e_, DType::kBF16, kV, kH, rp_.w, rp_.bias);
    EXPECT_TRUE(h.ok()) << h.status();
    return h.ok() ? *h : "";
  }

  // Every output and the loss, bit for bit.
  static void ExpectSameBits(const ComputeOutcome& a, const ComputeOutcome& b,
                             const ComputePlan& plan) {
    ASSERT_TRUE(a.status.ok()) << a.status;
    ASSERT_TRUE(b.status.ok()) << b.status;
    EXPECT_EQ(std::memcmp(&a.loss, &b.loss, sizeof(float)), 0) << a.loss << " vs " << b.loss;
    EXPECT_EQ(a.tokens, b.tokens);
    ASSERT_EQ(a.outputs.size(), plan.outputs.size());
    ASSERT_EQ(b.outputs.size(), plan.outputs.size());
    for (size_t i = 0; i < plan.outputs.size(); ++i) {
      EXPECT_EQ(std::memcmp(a.outputs[i].get(), b.outputs[i].get(), plan.outputs[i].bytes), 0)
          << OutputSlotName(plan.outputs[i].slot);
    }
  }

  // The backward of `ticket` against the one-phase call (handle or inline), bit for bit.
  void ExpectBackwardIsOnePhase(const std::string& ticket, const std::string& handle = "") {
    auto back = e_.Plan(Backward(ticket));
    ASSERT_TRUE(back.ok()) << back.status();
    auto one = e_.Plan(OnePhase(handle));
    ASSERT_TRUE(one.ok()) << one.status();
    ASSERT_EQ(back->outputs.size(), one->outputs.size());
    for (size_t i = 0; i < one->outputs.size(); ++i) {
      EXPECT_EQ(back->outputs[i].slot, one->outputs[i].slot);
    }
    const ComputeOutcome b = RunSync(e_, *back, Inputs(*back));
    const ComputeOutcome o = RunSync(e_, *one, Inputs(*one));
    ExpectSameBits(b, o, *one);
    EXPECT_NE(b.loss, 0.0f);  // the upstream gradients are random: F is not 0
  }

  std::atomic<int64_t> now_ns_{1000 * kMs};
  Engine e_;
  RandomProblem rp_;
  std::vector<float> dlogp_, dentropy_;
};

TEST_F(TicketsTest, ForwardKeepsAndItsBackwardIsBitIdenticalToOnePhase) {
  // The forward: logp and entropy as a forward-only call, a ticket and its expiry.
  auto fwd = e_.Plan(Forward());
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  EXPECT_EQ(fwd->ticket_bytes, TicketBytes(kBt, kH, kV, DType::kBF16, DType::kI64, true, true));
  const ComputeOutcome f = RunSync(e_, *fwd, Inputs(*fwd));
  ASSERT_TRUE(f.status.ok()) << f.status;
  EXPECT_EQ(f.ticket, absl::StrCat("t-", kInstance, "-1"));
  EXPECT_EQ(f.ticket_expires_unix_ms, 1000 + 60000);
  auto plain = e_.Plan(Spec());
  ASSERT_TRUE(plain.ok());
  ExpectSameBits(f, RunSync(e_, *plain, Inputs(*plain)), *plain);
  EXPECT_EQ(e_.tickets().count(), 1u);
  EXPECT_EQ(e_.tickets().bytes(), fwd->ticket_bytes);
  // The backward sends only the upstream gradients.
  auto back = e_.Plan(Backward(f.ticket));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->input_bytes[static_cast<int>(InputSlot::kX)], 0u);
  EXPECT_EQ(back->input_bytes[static_cast<int>(InputSlot::kW)], 0u);
  EXPECT_EQ(back->input_bytes[static_cast<int>(InputSlot::kTargets)], 0u);
  EXPECT_EQ(back->input_bytes[static_cast<int>(InputSlot::kDlogp)], kBt * 4u);
  ExpectBackwardIsOnePhase(f.ticket);
  EXPECT_EQ(e_.tickets().count(), 0u);
  EXPECT_EQ(e_.tickets().bytes(), 0u);
}

TEST_F(TicketsTest, AHandlesTicketSharesItsWeightAndSurvivesItsDrop) {
  const std::string handle = Upload();
  const uint64_t w_bytes = e_.weights().bytes();
  const std::string t = Keep(handle);
  // The weight is shared, not copied: the ticket holds X and the targets only.
  EXPECT_EQ(e_.tickets().bytes(),
            TicketBytes(kBt, kH, kV, DType::kBF16, DType::kI64, false, true));
  // Dropped while the ticket holds it: the name is gone at once, the weight stays (charged to
  // the weight cache, as under a running call) until the backward consumes the ticket.
  ASSERT_TRUE(e_.DropWeights(handle).ok());
  EXPECT_EQ(e_.weights().count(), 0u);
  EXPECT_EQ(e_.weights().bytes(), w_bytes);
  ExpectStatus(e_.Plan(OnePhase(handle)).status(), absl::StatusCode::kNotFound, handle);
  // The oracle: the same weight by a fresh handle.
  ExpectBackwardIsOnePhase(t, Upload());
  DrainExecutor(e_);
  EXPECT_EQ(e_.weights().bytes(), w_bytes);  // the fresh handle's alone
}

TEST_F(TicketsTest, TheTtlIsKeepMsCutToTheMaximumOnTheInjectedClock) {
  const std::string t = Keep("", 500);
  now_ns_ += 499 * kMs;
  ASSERT_TRUE(e_.Plan(Backward(t)).ok());
  now_ns_ += 1 * kMs;
  ExpectStatus(e_.Plan(Backward(t)).status(), absl::StatusCode::kNotFound,
               "expired (its keep_ms passed); resend X as a one-phase logprob call");
  EXPECT_EQ(e_.tickets().expired(), 1u);
  EXPECT_EQ(e_.tickets().count(), 0u);
  // keep_ms past --ticket_max_ms (10 min by default) is cut to it.
  const ComputeOutcome f = Go(Forward("", 4000000000u));
  ASSERT_TRUE(f.status.ok()) << f.status;
  EXPECT_EQ(f.ticket_expires_unix_ms, now_ns_.load() / kMs + 600000);
  now_ns_ += 600000 * kMs;
  EXPECT_EQ(e_.tickets().count(), 0u);  // freed by the sweep of any access
  EXPECT_EQ(e_.tickets().expired(), 2u);
}

TEST_F(TicketsTest, ABackwardConsumesAndAFailedOneLeavesTheTicket) {
  const std::string t = Keep();
  // NaN in dlogp fails the backward at its run (the finiteness check): the ticket stays.
  auto plan = e_.Plan(Backward(t));
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto in = Inputs(*plan);
  reinterpret_cast<float*>((*in)[static_cast<int>(InputSlot::kDlogp)].get())[2] = NAN;
  ExpectStatus(RunSync(e_, *plan, in).status, absl::StatusCode::kInvalidArgument, "dlogp");
  EXPECT_EQ(e_.tickets().count(), 1u);
  // The retry works and consumes it; a second backward finds it consumed.
  ExpectBackwardIsOnePhase(t);
  ExpectStatus(e_.Plan(Backward(t)).status(), absl::StatusCode::kNotFound,
               "was consumed by its backward; resend X");
  // A plan made before the consumption does not run a second time.
  const std::string t2 = Keep();
  auto p1 = e_.Plan(Backward(t2));
  auto p2 = e_.Plan(Backward(t2));
  ASSERT_TRUE(p1.ok() && p2.ok());
  ASSERT_TRUE(RunSync(e_, *p1, Inputs(*p1)).status.ok());
  ExpectStatus(RunSync(e_, *p2, Inputs(*p2)).status, absl::StatusCode::kNotFound, "consumed");
}

TEST_F(TicketsTest, UnknownOtherInstancesAndOtherOwnersTickets) {
  ExpectStatus(e_.Plan(Backward(absl::StrCat("t-", kInstance, "-99"))).status(),
               absl::StatusCode::kNotFound, "is not held here");
  ExpectStatus(e_.Plan(Backward("t-deadbeef-1")).status(),
               absl::StatusCode::kFailedPrecondition,
               "was issued by server instance 'deadbeef', not this one ('0123abcd')");
  ComputeSpec mine = Forward();
  mine.owner = "alice";
  const ComputeOutcome f = Go(mine);
  ASSERT_TRUE(f.status.ok()) << f.status;
  ComputeSpec theirs = Backward(f.ticket);
  theirs.owner = "bob";
  ExpectStatus(e_.Plan(theirs).status(), absl::StatusCode::kPermissionDenied,
               "belongs to another credential");
  EXPECT_TRUE(e_.ListState("bob").empty());
  const std::vector<StateInfo> listed = e_.ListState("alice");
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].kind, StateInfo::Kind::kTicket);
  EXPECT_EQ(listed[0].name, f.ticket);
  EXPECT_EQ(listed[0].bytes, e_.tickets().bytes());
  EXPECT_EQ(listed[0].last_used_ns, now_ns_.load());
}

TEST_F(TicketsTest, ABackwardSendsOnlyTheUpstreamGradients) {
  const std::string t = Keep();
  auto refused = [&](auto edit, absl::StatusCode code, const std::string& part) {
    ComputeSpec s = Backward(t);
    edit(&s);
    ExpectStatus(e_.Plan(s).status(), code, part);
  };
  const auto kBad = absl::StatusCode::kInvalidArgument;
  refused([](ComputeSpec* s) { SetInput(s, InputSlot::kX, InputDesc(DType::kBF16, {kBt, kH})); },
          kBad, "header.x is sent with header.ticket");
  refused([](ComputeSpec* s) { SetInput(s, InputSlot::kW, InputDesc(DType::kBF16, {kV, kH})); },
          kBad, "header.w is sent with header.ticket");
  refused([](ComputeSpec* s) { SetInput(s, InputSlot::kTargets, InputDesc(DType::kI64, {kBt})); },
          kBad, "header.targets is sent");
  refused([](ComputeSpec* s) { SetInput(s, InputSlot::kBias, InputDesc(DType::kBF16, {kV})); },
          kBad, "header.bias is sent");
  refused([](ComputeSpec* s) { s->weight_handle = "w-0123abcd-1"; }, kBad,
          "header.weight_handle is sent");
  refused([](ComputeSpec* s) { s->keep_ms = 5; }, kBad, "header.keep_ms 5 and header.ticket");
  refused([](ComputeSpec* s) { s->kind = LossKind::kCrossEntropy; }, kBad,
          "this request's kind is cross_entropy");
  refused([](ComputeSpec* s) {
    SetInput(s, InputSlot::kDlogp, {});
    SetInput(s, InputSlot::kDentropy, {});
  }, kBad, "without header.dlogp or header.dentropy");
  refused([](ComputeSpec* s) {
    s->temperature_set = true;
    s->options.temperature = 0.5f;
  }, kBad, "header.options.temperature 0.5 differs from the forward's 0.7");
  refused([](ComputeSpec* s) { s->options.softcap = 2.0f; }, kBad,
          "header.options.softcap 2 differs from the forward's 3");
  refused([](ComputeSpec* s) {
    s->ignore_index_set = true;
    s->options.ignore_index = -100;
  }, kBad, "header.options.ignore_index -100 differs from the forward's 3");
  refused([](ComputeSpec* s) { s->options.chunk_rows = 2; }, kBad,
          "header.options.chunk_rows 2 differs from the forward's 0");
  refused([](ComputeSpec* s) { s->options.label_smoothing = 0.1f; }, kBad, "label_smoothing");
  refused([](ComputeSpec* s) { s->rank = 1; }, kBad, "belong to a Compute that names a head");
  // The forward's own values may be repeated; every refusal above left the ticket.
  ComputeSpec same = Backward(t);
  same.temperature_set = same.ignore_index_set = true;
  same.options.temperature = 0.7f;
  same.options.softcap = 3.0f;
  same.options.ignore_index = 3;
  EXPECT_TRUE(e_.Plan(same).ok());
  ExpectBackwardIsOnePhase(t);
}

TEST_F(TicketsTest, AForwardThatKeepsAsksForNoGradient) {
  auto refused = [&](auto edit, const std::string& part) {
    ComputeSpec s = Forward();
    edit(&s);
    ExpectStatus(e_.Plan(s).status(), absl::StatusCode::kInvalidArgument, part);
  };
  refused([](ComputeSpec* s) { SetInput(s, InputSlot::kDlogp, InputDesc(DType::kF32, {kBt})); },
          "header.dlogp is sent with header.keep_ms");
  refused([](ComputeSpec* s) { s->wanted.dx = true; }, "header.outputs.dx is asked with");
  refused([](ComputeSpec* s) { s->wanted.dw = true; }, "header.outputs.dw is asked with");
  refused([](ComputeSpec* s) { s->accumulator = "acc"; }, "header.accumulator 'acc' is named");
  refused([](ComputeSpec* s) { s->kind = LossKind::kCrossEntropy; },
          "this request's kind is cross_entropy");
  EXPECT_EQ(e_.tickets().count(), 0u);
}

TEST_F(TicketsTest, AHeadsTicketAddsToTheForwardsStepAndRefusesOnceTheHeadMovedOn) {
  HeadSpec hs;
  hs.name = "h";
  hs.v = kV;
  hs.h = kH;
  hs.master_dtype = DType::kBF16;
  const absl::Status created = CreateHead(e_, hs, rp_.w);
  ASSERT_TRUE(created.ok()) << created;
  auto on_head = [&](uint64_t version) {
    ComputeSpec s = Forward();
    SetInput(&s, InputSlot::kW, {});
    SetInput(&s, InputSlot::kBias, {});
    s.head = "h";
    s.head_version = version;
    return Go(s);
  };
  const ComputeOutcome f = on_head(0);
  ASSERT_TRUE(f.status.ok()) << f.status;
  EXPECT_EQ(f.head_version, 0u);
  EXPECT_FALSE(f.head_added);
  // The forward added nothing to the step; the backward adds, under its (rank, micro_batch).
  EXPECT_EQ(e_.heads().Info("h", "")->contributions, 0u);
  ComputeSpec b = Backward(f.ticket);
  b.wanted.dw = b.wanted.db = false;
  b.rank = 1;
  b.micro_batch = 7;
  b.accumulator = "acc";
  ExpectStatus(e_.Plan(b).status(), absl::StatusCode::kInvalidArgument,
               "was taken against head 'h', whose step is the accumulator");
  b.accumulator.clear();
  b.head_version = 3;
  ExpectStatus(e_.Plan(b).status(), absl::StatusCode::kInvalidArgument,
               "header.head_version 3 differs from the version 0");
  b.head_version = 0;
  const ComputeOutcome back = Go(b);
  ASSERT_TRUE(back.status.ok()) << back.status;
  EXPECT_TRUE(back.head_added);
  EXPECT_EQ(e_.heads().Info("h", "")->contributions, 1u);
  // A second forward at version 0; the head steps to 1; its backward is refused by name.
  const ComputeOutcome g = on_head(0);
  ASSERT_TRUE(g.status.ok()) << g.status;
  std::promise<absl::StatusOr<StepResult>> stepped;
  e_.heads().Step(StepCall{"h", 0, 0, 1}, "",
                  [&](absl::StatusOr<StepResult> r) { stepped.set_value(std::move(r)); });
  ASSERT_TRUE(stepped.get_future().get().ok());
  ComputeSpec late = Backward(g.ticket);
  late.wanted.dw = late.wanted.db = false;
  ExpectStatus(e_.Plan(late).status(), absl::StatusCode::kFailedPrecondition,
               absl::StrCat("ticket '", g.ticket, "' was computed against head 'h' at version "
                            "0, and the head is at version 1 now"));
  // A ticket does not keep its head alive: dropped, the head is gone, its backward NOT_FOUND.
  const ComputeOutcome k = on_head(1);
  ASSERT_TRUE(k.status.ok()) << k.status;
  const uint64_t head_bytes = e_.heads().bytes();
  ASSERT_GT(head_bytes, 0u);
  ASSERT_TRUE(e_.heads().Drop("h", "").ok());
  DrainExecutor(e_);
  EXPECT_EQ(e_.heads().bytes(), 0u);
  ComputeSpec orphan = Backward(k.ticket);
  orphan.wanted.dw = orphan.wanted.db = false;
  ExpectStatus(e_.Plan(orphan).status(), absl::StatusCode::kNotFound,
               absl::StrCat("head 'h' of ticket '", k.ticket, "' was dropped; resend X"));
}

// Overlap with either phase is the plan's refusal, naming the field: nothing is reserved,
// claimed or computed, and the ticket a refused backward named still serves. Run's own check
// is an internal invariant, for a plan made without ComputeSpec::overlap and run overlapped.
TEST_F(TicketsTest, OverlapWithEitherPhaseIsRefusedByThePlan) {
  ComputeSpec fwd = Forward();
  fwd.overlap = true;
  ExpectStatus(e_.Plan(fwd).status(), absl::StatusCode::kInvalidArgument,
               "header.overlap with header.keep_ms: a two-phase log-prob call is not "
               "overlapped; send it without overlap");
  EXPECT_EQ(e_.tickets().count(), 0u);
  EXPECT_EQ(e_.tickets().bytes(), 0u);
  ComputeSpec plain = Spec();  // overlap alone is not the refusal
  plain.overlap = true;
  EXPECT_TRUE(e_.Plan(plain).ok());

  const std::string t = Keep();
  const uint64_t held = e_.tickets().bytes();
  ComputeSpec back = Backward(t);
  back.overlap = true;
  ExpectStatus(e_.Plan(back).status(), absl::StatusCode::kInvalidArgument,
               "header.overlap with header.ticket: a two-phase log-prob call is not overlapped");
  EXPECT_EQ(e_.tickets().count(), 1u);
  EXPECT_EQ(e_.tickets().bytes(), held);

  // Plans made without overlap, run overlapped: INTERNAL before any work, nothing kept or
  // consumed.
  auto run_overlapped = [&](const ComputeSpec& spec) {
    auto plan = e_.Plan(spec);
    EXPECT_TRUE(plan.ok()) << plan.status();
    if (!plan.ok()) return plan.status();
    auto shared = std::make_shared<const ComputePlan>(*plan);
    OverlapIo io{std::make_shared<StreamedRows>(plan->bt, absl::Seconds(60),
                                                absl::InfiniteFuture(), nullptr),
                 std::make_shared<std::vector<HostBuffer>>(Engine::NewOutputs(*plan))};
    absl::Notification done;
    absl::Status status;
    e_.Run(shared, Inputs(*plan), [&](ComputeOutcome o) {
      status = o.status;
      done.Notify();
    }, absl::InfiniteFuture(), /*inputs_checked_finite=*/true, io);
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(120)));
    return status;
  };
  ExpectStatus(run_overlapped(Forward()), absl::StatusCode::kInternal,
               "an overlapped run of a two-phase log-prob plan (keep_ms or ticket)");
  ExpectStatus(run_overlapped(Backward(t)), absl::StatusCode::kInternal,
               "the plan was made without ComputeSpec::overlap");
  EXPECT_EQ(e_.tickets().count(), 1u);
  EXPECT_EQ(e_.tickets().bytes(), held);
  ExpectBackwardIsOnePhase(t);
}

class TicketBudgetTest : public TicketsTest {
 protected:
  static EngineOptions Small() {
    EngineOptions o;
    // Room for two inline tickets by bytes, and a count of two.
    o.ticket_bytes = 2 * TicketBytes(kBt, kH, kV, DType::kBF16, DType::kI64, true, true);
    o.max_tickets = 2;
    return o;
  }
  TicketBudgetTest() : TicketsTest(Small()) {}
};

TEST_F(TicketBudgetTest, AFullStoreRefusesNamingTheNumbersAndFreesOnConsume) {
  const std::string a = Keep();
  const std::string b = Keep();
  const uint64_t one = TicketBytes(kBt, kH, kV, DType::kBF16, DType::kI64, true, true);
  const ComputeOutcome full = Go(Forward());
  ExpectStatus(full.status, absl::StatusCode::kResourceExhausted,
               absl::StrCat("the ticket store is full: 2 tickets hold ", 2 * one,
                            " bytes, and this forward's ticket needs ", one, " more "
                            "(--ticket_bytes=", 2 * one, ", --max_tickets=2)"));
  EXPECT_EQ(e_.tickets().count(), 2u);
  ExpectBackwardIsOnePhase(a);
  EXPECT_FALSE(Keep().empty());
  // A ticket that can never fit is refused by the plan, before any tensor arrives.
  ComputeSpec wide = Forward();
  SetInput(&wide, InputSlot::kX, InputDesc(DType::kBF16, {kBt * 40, kH}));
  SetInput(&wide, InputSlot::kTargets, InputDesc(DType::kI64, {kBt * 40}));
  ExpectStatus(e_.Plan(wide).status(), absl::StatusCode::kResourceExhausted,
               "(--ticket_bytes, --max_tickets): send it as a one-phase call");
  ExpectBackwardIsOnePhase(b);
}

TEST(TicketsOffTest, MaxTicketsZeroRefusesEveryForwardThatKeeps) {
  EngineOptions o;
  o.max_tickets = 0;
  Engine e(NewCpuBackend(1), o);
  RandomProblem rp = RandomProblem::Make(ShapeSpec(kBt, kH, kV));
  ComputeSpec s = ComputeSpecFor(rp);
  s.kind = LossKind::kLogprob;
  s.wanted = {};
  s.keep_ms = 10;
  ExpectStatus(e.Plan(s).status(), absl::StatusCode::kResourceExhausted, "in 0 tickets");
}

}  // namespace
}  // namespace lossd
