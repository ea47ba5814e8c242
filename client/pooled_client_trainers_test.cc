// SPDX-License-Identifier: Apache-2.0
// Many trainers over three real replicas (pool_test_fixture.h), each its own pool as its own
// process would be: every step uploads the trainer's W under its name, sums three
// micro-batches into the step's accumulator and fetches it. One replica is stopped in the
// middle of step 1 and another restarted in the middle of step 2 (every trainer has sent the
// step's first micro-batch, none its second). Trainers recover as docs/replica_pool.md says
// (ABORTED: drop the accumulator and redo the step). Every trainer finishes with losses and
// summed gradients equal to a single server's byte for byte, each sum of exactly three
// micro-batches (nothing added twice), and exactly the accumulators that held a sum on the
// lost replicas lost, each logged once and answered by one redo.
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

constexpr int kTrainers = 6, kSteps = 3;
constexpr uint32_t kMicroBatches = 3;

std::string AccOf(int trainer, int step) { return absl::StrCat("t", trainer, "-s", step); }
HostTensor WeightsOf(int trainer, int step) {
  return UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 500 + 10 * trainer + step, 0.5f);
}
uint32_t SeedOf(int trainer, int step, uint32_t mb) { return 700 + 100 * trainer + 10 * step + mb; }

struct StepOutcome {
  std::vector<float> losses;
  FetchGradientsResult sum;
  int attempts = 0;
};

// Trainers meet at a gate in the middle of steps 1 and 2; the test acts on the replicas,
// then opens it.
class Gates {
 public:
  void Arrive(int step) {
    absl::MutexLock lock(&mu_);
    ++arrived_[step];
    mu_.Await(absl::Condition(
        +[](bool* open) { return *open; }, &open_[step]));
  }
  void AwaitAll(int step, int n) {
    absl::MutexLock lock(&mu_);
    auto all = [&] { return arrived_[step] == n; };
    mu_.Await(absl::Condition(&all));
  }
  void Open(int step) {
    absl::MutexLock lock(&mu_);
    open_[step] = true;
  }

 private:
  absl::Mutex mu_;
  std::map<int, int> arrived_;
  std::map<int, bool> open_;
};

// One trainer's step, redone as the pool's errors say, at most four times.
absl::StatusOr<StepOutcome> RunStep(PooledClient& pool, int trainer, int step,
                                    const HostTensor& w, Gates* gates) {
  const std::string acc = AccOf(trainer, step);
  const std::string name = absl::StrCat("t", trainer, "-w");
  StepOutcome out;
  bool put = true, gated = false;
  absl::Status last;
  for (out.attempts = 1; out.attempts <= 4; ++out.attempts) {
    if (put) {
      absl::StatusOr<PutWeightsResult> p = pool.PutWeights(name, w, nullptr);
      if (!p.ok()) return p.status();
      put = false;
    }
    out.losses.clear();
    absl::Status s;
    for (uint32_t mb = 0; mb < kMicroBatches && s.ok(); ++mb) {
      ComputeRequest r = PoolMicroBatch(SeedOf(trainer, step, mb));
      r.weight_handle = name;
      r.accumulator = acc;
      absl::StatusOr<ComputeResult> got = pool.Compute(r);
      s = got.status();
      if (got.ok()) out.losses.push_back(got->loss);
      if (got.ok() && mb == 0 && step > 0 && !gated) {
        gated = true;
        gates->Arrive(step);
      }
    }
    absl::StatusOr<FetchGradientsResult> sum = absl::UnknownError("not fetched");
    if (s.ok()) {
      sum = pool.FetchGradients(acc, true);
      s = sum.status();
    }
    if (s.ok()) {
      out.sum = *std::move(sum);
      if (absl::Status d = pool.DropAccumulator(acc); !d.ok()) return d;
      return out;
    }
    last = s;
    if (s.code() == absl::StatusCode::kFailedPrecondition &&
        absl::StrContains(s.message(), "PutWeights(")) {
      put = true;  // W must be supplied again
    } else if (s.code() != absl::StatusCode::kAborted) {
      return s;
    }
    if (absl::Status d = pool.DropAccumulator(acc); !d.ok()) return d;
  }
  return last;
}

