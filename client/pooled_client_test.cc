// SPDX-License-Identifier: Apache-2.0
// Tests the pooled client against three real replicas (pool_test_fixture.h): every key on its
// rendezvous home, as the servers' own state shows; stateless Computes and weights moving
// when their replica stops, W uploaded again exactly once per moved handle and only from
// bytes proven unchanged; an accumulator lost mid-step (stopped or restarted replica) is an
// error until dropped, nothing is sent into it elsewhere, and the redone step's sum equals a
// single server's byte for byte.
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;

// `r`'s loss and dX from the single-server reference with inline weights.
ComputeResult Reference(LossClient& c, ComputeRequest r, const HostTensor& w) {
  r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
  r.weight_handle.clear();
  r.accumulator.clear();
  absl::StatusOr<ComputeResult> res = c.Compute(r);
  EXPECT_TRUE(res.ok()) << res.status();
  return res.ok() ? *std::move(res) : ComputeResult{};
}

void ExpectSameResult(const ComputeResult& got, const ComputeResult& want, const char* what) {
  EXPECT_EQ(got.loss, want.loss) << what;
  EXPECT_EQ(got.tokens, want.tokens) << what;
  EXPECT_EQ(PoolMismatch(got.Find(OutputTensor::kDx), want.Find(OutputTensor::kDx)), "") << what;
}

// The first rank whose home (over all three) is replica `i`.
uint32_t RankHomedOn(const std::vector<std::string>& endpoints, int i) {
  for (uint32_t r = 0;; ++r) {
    if (RendezvousOrder(RankKey(r), endpoints).front() == endpoints[i]) return r;
  }
}

TEST_F(PoolTest, EveryKeyGoesToItsRendezvousHome) {
  const HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 7, 0.5f);
  std::map<std::string, uint64_t> want_calls;
  for (uint32_t rank = 0; rank < 12; ++rank) {  // one trainer (and pool) per rank
    std::unique_ptr<PooledClient> pool = NewPool(rank);
    ComputeRequest r = PoolMicroBatch(rank);
    r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
    absl::StatusOr<ComputeResult> got = pool->Compute(r);
    ASSERT_TRUE(got.ok()) << got.status();
    const std::string home = Order(RankKey(rank)).front();
    EXPECT_EQ(pool->ReplicaOf(RankKey(rank)), home);
    EXPECT_EQ(got->instance, absl::StrCat("replica", IndexOf(home) + 1, "-", IndexOf(home)));
    EXPECT_EQ(pool->counters().calls,
              (std::map<std::string, uint64_t>{{home, 1}}));
    ExpectSameResult(*got, Reference(*reference_, r, w), "stateless");
  }
  // Accumulators and weights: the servers' own state shows where they went.
  for (const char* acc : {"t0-step1", "t1-step1", "t2-step1", "t3-step1"}) {
    ComputeRequest r = PoolMicroBatch(50);
    r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
    r.accumulator = acc;
    ASSERT_TRUE(pool_->Compute(r).ok());
    ++want_calls[Order(AccumulatorKey(acc)).front()];
  }
  ASSERT_TRUE(pool_->PutWeights("w0", w, nullptr).ok());
  ++want_calls[Order(WeightsKey("w0")).front()];
  for (int i = 0; i < kReplicas; ++i) {
    size_t accs = 0;
    for (const char* acc : {"t0-step1", "t1-step1", "t2-step1", "t3-step1"}) {
      accs += Order(AccumulatorKey(acc)).front() == Endpoint(i) ? 1 : 0;
    }
    EXPECT_EQ(EngineOf(i).accumulators().count(), accs) << Endpoint(i);
    EXPECT_EQ(EngineOf(i).weights().count(),
              Order(WeightsKey("w0")).front() == Endpoint(i) ? 1u : 0u)
        << Endpoint(i);
  }
  const PoolCounters c = pool_->counters();
  EXPECT_EQ(c.calls, want_calls);
  EXPECT_EQ(c.moves, 0u);
  EXPECT_EQ(c.reuploads, 0u);
  EXPECT_EQ(c.steps_lost, 0u);
  EXPECT_EQ(c.uploads, 1u);
}

