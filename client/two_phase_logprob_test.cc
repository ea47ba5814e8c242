// SPDX-License-Identifier: Apache-2.0
// Tests TwoPhaseLogprob against a real server (engine + CPU backend + gRPC in the test
// process): the two-phase path gives the one-phase call's outputs byte for byte; a ticket
// consumed, expired or issued by a restarted server falls back to the one-phase call, which
// gives them too (from copied inputs where the caller's buffers changed); a server keeping no
// tickets (--max_tickets=0) falls back at the forward, and pauses asking; a backward into an
// accumulator that ended unsure is never sent twice; the counts, the last fallback and the
// log line are right; and what the helper refuses on its face.
#include "client/two_phase_logprob.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
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

constexpr int64_t kBT = 13, kH = 10, kV = 29;  // nothing a multiple of 8
constexpr float kTemperature = 0.7f;

HostTensor RandomTargets(uint32_t seed) {
  HostTensor t = HostTensor::Owned(DType::kI64, {kBT});
  std::mt19937 gen(seed);
  for (int64_t i = 0; i < kBT; ++i) t.mutable_data_as<int64_t>()[i] = gen() % kV;
  t.mutable_data_as<int64_t>()[3] = -100;  // one row ignored
  return t;
}

// "" when equal byte for byte; else what differs.
std::string Mismatch(const HostTensor* got, const HostTensor* want) {
  if (got == nullptr || want == nullptr) return got == want ? "" : "one of them is missing";
  if (got->shape() != want->shape() || got->dtype() != want->dtype()) {
    return absl::StrCat(got->DebugString(), " vs ", want->DebugString());
  }
  return std::memcmp(got->data(), want->data(), want->num_bytes()) == 0 ? "" : "bytes differ";
}

// One micro-batch's tensors, owned by the test (the call's tensors view them).
struct Batch {
  HostTensor x, w, bias, targets, dlogp, dentropy;
  explicit Batch(uint32_t seed)
      : x(UniformTensor(DType::kBF16, {kBT, kH}, seed, 2.0f)),
        w(UniformTensor(DType::kBF16, {kV, kH}, seed + 1, 0.8f)),
        bias(UniformTensor(DType::kBF16, {kV}, seed + 2, 0.5f)),
        targets(RandomTargets(seed + 3)),
        dlogp(UniformTensor(DType::kF32, {kBT}, seed + 4, 1.0f)),
        dentropy(UniformTensor(DType::kF32, {kBT}, seed + 5, 1.0f)) {}

  static HostTensor View(const HostTensor& t) {
    return HostTensor::View(t.dtype(), t.shape(), t.data());
  }
  // The one-phase call less its upstream gradients, W inline (or by `handle`).
  ComputeRequest Call(const std::string& handle = "") const {
    ComputeRequest r;
    r.kind = LossKind::kLogprob;
    r.x = View(x);
    if (handle.empty()) {
      r.w = View(w);
      r.bias = View(bias);
    } else {
      r.weight_handle = handle;
    }
    r.targets = View(targets);
    r.options.temperature = kTemperature;
    r.options.softcap = 6.0f;
    r.options.grad_scale = 0.5f;
    r.want.entropy = true;
    r.want.dx = r.want.dw = true;
    r.want.db = handle.empty();
    return r;
  }
  LogprobGradients Gradients() const { return {View(dlogp), View(dentropy)}; }
};

class TwoPhaseLogprobTest : public ::testing::Test {
 protected:
  void SetUp() override { StartServer("", 256); }

