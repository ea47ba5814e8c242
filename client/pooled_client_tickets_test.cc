// SPDX-License-Identifier: Apache-2.0
// Tests the pooled client's two-phase log-prob routing against three real replicas
// (pool_test_fixture.h): each backward goes to the replica whose forward took its ticket,
// among tickets on every replica, and gives the one-phase call's gradients byte for byte; a
// ticket the pool does not know, whose replica is gone (stopped, restarted), that expired by
// the pool's clock or that the bounded map forgot is NOT_FOUND and sent nowhere; with an
// accumulator, the backward adds on the ticket's replica or is NOT_FOUND.
#include <string>
#include <vector>

#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

constexpr float kTemperature = 0.8f;

class PoolTicketsTest : public PoolWeightsTest {
 protected:
  // The forward that keeps: micro-batch `seed` against weights `name` ("" = W inline).
  ComputeRequest Forward(uint32_t seed, const std::string& name, uint32_t keep_ms = 60000) {
    ComputeRequest r = PoolMicroBatch(seed);
    r.kind = LossKind::kLogprob;
    r.options.temperature = kTemperature;
    if (name.empty()) {
      r.w = HostTensor::View(w_.dtype(), w_.shape(), w_.data());
    } else {
      r.weight_handle = name;
    }
    r.want = WantedOutputs{};
    r.want.dx = r.want.dw = false;
    r.want.entropy = true;
    r.keep_ms = keep_ms;
    return r;
  }
  // Takes a ticket through `pool` and checks it.
  std::string Keep(PooledClient& pool, const ComputeRequest& forward) {
    absl::StatusOr<ComputeResult> f = pool.Compute(forward);
    EXPECT_TRUE(f.ok()) << f.status();
    if (!f.ok()) return "";
    EXPECT_NE(f->Find(OutputTensor::kLogp), nullptr);
    EXPECT_FALSE(f->ticket.empty());
    EXPECT_GT(f->ticket_expires_unix_ms, absl::ToUnixMillis(absl::Now()));
    return f->ticket;
  }
  // The upstream gradients of micro-batch `seed` (random, never zeros).
  static void WithGradients(uint32_t seed, ComputeRequest* r) {
    r->dlogp = UniformTensor(DType::kF32, {kPoolBT}, 300 + seed, 1.0f);
    r->dentropy = UniformTensor(DType::kF32, {kPoolBT}, 400 + seed, 1.0f);
    r->want.dx = r->want.dw = true;
  }
  static ComputeRequest Backward(const std::string& ticket, uint32_t seed) {
    ComputeRequest r;
    r.kind = LossKind::kLogprob;
    r.ticket = ticket;
    WithGradients(seed, &r);
    return r;
  }
  // The one-phase call of micro-batch `seed` on the single-server reference.
  ComputeResult OnePhase(uint32_t seed) {
    ComputeRequest r = Forward(seed, reference_handle_, 0);
    WithGradients(seed, &r);
    absl::StatusOr<ComputeResult> res = reference_->Compute(r);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? *std::move(res) : ComputeResult{};
  }
  void ExpectOnePhase(const ComputeResult& got, uint32_t seed) {
    const ComputeResult want = OnePhase(seed);
    for (OutputTensor t : {OutputTensor::kDx, OutputTensor::kDw}) {
      ASSERT_NE(got.Find(t), nullptr);
      EXPECT_EQ(PoolMismatch(got.Find(t), want.Find(t)), "") << "seed " << seed;
    }
  }
  // The first accumulator name (prefix, n) whose rendezvous home is not replica 0.
  std::string AccumulatorAwayFrom0(const std::string& prefix) const {
    for (int n = 0;; ++n) {
      const std::string name = absl::StrCat(prefix, n);
      if (Order(AccumulatorKey(name)).front() != Endpoint(0)) return name;
    }
  }
  static uint64_t AllCalls(PooledClient& pool) {
    uint64_t n = 0;
    for (const auto& [endpoint, calls] : pool.counters().calls) n += calls;
    return n;
  }
};

