// SPDX-License-Identifier: Apache-2.0
// Tests the idle TTL sweep: state named within the TTL stays, state left alone past it is
// dropped by the timer thread and logged (kind, name, size, idle time, the flag), and the
// sweep stops promptly when destroyed.
#include "service/idle_state_sweep.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "engine/engine.h"

namespace lossd {
namespace {

std::string Upload(Engine& e) {
  TensorDesc w;
  w.present = true;
  w.dtype = DType::kF32;
  w.shape = {3, 2};
  auto p = e.BeginPutWeights(w, TensorDesc{}, "token:0");
  EXPECT_TRUE(p.ok()) << p.status();
  const float data[6] = {0.5f, -1.25f, 2.0f, 0.75f, -0.125f, 3.5f};
  EXPECT_TRUE(e.WriteWeights(**p, false, 0, data, sizeof(data)).ok());
  auto h = e.CommitWeights(std::move(*p));
  EXPECT_TRUE(h.ok()) << h.status();
  return *h;
}

TEST(IdleStateSweepTest, DropsWhatIsIdlePastTheTtlAndLogsIt) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  const std::string handle = Upload(e);
  absl::Mutex mu;
  std::vector<std::string> lines;
  {
    IdleStateSweep sweep(
        &e, absl::Milliseconds(300),
        [&](const std::string& l) {
          absl::MutexLock lock(&mu);
          lines.push_back(l);
        },
        absl::Milliseconds(20));
    // Named within the TTL: kept.
    for (int i = 0; i < 5; ++i) {
      absl::SleepFor(absl::Milliseconds(100));
      ASSERT_TRUE(e.weights().Get(handle).ok()) << "dropped while in use, after " << i;
    }
    // Left alone: gone within the TTL and a few sweeps.
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (!e.ListState("token:0").empty() && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_TRUE(e.ListState("token:0").empty());
  }
  EXPECT_EQ(e.weights().Get(handle).status().code(), absl::StatusCode::kNotFound);
  absl::MutexLock lock(&mu);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("dropped weight handle " + handle + " (24 bytes, idle "),
            std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].find("unused for longer than --state_idle_ttl=300ms"), std::string::npos)
      << lines[0];
}

TEST(IdleStateSweepTest, StopsPromptlyWithALongPeriod) {
  Engine e(NewCpuBackend(1), EngineOptions{});
  const absl::Time start = absl::Now();
  { IdleStateSweep sweep(&e, absl::Hours(1), [](const std::string&) {}); }
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

}  // namespace
}  // namespace lossd