  // A server (instance "" = the harness's own) on the port of the last one, if any; the one
  // client connects to it.
  void StartServer(const std::string& instance, size_t max_tickets) {
    testing_harness::HarnessOptions o;
    o.engine.instance = instance;
    o.engine.max_tickets = max_tickets;
    o.engine.ticket_clock_ns = [this] { return absl::GetCurrentTimeNanos() + skew_ns_.load(); };
    o.port = port_;
    server_.reset();
    server_ = std::make_unique<testing_harness::Harness>(o);
    ASSERT_TRUE(server_->started());
    port_ = server_->port();
    if (client_ != nullptr) {  // helpers hold it: it reconnects to the new server
      ASSERT_TRUE(client_->Connect(absl::Seconds(60)).ok());
      return;
    }
    ClientOptions co;
    co.target = absl::StrCat("127.0.0.1:", port_);
    co.deadline = absl::Seconds(120);  // generous: a loaded 2-core machine
    co.part_bytes = 100;               // every tensor travels in several parts
    absl::StatusOr<std::unique_ptr<LossClient>> c = LossClient::Create(co);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }

  TwoPhaseOptions Options(KeepInputs keep = KeepInputs::kCallerMemory) {
    TwoPhaseOptions o;
    o.keep_inputs = keep;
    o.log = [this](const std::string& line) {
      absl::MutexLock lock(&mu_);
      log_.push_back(line);
    };
    o.now = [this] {  // stands still but for helper_skew_: the pause never ends by itself
      absl::MutexLock lock(&mu_);
      return helper_epoch_ + helper_skew_;
    };
    return o;
  }
  std::vector<std::string> Log() {
    absl::MutexLock lock(&mu_);
    return log_;
  }

  // The one-phase call of `b`, sent directly.
  ComputeResult OnePhase(const Batch& b, const std::string& handle = "") {
    ComputeRequest r = b.Call(handle);
    r.dlogp = b.View(b.dlogp);
    r.dentropy = b.View(b.dentropy);
    absl::StatusOr<ComputeResult> res = client_->Compute(r);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *std::move(res) : ComputeResult{};
  }

  // `got` holds exactly what the one-phase call `want` returned, byte for byte.
  static void ExpectSame(const ComputeResult& got, const ComputeResult& want) {
    EXPECT_EQ(got.loss, want.loss);
    EXPECT_EQ(got.tokens, want.tokens);
    ASSERT_EQ(got.outputs.size(), want.outputs.size());
    for (const auto& [t, tensor] : want.outputs) {
      EXPECT_EQ(Mismatch(got.Find(t), &tensor), "") << OutputTensorName(t);
    }
  }

  // Computes the server refused with RESOURCE_EXHAUSTED.
  double Refusals() {
    return testing_harness::MetricValue(server_->ScrapeMetrics(), "lossd_requests_total",
                                        R"(code="RESOURCE_EXHAUSTED",method="Compute")");
  }

  static void ExpectCounts(const TwoPhaseLogprob& lp, TwoPhaseCounts want) {
    const TwoPhaseCounts c = lp.counts();
    EXPECT_EQ(c.tickets, want.tickets);
    EXPECT_EQ(c.not_kept, want.not_kept);
    EXPECT_EQ(c.two_phase, want.two_phase);
    EXPECT_EQ(c.gone, want.gone);
    EXPECT_EQ(c.one_phase, want.one_phase);
  }

  // Consumes `ticket` by a backward sent directly, as one whose reply was lost would have.
  void Consume(const std::string& ticket, const Batch& b, const std::string& accumulator = "") {
    ComputeRequest r;
    r.kind = LossKind::kLogprob;
    r.ticket = ticket;
    r.dlogp = b.View(b.dlogp);
    r.accumulator = accumulator;
    absl::StatusOr<ComputeResult> res = client_->Compute(r);
    ASSERT_TRUE(res.ok()) << res.status();
  }

  int port_ = 0;
  std::atomic<int64_t> skew_ns_{0};  // the server's ticket clock, moved on by the test
  std::unique_ptr<testing_harness::Harness> server_;
  std::unique_ptr<LossClient> client_;
  absl::Mutex mu_;
  std::vector<std::string> log_;
  const absl::Time helper_epoch_ = absl::Now();
  absl::Duration helper_skew_ = absl::ZeroDuration();
};