TEST_F(PoolTicketsTest, EachBackwardGoesToTheReplicaOfItsForward) {
  std::vector<std::string> tickets;
  for (int i = 0; i < kReplicas; ++i) {  // a ticket on every replica
    tickets.push_back(Keep(*pool_, Forward(10 + i, WeightsOn(*pool_, i))));
    EXPECT_EQ(pool_->ReplicaOfTicket(tickets.back()), Endpoint(i));
    EXPECT_EQ(EngineOf(i).tickets().count(), 1u);
  }
  EXPECT_EQ(pool_->TicketsRemembered(), 3u);
  for (int i = kReplicas - 1; i >= 0; --i) {
    const std::map<std::string, uint64_t> before = pool_->counters().calls;
    absl::StatusOr<ComputeResult> b = pool_->Compute(Backward(tickets[i], 10 + i));
    ASSERT_TRUE(b.ok()) << b.status();
    ExpectOnePhase(*b, 10 + i);
    std::map<std::string, uint64_t> want = before;
    ++want[Endpoint(i)];
    EXPECT_EQ(pool_->counters().calls, want) << "the backward of the ticket on " << Endpoint(i);
    EXPECT_EQ(EngineOf(i).tickets().count(), 0u);  // consumed there
    EXPECT_EQ(pool_->ReplicaOfTicket(tickets[i]), "");
  }
  EXPECT_EQ(pool_->TicketsRemembered(), 0u);
}

TEST_F(PoolTicketsTest, AnUnknownTicketIsNotFoundAndSentNowhere) {
  std::unique_ptr<PooledClient> other = NewPool(1);  // another trainer's pool
  const std::string theirs = Keep(*other, Forward(20, ""));
  for (const std::string& ticket : {theirs, std::string("t-deadbeef-1")}) {
    absl::StatusOr<ComputeResult> b = pool_->Compute(Backward(ticket, 20));
    EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound) << b.status();
    EXPECT_THAT(std::string(b.status().message()),
                HasSubstr(absl::StrCat("ticket '", ticket, "' was not taken through this pool, "
                                       "or is forgotten")));
    EXPECT_THAT(std::string(b.status().message()), HasSubstr("send the one-phase call"));
  }
  // A backward malformed on its face is refused by its field, before any routing.
  ComputeRequest with_x = Backward(theirs, 20);
  with_x.x = PoolMicroBatch(20).x;
  absl::StatusOr<ComputeResult> bad = pool_->Compute(with_x);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("gives x"));
  EXPECT_EQ(AllCalls(*pool_), 0u);
  // The ticket is still its taker's.
  absl::StatusOr<ComputeResult> b = other->Compute(Backward(theirs, 20));
  ASSERT_TRUE(b.ok()) << b.status();
  ExpectOnePhase(*b, 20);
}

TEST_F(PoolTicketsTest, AReplicaGoneTakesItsTicketsAlongAndTheOnePhaseCallStandsIn) {
  const std::string stopped_w = WeightsOn(*pool_, 1);
  const std::string on_stopped = Keep(*pool_, Forward(30, stopped_w));
  const std::string on_restarted = Keep(*pool_, Forward(31, WeightsOn(*pool_, 2)));
  const std::map<std::string, uint64_t> before = pool_->counters().calls;
  Stop(1);
  absl::StatusOr<ComputeResult> b = pool_->Compute(Backward(on_stopped, 30));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound) << b.status();
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr(absl::StrCat("ticket '", on_stopped, "' was held by replica ",
                                     Endpoint(1), ", which is unreachable")));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("no other replica holds it"));
  std::map<std::string, uint64_t> want = before;
  ++want[Endpoint(1)];  // tried there only
  EXPECT_EQ(pool_->counters().calls, want);
  EXPECT_EQ(pool_->ReplicaOfTicket(on_stopped), "");
  b = pool_->Compute(Backward(on_stopped, 30));  // forgotten: sent nowhere
  EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound) << b.status();
  EXPECT_EQ(pool_->counters().calls, want);

  Restart(2);
  b = pool_->Compute(Backward(on_restarted, 31));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound) << b.status();
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr(absl::StrCat("ticket '", on_restarted, "' was held by replica ",
                                     Endpoint(2), ", which restarted")));
  std::map<std::string, uint64_t> after = pool_->counters().calls;
  EXPECT_EQ(after[Endpoint(0)], want[Endpoint(0)]);  // never sent to the replica left
  EXPECT_EQ(after[Endpoint(1)], want[Endpoint(1)]);

  // The one-phase call goes where the weights moved and gives the same gradients.
  ComputeRequest one = Forward(30, stopped_w, 0);
  WithGradients(30, &one);
  absl::StatusOr<ComputeResult> o = pool_->Compute(one);
  ASSERT_TRUE(o.ok()) << o.status();
  ExpectOnePhase(*o, 30);
}