TEST_F(PoolTest, AStatelessComputeMovesWhenItsReplicaStopsAndComesBackAfterItsRestart) {
  const HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 8, 0.5f);
  const uint32_t rank = RankHomedOn(Endpoints(), 1);
  std::unique_ptr<PooledClient> pool = NewPool(rank);
  ComputeRequest r = PoolMicroBatch(3);
  r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
  const ComputeResult want = Reference(*reference_, r, w);
  ASSERT_TRUE(pool->Compute(r).ok());
  Stop(1);
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<ComputeResult> got = pool->Compute(r);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameResult(*got, want, "after the stop");
  }
  const std::string next = Order(RankKey(rank))[1];
  EXPECT_EQ(pool->ReplicaOf(RankKey(rank)), next);
  EXPECT_EQ(pool->counters().moves, 1u);
  const std::string moved = absl::StrCat("'rank:", rank, "' moved from replica ", Endpoint(1),
                                         " to ", next, ": replica ", Endpoint(1),
                                         " is unreachable");
  EXPECT_EQ(Logged(moved), 1);
  // Started again (a new instance): it takes no keys while down (down_for), then the rank,
  // which holds nothing, goes home.
  Start(1);
  absl::StatusOr<ComputeResult> got = pool->Compute(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(pool->ReplicaOf(RankKey(rank)), next);
  Advance(absl::Seconds(11));
  got = pool->Compute(r);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(pool->ReplicaOf(RankKey(rank)), Endpoint(1));
  EXPECT_EQ(pool->counters().moves, 2u);
  EXPECT_EQ(Logged(absl::StrCat("'rank:", rank, "' moved from replica ", next, " to ",
                                Endpoint(1))),
            1);
  ExpectSameResult(*got, want, "back home");
}

TEST_F(PoolTest, WeightsMoveWithTheirReplicaAndAreUploadedAgainOnce) {
  HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 9, 0.5f);
  HostTensor bias = UniformTensor(DType::kBF16, {kPoolV}, 10, 0.5f);
  absl::StatusOr<PutWeightsResult> put = pool_->PutWeights("w0", w, &bias);
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->handle, "w0");
  const std::vector<std::string> order = Order(WeightsKey("w0"));
  const int home = IndexOf(order[0]), next = IndexOf(order[1]);
  Stop(home);
  for (uint32_t mb = 0; mb < 3; ++mb) {
    ComputeRequest r = PoolMicroBatch(mb);
    r.weight_handle = "w0";
    absl::StatusOr<ComputeResult> got = pool_->Compute(r);
    ASSERT_TRUE(got.ok()) << got.status();
    ComputeRequest ref = r;
    ref.bias = HostTensor::View(bias.dtype(), bias.shape(), bias.data());
    ExpectSameResult(*got, Reference(*reference_, ref, w), "moved weights");
  }
  EXPECT_EQ(pool_->ReplicaOf(WeightsKey("w0")), order[1]);
  EXPECT_EQ(EngineOf(next).weights().count(), 1u);
  const PoolCounters c = pool_->counters();
  EXPECT_EQ(c.reuploads, 1u);
  EXPECT_EQ(c.moves, 1u);
  EXPECT_EQ(Logged("weights 'w0' uploaded again to replica"), 1);
  EXPECT_EQ(Logged("checksum"), 1);
  EXPECT_EQ(Logged("'weights:w0' moved from replica"), 1);
  EXPECT_TRUE(pool_->DropWeights("w0").ok());
  EXPECT_EQ(EngineOf(next).weights().count(), 0u);
}

TEST_F(PoolTest, WeightsOnAReplicaRestartedInPlaceAreUploadedThereAgain) {
  HostTensor w = UniformTensor(DType::kF32, {kPoolV, kPoolH}, 11, 0.5f);
  ASSERT_TRUE(pool_->PutWeights("w1", w, nullptr).ok());
  const int home = IndexOf(Order(WeightsKey("w1"))[0]);
  Restart(home);  // a new instance at the same address: NOT_FOUND for the handle
  ComputeRequest r = PoolMicroBatch(4);
  r.x = UniformTensor(DType::kF32, {kPoolBT, kPoolH}, 12, 2.0f);
  r.weight_handle = "w1";
  absl::StatusOr<ComputeResult> got = pool_->Compute(r);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameResult(*got, Reference(*reference_, r, w), "restarted");
  EXPECT_EQ(got->instance, absl::StrCat("replica", home + 1, "-3"));
  EXPECT_EQ(pool_->counters().reuploads, 1u);
  EXPECT_EQ(pool_->counters().moves, 0u);  // it is up: still the home
}