TEST_F(TwoPhaseLogprobTest, TwoPhaseGivesTheOnePhaseCallByteForByte) {
  TwoPhaseLogprob lp(client_.get(), Options());
  const Batch b(10);
  absl::StatusOr<LogprobForward> f = lp.Forward(b.Call());
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_FALSE(f->ticket().empty());
  EXPECT_EQ(f->result().ticket, f->ticket());
  EXPECT_EQ(f->result().Find(OutputTensor::kDx), nullptr);  // the forward asks for no gradient
  EXPECT_EQ(server_->engine().tickets().count(), 1u);

  absl::StatusOr<ComputeResult> g = lp.Backward(*f, b.Gradients());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(server_->engine().tickets().count(), 0u);  // consumed
  EXPECT_TRUE(f->ticket().empty());

  const ComputeResult one = OnePhase(b);
  for (OutputTensor t : {OutputTensor::kLogp, OutputTensor::kEntropy, OutputTensor::kDx,
                         OutputTensor::kDw, OutputTensor::kDb}) {
    ASSERT_NE(one.Find(t), nullptr) << OutputTensorName(t);
  }
  ExpectSame(*g, one);
  for (OutputTensor t : {OutputTensor::kLogp, OutputTensor::kEntropy}) {
    EXPECT_EQ(Mismatch(f->result().Find(t), one.Find(t)), "") << OutputTensorName(t);
  }
  ExpectCounts(lp, {.tickets = 1, .two_phase = 1});
  EXPECT_TRUE(lp.last_fallback().ok()) << lp.last_fallback();
  EXPECT_TRUE(Log().empty());

  // A second backward of the same forward: its ticket served one, so X is sent again.
  absl::StatusOr<ComputeResult> again = lp.Backward(*f, b.Gradients());
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectSame(*again, one);
  ExpectCounts(lp, {.tickets = 1, .two_phase = 1, .one_phase = 1});
}

TEST_F(TwoPhaseLogprobTest, ConsumedTicketFallsBackToTheOnePhaseCallLoggedOnce) {
  TwoPhaseLogprob lp(client_.get(), Options());
  for (uint32_t i = 0; i < 2; ++i) {
    const Batch b(20 + 10 * i);
    absl::StatusOr<LogprobForward> f = lp.Forward(b.Call());
    ASSERT_TRUE(f.ok()) << f.status();
    Consume(f->ticket(), b);  // its reply lost: the caller calls Backward again
    absl::StatusOr<ComputeResult> g = lp.Backward(*f, b.Gradients());
    ASSERT_TRUE(g.ok()) << g.status();
    ExpectSame(*g, OnePhase(b));
    ExpectCounts(lp, {.tickets = i + 1, .gone = i + 1, .one_phase = i + 1});
    EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(lp.last_fallback().message(), HasSubstr("was consumed by its backward"));
  }
  const std::vector<std::string> log = Log();
  ASSERT_EQ(log.size(), 1u);
  EXPECT_THAT(log[0], HasSubstr("a ticket was gone at backward"));
  EXPECT_THAT(log[0], HasSubstr("was consumed by its backward"));
}

