// SPDX-License-Identifier: Apache-2.0
// TrickleRows (test_util.h): X's rows released to a streamed compute in uneven steps from a
// thread of its own, and the checks of what the compute asked for.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "core/dtype.h"
#include "core/loss_problem.h"
#include "testing/test_util.h"

namespace lossd {

TrickleRows::TrickleRows(const void* x, int64_t bt, size_t row_bytes, const Spec& spec)
    : bt_(bt), row_bytes_(row_bytes), spec_(spec),
      real_(static_cast<const uint8_t*>(x), static_cast<const uint8_t*>(x) + bt * row_bytes),
      buf_(bt * row_bytes, 0xFF) {
  thread_ = std::thread([this] { Release(); });
}

TrickleRows::TrickleRows(const LossProblem& whole, const Spec& spec)
    : TrickleRows(whole.x, whole.bt, whole.h * DTypeSize(whole.dtype), spec) {}

TrickleRows::~TrickleRows() { thread_.join(); }

void TrickleRows::Release() {
  const int64_t last = spec_.fail_after >= 0 ? std::min(spec_.fail_after, bt_) : bt_;
  // Uneven steps: distinct random cuts in [1, last), then `last` itself.
  std::mt19937_64 rng(spec_.seed);
  std::vector<int64_t> cuts;
  if (last > 1) {
    std::uniform_int_distribution<int64_t> any(1, last - 1);
    for (int k = 0; k + 1 < spec_.steps && static_cast<int64_t>(cuts.size()) < last - 1; ++k) {
      int64_t c = any(rng);
      while (std::find(cuts.begin(), cuts.end(), c) != cuts.end()) c = any(rng);
      cuts.push_back(c);
    }
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(last);
  int64_t from = 0;
  for (int64_t to : cuts) {
    absl::SleepFor(spec_.pause);
    if (to > from) {
      std::memcpy(buf_.data() + from * row_bytes_, real_.data() + from * row_bytes_,
                  (to - from) * row_bytes_);
    }
    absl::MutexLock lock(&mu_);
    released_ = to;
    from = to;
  }
  absl::MutexLock lock(&mu_);
  done_ = true;
}

absl::Status TrickleRows::WaitX(int64_t rows) {
  absl::MutexLock lock(&mu_);
  waits_.push_back(rows);
  auto arrived = [&] { return released_ >= rows || done_; };
  mu_.Await(absl::Condition(&arrived));
  if (released_ >= rows) return absl::OkStatus();
  return spec_.failure;
}

void TrickleRows::DxReady(int64_t rows) {
  absl::MutexLock lock(&mu_);
  dx_ready_.push_back(rows);
}

std::vector<int64_t> TrickleRows::waits() const {
  absl::MutexLock lock(&mu_);
  return waits_;
}

std::vector<int64_t> TrickleRows::dx_ready() const {
  absl::MutexLock lock(&mu_);
  return dx_ready_;
}

::testing::AssertionResult TrickleRows::CallsAreValid(int64_t bt, size_t dx_calls) const {
  const std::vector<int64_t> w = waits(), d = dx_ready();
  if (w.empty()) return ::testing::AssertionFailure() << "WaitX was never called";
  for (size_t i = 0; i < w.size(); ++i) {
    if ((i > 0 && w[i] < w[i - 1]) || w[i] > bt) {
      return ::testing::AssertionFailure()
             << "WaitX call " << i << " asked for " << w[i] << " rows (before: "
             << (i > 0 ? w[i - 1] : 0) << ", BT " << bt << ")";
    }
  }
  if (w.back() != bt) {
    return ::testing::AssertionFailure() << "the last WaitX asked for " << w.back() << " of "
                                         << bt << " rows";
  }
  if (d.size() != dx_calls) {
    return ::testing::AssertionFailure() << d.size() << " DxReady calls, expected " << dx_calls;
  }
  for (size_t i = 0; i < d.size(); ++i) {
    if (d[i] <= (i > 0 ? d[i - 1] : 0)) {
      return ::testing::AssertionFailure() << "DxReady call " << i << " reported " << d[i]
                                           << " rows after " << (i > 0 ? d[i - 1] : 0);
    }
  }
  if (!d.empty() && d.back() != bt) {
    return ::testing::AssertionFailure() << "the last DxReady reported " << d.back() << " of "
                                         << bt << " rows";
  }
  return ::testing::AssertionSuccess();
}

void TrickleRows::Drain() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&done_));
}

std::unique_ptr<TrickleRows> ExpectComputeEndsWithTheFailedWait(
    const std::function<absl::Status(const LossProblem&, const LossOutputs&)>& compute,
    const LossProblem& whole, const absl::Status& failure, int64_t fail_after) {
  TrickleRows::Spec ts;
  ts.fail_after = fail_after;
  ts.failure = failure;
  auto rows = std::make_unique<TrickleRows>(whole, ts);
  const LossProblem streamed = rows->Streamed(whole);
  HostOutputs got(whole, DType::kBF16);
  const absl::Status st = compute(streamed, got.outputs());
  EXPECT_EQ(st.code(), failure.code()) << "after " << fail_after << ": " << st;
  EXPECT_EQ(st.message(), failure.message()) << "after " << fail_after;
  // The chunk that asked past the released rows was the last one read.
  const std::vector<int64_t> waits = rows->waits();
  EXPECT_FALSE(waits.empty()) << "after " << fail_after;
  if (!waits.empty()) {
    EXPECT_GT(waits.back(), fail_after);
  }
  for (int64_t r : rows->dx_ready()) EXPECT_LE(r, fail_after) << "after " << fail_after;
  return rows;
}

}  // namespace lossd