TEST_F(PoolTicketsTest, TheMapIsBoundedAndForgetsExpiredTickets) {
  std::unique_ptr<PooledClient> pool =
      NewPool(0, [](PoolOptions* o) { o->tickets_kept = 2; });
  const int home = IndexOf(Order(RankKey(0)).front());
  // Past the cap, the ticket that expires first is forgotten (not the oldest by chance).
  const std::string b = Keep(*pool, Forward(41, "", 60000));
  const std::string a = Keep(*pool, Forward(40, "", 30000));
  const std::string c = Keep(*pool, Forward(42, "", 90000));
  EXPECT_EQ(pool->TicketsRemembered(), 2u);
  EXPECT_EQ(pool->ReplicaOfTicket(a), "");
  EXPECT_EQ(pool->ReplicaOfTicket(b), Endpoint(home));
  EXPECT_EQ(pool->ReplicaOfTicket(c), Endpoint(home));
  const uint64_t calls = AllCalls(*pool);
  absl::StatusOr<ComputeResult> got = pool->Compute(Backward(a, 40));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("newest 2 unexpired tickets"));
  EXPECT_EQ(AllCalls(*pool), calls);
  EXPECT_EQ(EngineOf(home).tickets().count(), 3u);  // the server still holds it
  got = pool->Compute(Backward(b, 41));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectOnePhase(*got, 41);

  // Past its expiry by the pool's clock, a ticket is dropped and its backward sent nowhere.
  Advance(absl::Seconds(100));
  got = pool->Compute(Backward(c, 42));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound) << got.status();
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr(absl::StrCat("ticket '", c, "' (on replica ", Endpoint(home),
                                     ") expired at ")));
  EXPECT_EQ(AllCalls(*pool), calls + 1);
  EXPECT_EQ(pool->TicketsRemembered(), 0u);
}

TEST_F(PoolTicketsTest, ABackwardIntoAnAccumulatorAddsOnlyOnTheTicketsReplica) {
  // An accumulator not placed yet begins where the ticket is, not at its own home.
  const std::string fresh = AccumulatorAwayFrom0("fresh-");
  const std::string t = Keep(*pool_, Forward(50, WeightsOn(*pool_, 0)));
  ComputeRequest into = Backward(t, 50);
  into.accumulator = fresh;
  into.want.dw = false;
  absl::StatusOr<ComputeResult> b = pool_->Compute(into);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(pool_->ReplicaOf(AccumulatorKey(fresh)), Endpoint(0));
  EXPECT_EQ(EngineOf(0).accumulators().count(), 1u);
  absl::StatusOr<FetchGradientsResult> sum = pool_->FetchGradients(fresh, true);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->micro_batches, 1u);

  // One placed on another replica: NOT_FOUND before sending; the one-phase call goes there.
  const std::string acc = AccumulatorAwayFrom0("acc-");
  const std::string w0 = WeightsOn(*pool_, 0);
  ComputeRequest first = Forward(51, w0, 0);
  WithGradients(51, &first);
  first.want.dw = false;
  first.accumulator = acc;
  ASSERT_TRUE(pool_->Compute(first).ok());
  const std::string t2 = Keep(*pool_, Forward(52, w0));
  into = Backward(t2, 52);
  into.accumulator = acc;
  into.want.dw = false;
  const uint64_t calls = AllCalls(*pool_);
  b = pool_->Compute(into);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kNotFound) << b.status();
  EXPECT_THAT(std::string(b.status().message()),
              HasSubstr(absl::StrCat("ticket '", t2, "' lives on replica ", Endpoint(0),
                                     ", accumulator '", acc, "' on ",
                                     Order(AccumulatorKey(acc)).front())));
  EXPECT_EQ(AllCalls(*pool_), calls);
  EXPECT_EQ(pool_->ReplicaOfTicket(t2), Endpoint(0));  // still usable without it
}

}  // namespace
}  // namespace client
}  // namespace lossd