TEST_F(TwoPhaseLogprobTest, ExpiredTicketFallsBackFromCopiedInputs) {
  const Batch original(40);
  PutWeightsResult put = *client_->PutWeights(original.w, &original.bias);
  const ComputeResult one = OnePhase(original, put.handle);

  TwoPhaseLogprob lp(client_.get(), Options(KeepInputs::kCopy));
  Batch b(40);
  absl::StatusOr<LogprobForward> f = lp.Forward(b.Call(put.handle));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_FALSE(f->ticket().empty());
  // The caller reuses its buffers before the backward: the copies are what is sent again.
  const HostTensor other_x = UniformTensor(DType::kBF16, {kBT, kH}, 99, 2.0f);
  const HostTensor other_targets = RandomTargets(98);
  std::memcpy(b.x.mutable_data(), other_x.data(), other_x.num_bytes());
  std::memcpy(b.targets.mutable_data(), other_targets.data(), other_targets.num_bytes());
  skew_ns_ += absl::ToInt64Nanoseconds(absl::Minutes(2));  // past keep_ms (60 s)

  absl::StatusOr<ComputeResult> g = lp.Backward(*f, original.Gradients());
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectSame(*g, one);
  ExpectCounts(lp, {.tickets = 1, .gone = 1, .one_phase = 1});
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(lp.last_fallback().message(), HasSubstr("expired"));
}

TEST_F(TwoPhaseLogprobTest, TicketOfARestartedServerFallsBack) {
  StartServer("0000aaa1", 256);
  TwoPhaseLogprob lp(client_.get(), Options());
  const Batch b(50);
  absl::StatusOr<LogprobForward> f = lp.Forward(b.Call());
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_FALSE(f->ticket().empty());
  StartServer("0000bbb2", 256);  // the same address, a new instance: the ticket is gone
  absl::StatusOr<ComputeResult> g = lp.Backward(*f, b.Gradients());
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectSame(*g, OnePhase(b));
  ExpectCounts(lp, {.tickets = 1, .gone = 1, .one_phase = 1});
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(lp.last_fallback().message(), HasSubstr("0000aaa1"));
}

