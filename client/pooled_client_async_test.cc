// SPDX-License-Identifier: Apache-2.0
// Tests PooledClient::ComputeAsync against three real replicas (pool_test_fixture.h): a call's
// result is the synchronous Compute's; calls into an accumulator go to its replica and, one
// in flight at a time, sum to the single server's bytes; several in flight at once sum to it
// within fp32 rounding of the order; errors are Compute's; the callback form runs off the
// caller's thread.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "testing/client/pool_test_fixture.h"

namespace lossd {
namespace client {
namespace {

using ::testing::HasSubstr;
using Result = absl::StatusOr<ComputeResult>;
constexpr auto kLong = std::chrono::seconds(120);

TEST_F(PoolTest, ComputeAsyncGivesComputesResult) {
  const HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 3, 0.5f);
  ComputeRequest r = PoolMicroBatch(1);
  r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
  std::future<Result> fut = pool_->ComputeAsync(r);
  ASSERT_EQ(fut.wait_for(kLong), std::future_status::ready);
  Result got = fut.get();
  ASSERT_TRUE(got.ok()) << got.status();
  Result want = pool_->Compute(r);
  ASSERT_TRUE(want.ok()) << want.status();
  EXPECT_EQ(got->loss, want->loss);
  EXPECT_EQ(got->tokens, want->tokens);
  EXPECT_EQ(PoolMismatch(got->Find(OutputTensor::kDx), want->Find(OutputTensor::kDx)), "");
}

// max_in_flight 1: the calls run in the order given, so the accumulator's sum is the single
// server's byte for byte; max_in_flight 2: the same sum within the reordering's rounding.
TEST_F(PoolTest, ComputeAsyncCallsIntoAnAccumulatorSumOnItsReplica) {
  const HostTensor w = UniformTensor(DType::kBF16, {kPoolV, kPoolH}, 5, 0.5f);
  ASSERT_TRUE(pool_->PutWeights("w", w, nullptr).ok());
  for (int in_flight : {1, 2}) {
    std::unique_ptr<PooledClient> pool =
        NewPool(0, [&](PoolOptions* o) { o->client.max_in_flight = in_flight; });
    ASSERT_NE(pool, nullptr);
    ASSERT_TRUE(pool->PutWeights("w", w, nullptr).ok());
    const std::string acc = absl::StrCat("async-", in_flight);
    std::vector<std::future<Result>> calls;
    for (uint32_t mb = 0; mb < 4; ++mb) {
      ComputeRequest r = PoolMicroBatch(100 + mb);
      r.weight_handle = "w";
      r.accumulator = acc;
      calls.push_back(pool->ComputeAsync(std::move(r)));
    }
    for (auto& c : calls) {
      ASSERT_EQ(c.wait_for(kLong), std::future_status::ready);
      Result got = c.get();
      ASSERT_TRUE(got.ok()) << got.status();
    }
    // Every micro-batch went to the accumulator's replica: it alone holds `acc`, with 4.
    for (int i = 0; i < kReplicas; ++i) {
      uint64_t micro_batches = 0;
      bool here = false;
      for (const StateInfo& s : EngineOf(i).accumulators().List("")) {
        if (s.name == acc) here = true, micro_batches = s.micro_batches;
      }
      EXPECT_EQ(here, Endpoint(i) == Order(AccumulatorKey(acc)).front()) << Endpoint(i);
      if (here) EXPECT_EQ(micro_batches, 4u);
    }
    absl::StatusOr<FetchGradientsResult> got = pool->FetchGradients(acc, true);
    ASSERT_TRUE(got.ok()) << got.status();
    for (uint32_t mb = 0; mb < 4; ++mb) {
      ComputeRequest r = PoolMicroBatch(100 + mb);
      r.w = HostTensor::View(w.dtype(), w.shape(), w.data());
      r.accumulator = acc;
      ASSERT_TRUE(reference_->Compute(r).ok());
    }
    absl::StatusOr<FetchGradientsResult> want = reference_->FetchGradients(acc, true);
    ASSERT_TRUE(want.ok()) << want.status();
    if (in_flight == 1) {
      EXPECT_EQ(PoolMismatch(&got->dw, &want->dw), "");
    } else {
      // Four fp32 sums in another order: within a few ulps of the largest element.
      ASSERT_EQ(got->dw.num_bytes(), want->dw.num_bytes());
      const float* g = reinterpret_cast<const float*>(got->dw.data());
      const float* e = reinterpret_cast<const float*>(want->dw.data());
      const size_t n = got->dw.num_bytes() / sizeof(float);
      float largest = 0;
      for (size_t i = 0; i < n; ++i) largest = std::max(largest, std::fabs(e[i]));
      ASSERT_GT(largest, 0.0f);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(g[i], e[i], 4 * largest * 1.2e-7f) << "dW element " << i;
      }
    }
  }
}

TEST_F(PoolTest, ComputeAsyncErrorsAreComputesAndTheCallbackRunsOffTheCallersThread) {
  ComputeRequest r = PoolMicroBatch(6);
  r.weight_handle = "never-put";
  absl::Notification done;
  Result got;
  std::thread::id ran_on;
  pool_->ComputeAsync(r, {}, [&](Result res) {
    got = std::move(res);
    ran_on = std::this_thread::get_id();
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(120)));
  EXPECT_NE(ran_on, std::this_thread::get_id());
  Result want = pool_->Compute(r);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(got.status(), want.status());
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("PutWeights('never-put', W)"));
}

}  // namespace
}  // namespace client
}  // namespace lossd