TEST_F(PoolTest, TrainersFinishExactlyThroughAStoppedAndARestartedReplica) {
  // The replica stopped in step 1 holds the most step-1 accumulators; the one restarted in
  // step 2 the most step-2 accumulators among the others.
  std::map<int, int> step1, step2;
  for (int t = 0; t < kTrainers; ++t) ++step1[IndexOf(Order(AccumulatorKey(AccOf(t, 1)))[0])];
  int stopped = 0;
  for (const auto& [i, n] : step1) stopped = n > step1[stopped] ? i : stopped;
  auto home_without = [&](const std::string& key, int gone) {
    for (const std::string& e : Order(key)) {
      if (IndexOf(e) != gone) return IndexOf(e);
    }
    return -1;
  };
  for (int t = 0; t < kTrainers; ++t) ++step2[home_without(AccumulatorKey(AccOf(t, 2)), stopped)];
  int restarted = stopped == 0 ? 1 : 0;
  for (const auto& [i, n] : step2) restarted = n > step2[restarted] ? i : restarted;
  ASSERT_NE(stopped, restarted);
  const int want_lost = step1[stopped] + step2[restarted];
  ASSERT_GT(step1[stopped], 0);
  ASSERT_GT(step2[restarted], 0);

  std::vector<std::unique_ptr<PooledClient>> pools;
  for (int t = 0; t < kTrainers; ++t) pools.push_back(NewPool(t));
  std::vector<std::vector<HostTensor>> weights(kTrainers);
  for (int t = 0; t < kTrainers; ++t) {
    for (int s = 0; s < kSteps; ++s) weights[t].push_back(WeightsOf(t, s));
  }
  Gates gates;
  std::vector<std::vector<absl::StatusOr<StepOutcome>>> outcomes(kTrainers);
  std::vector<std::thread> threads;
  for (int t = 0; t < kTrainers; ++t) {
    threads.emplace_back([&, t] {
      for (int s = 0; s < kSteps; ++s) {
        outcomes[t].push_back(RunStep(*pools[t], t, s, weights[t][s], &gates));
        if (!outcomes[t].back().ok()) {  // let the others through the gates it will miss
          for (int g = s + 1; g < kSteps; ++g) gates.Arrive(g);
          return;
        }
      }
    });
  }
  gates.AwaitAll(1, kTrainers);
  Stop(stopped);
  gates.Open(1);
  gates.AwaitAll(2, kTrainers);
  Restart(restarted);
  gates.Open(2);
  for (auto& th : threads) th.join();

  uint64_t lost = 0;
  for (int t = 0; t < kTrainers; ++t) {
    lost += pools[t]->counters().steps_lost;
    ASSERT_EQ(outcomes[t].size(), static_cast<size_t>(kSteps)) << "trainer " << t;
    for (int s = 0; s < kSteps; ++s) {
      const absl::StatusOr<StepOutcome>& got = outcomes[t][s];
      ASSERT_TRUE(got.ok()) << "trainer " << t << " step " << s << ": " << got.status();
      const FetchGradientsResult want = [&] {
        const HostTensor& w = weights[t][s];
        for (uint32_t mb = 0; mb < kMicroBatches; ++mb) {
          ComputeRequest r = PoolMicroBatch(SeedOf(t, s, mb));
          r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
          r.accumulator = "reference";
          absl::StatusOr<ComputeResult> ref = reference_->Compute(r);
          EXPECT_TRUE(ref.ok()) << ref.status();
          if (ref.ok()) EXPECT_EQ(got->losses.at(mb), ref->loss) << t << "/" << s << "/" << mb;
        }
        return *reference_->FetchGradients("reference", true);
      }();
      EXPECT_EQ(got->sum.micro_batches, kMicroBatches) << "trainer " << t << " step " << s;
      EXPECT_EQ(got->sum.tokens, want.tokens);
      EXPECT_EQ(PoolMismatch(&got->sum.dw, &want.dw), "") << "trainer " << t << " step " << s;
    }
    // Exactly the trainers whose accumulator was on the stopped replica (in step 1) or the
    // restarted one (in step 2) redid that step, once. (A trainer whose pool had not yet
    // heard of the stopped replica may have begun its step-2 accumulator there: empty, it
    // moved on quietly.)
    const bool hit1 = IndexOf(Order(AccumulatorKey(AccOf(t, 1)))[0]) == stopped;
    const bool hit2 = home_without(AccumulatorKey(AccOf(t, 2)), stopped) == restarted;
    EXPECT_EQ(outcomes[t][0]->attempts, 1) << "trainer " << t;
    EXPECT_EQ(outcomes[t][1]->attempts, hit1 ? 2 : 1) << "trainer " << t;
    EXPECT_EQ(outcomes[t][2]->attempts, hit2 ? 2 : 1) << "trainer " << t;
  }
  EXPECT_EQ(lost, static_cast<uint64_t>(want_lost));
  EXPECT_EQ(Logged("was on replica"), want_lost);  // each loss logged once
  if (HasFailure()) {
    absl::MutexLock lock(&log_mu_);
    for (const std::string& l : log_) std::cerr << "pool log: " << l << "\n";
  }
}

}  // namespace
}  // namespace client
}  // namespace lossd