TEST_F(TwoPhaseLogprobTest, ServerKeepingNoTicketsFallsBackAtTheForwardAndPauses) {
  StartServer("", 0);  // --max_tickets=0
  TwoPhaseLogprob lp(client_.get(), Options());
  const Batch b(60);
  const ComputeResult one = OnePhase(b);
  for (uint64_t i = 1; i <= 2; ++i) {  // the second inside the pause: no ticket asked
    absl::StatusOr<LogprobForward> f = lp.Forward(b.Call());
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE(f->ticket().empty());
    EXPECT_TRUE(f->result().ticket.empty());
    EXPECT_EQ(Mismatch(f->result().Find(OutputTensor::kLogp), one.Find(OutputTensor::kLogp)), "");
    absl::StatusOr<ComputeResult> g = lp.Backward(*f, b.Gradients());
    ASSERT_TRUE(g.ok()) << g.status();
    ExpectSame(*g, one);
    ExpectCounts(lp, {.not_kept = i, .one_phase = i});
  }
  EXPECT_EQ(lp.last_fallback().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(lp.last_fallback().message(), HasSubstr("--max_tickets"));
  const double refused_before = Refusals();
  EXPECT_EQ(refused_before, 1);  // the pause kept the second forward from asking
  {
    absl::MutexLock lock(&mu_);
    helper_skew_ += absl::Seconds(6);  // past pause_after_refusal (5 s)
  }
  absl::StatusOr<LogprobForward> f = lp.Forward(b.Call());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(Refusals(), 2);  // asked again, refused again
  ExpectCounts(lp, {.not_kept = 3, .one_phase = 2});
  const std::vector<std::string> log = Log();
  ASSERT_EQ(log.size(), 1u);
  EXPECT_THAT(log[0], HasSubstr("a forward was not kept"));
}

// A backward cut off (UNAVAILABLE: the helper cannot tell whether the server got it) and
// then NOT_FOUND may have added before its reply was lost: into an accumulator the one-phase
// call is not sent; without one it is (nothing can be added twice). Deterministic: the server
// is stopped, so the cut-off call never arrived, and restarted, so the ticket is gone.
TEST_F(TwoPhaseLogprobTest, UnsureBackwardIntoAnAccumulatorIsNeverSentTwice) {
  TwoPhaseLogprob lp(client_.get(), Options());
  for (const bool into_accumulator : {true, false}) {
    SCOPED_TRACE(into_accumulator ? "accumulator" : "no accumulator");
    const Batch b(into_accumulator ? 70 : 80);
    ComputeRequest call = b.Call();
    if (into_accumulator) call.accumulator = "acc-unsure";
    absl::StatusOr<LogprobForward> f = lp.Forward(call);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_FALSE(f->ticket().empty());
    server_.reset();
    absl::StatusOr<ComputeResult> cut = lp.Backward(*f, b.Gradients());
    EXPECT_EQ(cut.status().code(), absl::StatusCode::kUnavailable) << cut.status();
    EXPECT_FALSE(f->ticket().empty());  // may still serve: a retry would name it
    StartServer("", 256);
    absl::StatusOr<ComputeResult> g = lp.Backward(*f, b.Gradients());
    if (into_accumulator) {
      EXPECT_EQ(g.status().code(), absl::StatusCode::kAborted) << g.status();
      EXPECT_THAT(g.status().message(), HasSubstr("could add the micro-batch twice"));
      // Refused again, not sent later either: the accumulator never began here.
      EXPECT_EQ(lp.Backward(*f, b.Gradients()).status().code(), absl::StatusCode::kAborted);
      EXPECT_EQ(client_->FetchGradients("acc-unsure", false).status().code(),
                absl::StatusCode::kNotFound);
      ExpectCounts(lp, {.tickets = 1});
    } else {
      ASSERT_TRUE(g.ok()) << g.status();
      ExpectSame(*g, OnePhase(b));
      ExpectCounts(lp, {.tickets = 2, .gone = 1, .one_phase = 1});
    }
  }
}

// The same for a one-phase backward (no ticket kept) cut off: not sent again.
TEST_F(TwoPhaseLogprobTest, AOnePhaseBackwardCutOffIsNotSentAgain) {
  TwoPhaseOptions o = Options();
  o.keep_ms = 0;
  TwoPhaseLogprob lp(client_.get(), o);
  const Batch b(85);
  ComputeRequest call = b.Call();
  call.accumulator = "acc-cut";
  absl::StatusOr<LogprobForward> f = lp.Forward(call);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE(f->ticket().empty());
  server_.reset();
  EXPECT_EQ(lp.Backward(*f, b.Gradients()).status().code(), absl::StatusCode::kUnavailable);
  StartServer("", 256);
  absl::StatusOr<ComputeResult> g = lp.Backward(*f, b.Gradients());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kAborted) << g.status();
  EXPECT_EQ(client_->FetchGradients("acc-cut", false).status().code(),
            absl::StatusCode::kNotFound);
  ExpectCounts(lp, {});  // keep_ms 0 is the caller's choice: no forward counts as not kept
}