TEST_F(PoolTest, WeightsChangedInPlaceOrNotKeptAreNeverUploadedAgain) {
  HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 13, 0.5f);
  // Three names homed on one replica, kept three ways.
  std::vector<std::string> names;
  const std::string home = Order(WeightsKey("n0")).front();
  for (int k = 0; names.size() < 3; ++k) {
    if (Order(WeightsKey(absl::StrCat("n", k))).front() == home) {
      names.push_back(absl::StrCat("n", k));
    }
  }
  HostTensor copy_source = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 13, 0.5f);
  ASSERT_TRUE(pool_->PutWeights(names[0], w, nullptr).ok());
  ASSERT_TRUE(pool_->PutWeights(names[1], w, nullptr, WeightsRetention::kNone).ok());
  ASSERT_TRUE(pool_->PutWeights(names[2], copy_source, nullptr, WeightsRetention::kCopy).ok());
  // The optimizer updates W in place; the caller's memory for the copy is reused.
  w.mutable_data()[5] ^= 0x40;
  std::memset(copy_source.mutable_data(), 0x3c, copy_source.num_bytes());
  Stop(IndexOf(home));

  ComputeRequest r = PoolMicroBatch(5);
  r.weight_handle = names[0];
  absl::StatusOr<ComputeResult> got = pool_->Compute(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("changed in place"));
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr(absl::StrCat("call PutWeights('", names[0], "', W) again")));
  r.weight_handle = names[1];
  got = pool_->Compute(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("keeps nothing of them"));
  EXPECT_EQ(pool_->counters().reuploads, 0u);

  r.weight_handle = names[2];  // the pool's own copy: provably the bytes uploaded
  got = pool_->Compute(r);
  ASSERT_TRUE(got.ok()) << got.status();
  const HostTensor original = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 13, 0.5f);
  ExpectSameResult(*got, Reference(*reference_, r, original), "kCopy");
  EXPECT_EQ(Logged("from the pool's copy"), 1);

  // The trainer re-supplies W: uploaded as new, then used.
  ASSERT_TRUE(pool_->PutWeights(names[0], w, nullptr).ok());
  r.weight_handle = names[0];
  got = pool_->Compute(r);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectSameResult(*got, Reference(*reference_, r, w), "re-supplied");
  EXPECT_EQ(pool_->counters().reuploads, 1u);  // the copy's only
}

TEST_F(PoolTest, UnknownWeightsNameIsNotFound) {
  ComputeRequest r = PoolMicroBatch(6);
  r.weight_handle = "never-put";
  absl::StatusOr<ComputeResult> got = pool_->Compute(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("PutWeights('never-put', W)"));
  HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 1, 0.5f);
  EXPECT_EQ(pool_->PutWeights("", w, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(pool_->PutWeights(std::string(129, 'a'), w, nullptr).status().message()),
              HasSubstr("weights name must be 1 to 128 bytes, got 129"));
}

// Micro-batches 0..n-1 of a step into `acc` with the weights `name`; the first error.
absl::Status RunStep(PooledClient& pool, const std::string& acc, const std::string& name,
                     uint32_t first, uint32_t n) {
  for (uint32_t mb = first; mb < first + n; ++mb) {
    ComputeRequest r = PoolMicroBatch(100 + mb);
    r.weight_handle = name;
    r.accumulator = acc;
    absl::StatusOr<ComputeResult> got = pool.Compute(r);
    if (!got.ok()) return got.status();
  }
  return absl::OkStatus();
}

// The same step's sum on the reference server.
FetchGradientsResult ReferenceSum(LossClient& c, const HostTensor& w, uint32_t n) {
  for (uint32_t mb = 0; mb < n; ++mb) {
    ComputeRequest r = PoolMicroBatch(100 + mb);
    r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
    r.accumulator = "reference";
    EXPECT_TRUE(c.Compute(r).ok());
  }
  absl::StatusOr<FetchGradientsResult> f = c.FetchGradients("reference", true);
  EXPECT_TRUE(f.ok()) << f.status();
  return f.ok() ? *std::move(f) : FetchGradientsResult{};
}

class AccumulatorLossTest : public PoolTest, public ::testing::WithParamInterface<bool> {};