// Against a hosted head: the backward adds into the step under the call's (rank,
// micro_batch); a ticket consumed by a backward whose reply was lost falls back to the
// one-phase call, which the step key keeps from adding twice. dX is the inline call's.
TEST_F(TwoPhaseLogprobTest, AHeadsStepKeyMakesTheFallbackAddOnce) {
  const Batch b(95);
  CreateHeadRequest head;
  head.name = "lm";
  head.w = b.w;  // bf16: the compute copy is these very values
  head.bias = b.bias;
  ASSERT_TRUE(client_->CreateHead(head).ok());
  TwoPhaseLogprob lp(client_.get(), Options());
  ComputeRequest inline_call = b.Call();
  inline_call.want.dw = inline_call.want.db = false;
  ComputeRequest call = inline_call;
  call.w.reset();
  call.bias.reset();
  call.head = "lm";
  call.head_version = 0;
  ComputeRequest direct = inline_call;
  direct.dlogp = Batch::View(b.dlogp);
  direct.dentropy = Batch::View(b.dentropy);
  absl::StatusOr<ComputeResult> one = client_->Compute(direct);
  ASSERT_TRUE(one.ok()) << one.status();

  for (uint64_t mb = 0; mb < 2; ++mb) {
    call.micro_batch = mb;
    absl::StatusOr<LogprobForward> f = lp.Forward(call);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_FALSE(f->ticket().empty());
    if (mb == 1) {  // its backward ran, and its reply was lost
      ComputeRequest r;
      r.kind = LossKind::kLogprob;
      r.ticket = f->ticket();
      r.dlogp = Batch::View(b.dlogp);
      r.dentropy = Batch::View(b.dentropy);
      r.micro_batch = mb;
      absl::StatusOr<ComputeResult> ran = client_->Compute(r);
      ASSERT_TRUE(ran.ok()) << ran.status();
      EXPECT_TRUE(ran->head_added);
    }
    absl::StatusOr<ComputeResult> g = lp.Backward(*f, b.Gradients());
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->head_added, mb == 0);  // the fallback's key was already in the step
    EXPECT_EQ(Mismatch(g->Find(OutputTensor::kDx), one->Find(OutputTensor::kDx)), "");
    EXPECT_EQ(Mismatch(g->Find(OutputTensor::kLogp), one->Find(OutputTensor::kLogp)), "");
  }
  absl::StatusOr<HeadInfo> info = client_->GetHeadInfo("lm");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->contributions, 2u);
  ExpectCounts(lp, {.tickets = 2, .two_phase = 1, .gone = 1, .one_phase = 1});
}

TEST_F(TwoPhaseLogprobTest, RefusesWhatTheCallMustNotGive) {
  TwoPhaseLogprob lp(client_.get(), Options());
  const Batch b(90);
  struct Case {
    const char* what;
    std::function<void(ComputeRequest*)> edit;
    const char* message;
  };
  const Case cases[] = {
      {"kind", [](ComputeRequest* r) { r->kind = LossKind::kCrossEntropy; },
       "call.kind is cross_entropy"},
      {"dlogp", [&](ComputeRequest* r) { r->dlogp = b.View(b.dlogp); }, "call.dlogp is set"},
      {"dentropy", [&](ComputeRequest* r) { r->dentropy = b.View(b.dentropy); },
       "call.dentropy is set"},
      {"keep_ms", [](ComputeRequest* r) { r->keep_ms = 5; }, "call.keep_ms"},
      {"ticket", [](ComputeRequest* r) { r->ticket = "t-00000000-1"; }, "call.ticket is set"},
      {"advantages", [&](ComputeRequest* r) { r->advantages = b.View(b.dlogp); },
       "call.advantages is set: a logprob call does not take it"},
  };
  for (const Case& c : cases) {
    ComputeRequest call = b.Call();
    c.edit(&call);
    absl::StatusOr<LogprobForward> f = lp.Forward(call);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_THAT(f.status().message(), HasSubstr(c.message)) << c.what;
  }
  // A head's forward that could keep nothing would add to its step: refused before sending.
  TwoPhaseOptions one_phase = Options();
  one_phase.keep_ms = 0;
  TwoPhaseLogprob never(client_.get(), one_phase);
  ComputeRequest head_call = b.Call();
  head_call.w.reset();
  head_call.bias.reset();
  head_call.head = "lm";
  absl::StatusOr<LogprobForward> h = never.Forward(head_call);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(h.status().message(), HasSubstr("call.head 'lm' with TwoPhaseOptions::keep_ms 0"));

  absl::StatusOr<LogprobForward> f = lp.Forward(b.Call());
  ASSERT_TRUE(f.ok()) << f.status();
  absl::StatusOr<ComputeResult> none = lp.Backward(*f, LogprobGradients{});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(none.status().message(), HasSubstr("grads.dlogp and/or grads.dentropy"));
  EXPECT_FALSE(f->ticket().empty());  // nothing was sent: the ticket still serves
  ExpectCounts(lp, {.tickets = 1});
}

}  // namespace
}  // namespace client
}  // namespace lossd