// The replica holding a step's accumulator is stopped (false) or restarted (true) after two
// of three micro-batches.
TEST_P(AccumulatorLossTest, IsAnErrorUntilDroppedAndTheRedoneStepMatches) {
  const bool restart = GetParam();
  const HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 21, 0.5f);
  const std::string acc = "rank0-step1";
  ASSERT_TRUE(pool_->PutWeights("w", w, nullptr).ok());
  const std::vector<std::string> order = Order(AccumulatorKey(acc));
  const int home = IndexOf(order[0]);
  ASSERT_TRUE(RunStep(*pool_, acc, "w", 0, 2).ok());
  EXPECT_EQ(EngineOf(home).accumulators().count(), 1u);
  restart ? Restart(home) : Stop(home);

  absl::Status s = RunStep(*pool_, acc, "w", 2, 1);
  ASSERT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  // Either way the step is redone on the next replica: the one that lost it is passed over.
  const std::string redo_on = order[1];
  EXPECT_THAT(std::string(s.message()), HasSubstr(restart ? "restarted" : "is unreachable"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("Redo the step: DropAccumulator('rank0-step1')"));
  EXPECT_THAT(std::string(s.message()), HasSubstr(absl::StrCat("start on replica ", redo_on)));
  // Until dropped, every call naming it fails the same way, and nothing reached any replica.
  EXPECT_EQ(RunStep(*pool_, acc, "w", 2, 1).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(pool_->FetchGradients(acc, true).status().code(), absl::StatusCode::kAborted);
  for (int i = 0; i < kReplicas; ++i) {
    if (servers_[i]) EXPECT_EQ(EngineOf(i).accumulators().count(), 0u) << Endpoint(i);
  }
  EXPECT_EQ(pool_->counters().steps_lost, 1u);
  EXPECT_EQ(Logged("accumulator 'rank0-step1' was on replica"), 1);

  ASSERT_TRUE(pool_->DropAccumulator(acc).ok());
  ASSERT_TRUE(RunStep(*pool_, acc, "w", 0, 3).ok());
  absl::StatusOr<FetchGradientsResult> got = pool_->FetchGradients(acc, true);
  ASSERT_TRUE(got.ok()) << got.status();
  const FetchGradientsResult want = ReferenceSum(*reference_, w, 3);
  EXPECT_EQ(got->micro_batches, 3u);  // nothing added twice
  EXPECT_EQ(got->tokens, want.tokens);
  EXPECT_EQ(PoolMismatch(&got->dw, &want.dw), "");
  EXPECT_EQ(pool_->ReplicaOf(AccumulatorKey(acc)), redo_on);
  const PoolCounters c = pool_->counters();
  EXPECT_EQ(c.moves, 1u);  // the accumulator
  // W goes wherever the accumulator is: PutWeights put it on its own home, and a Compute
  // sent it to the accumulator's home when that was another replica. Its handles there were
  // lost with the replica; one re-upload replaces them where the redone step needs W: on the
  // accumulator's next replica, unless W's own home is that one.
  const std::string w_home = Order(WeightsKey("w")).front();
  const uint64_t want_reuploads = w_home != order[1] ? 1 : 0;
  EXPECT_EQ(c.reuploads, want_reuploads);
  EXPECT_EQ(c.uploads, 1 + (w_home != order[0] ? 1 : 0) + want_reuploads);
  EXPECT_EQ(Logged("weights 'w' uploaded again"), static_cast<int>(want_reuploads));
}

INSTANTIATE_TEST_SUITE_P(StoppedOrRestarted, AccumulatorLossTest, ::testing::Bool());

// An accumulator that holds nothing, new or just reset by a fetch, loses nothing with its
// replica: the Compute that finds it gone goes on to the next one, and no step is redone.
TEST_P(AccumulatorLossTest, AnEmptyOneMovesQuietly) {
  const bool restart = GetParam();
  const HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 22, 0.5f);
  const std::string reset_acc = "rank0-step2";
  const std::vector<std::string> order = Order(AccumulatorKey(reset_acc));
  // A new accumulator homed on the same replica, of a second trainer whose pool has not
  // called that replica before it goes.
  std::string fresh;
  for (int k = 0; fresh.empty(); ++k) {
    const std::string name = absl::StrCat("rank1-step2-", k);
    if (Order(AccumulatorKey(name)).front() == order[0]) fresh = name;
  }
  std::unique_ptr<PooledClient> other = NewPool(1);
  ASSERT_TRUE(pool_->PutWeights("w", w, nullptr).ok());
  ASSERT_TRUE(other->PutWeights("w", w, nullptr).ok());
  ASSERT_TRUE(RunStep(*pool_, reset_acc, "w", 0, 2).ok());
  ASSERT_TRUE(pool_->FetchGradients(reset_acc, true).ok());  // empty again
  restart ? Restart(IndexOf(order[0])) : Stop(IndexOf(order[0]));

  const FetchGradientsResult want = ReferenceSum(*reference_, w, 3);
  for (PooledClient* c : {pool_.get(), other.get()}) {
    const std::string acc = c == other.get() ? fresh : reset_acc;
    ASSERT_TRUE(RunStep(*c, acc, "w", 0, 3).ok()) << acc;
    absl::StatusOr<FetchGradientsResult> got = c->FetchGradients(acc, true);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->micro_batches, 3u) << acc;
    EXPECT_EQ(PoolMismatch(&got->dw, &want.dw), "") << acc;
    // The reset one leaves the replica that lost it; the fresh one, never placed by its
    // pool, goes to its home if that is up (restarted).
    const std::string next = restart && c == other.get() ? order[0]
                                                         : Order(AccumulatorKey(acc))[1];
    EXPECT_EQ(c->ReplicaOf(AccumulatorKey(acc)), next) << acc;
    EXPECT_EQ(c->counters().steps_lost, 0u) << acc;
  }
  EXPECT_EQ(pool_->counters().moves, 1u);  // placed before; the fresh one was not
  EXPECT_EQ(other->counters().moves, 0u);
}

}  // namespace
}  // namespace client
}  // namespace lossd
