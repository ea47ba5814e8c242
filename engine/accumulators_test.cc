// SPDX-License-Identifier: Apache-2.0
#include "engine/accumulators.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace lossd {
namespace {

// dW of (V=10, H=10) fp32 and db of (V=10): 440 bytes.
constexpr uint64_t kAccBytes = 10 * 10 * 4 + 10 * 4;

TEST(AccumulatorStoreTest, CreatesOnceAndRefusesAnotherShape) {
  auto backend = NewCpuBackend(1);
  AccumulatorStore store(backend.get(), 2 * kAccBytes, 4);
  auto a = store.GetOrCreate("a", 10, 10, true);
  ASSERT_TRUE(a.ok()) << a.status();
  auto again = store.GetOrCreate("a", 10, 10, true);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(a->get(), again->get());
  auto other = store.GetOrCreate("a", 10, 11, true);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(other.status().message().find("holds dW of shape (V=10, H=10)"), std::string::npos)
      << other.status();
  EXPECT_EQ(store.count(), 1u);
  EXPECT_EQ(store.bytes(), kAccBytes);
}

// A dropped accumulator that a running call still holds keeps its memory, so its bytes stay
// charged to --accumulator_bytes until the last holder lets go; a new one that fits only in
// the dropped one's place is refused until then.
TEST(AccumulatorStoreTest, ADroppedAccumulatorStillHeldKeepsItsBytesCharged) {
  auto backend = NewCpuBackend(1);
  AccumulatorStore store(backend.get(), kAccBytes, 4);
  auto created = store.GetOrCreate("old", 10, 10, true);
  ASSERT_TRUE(created.ok()) << created.status();
  std::shared_ptr<Accumulator> held = std::move(*created);  // as a running Compute holds it
  ASSERT_TRUE(store.Drop("old").ok());
  EXPECT_EQ(store.count(), 0u);           // no longer named
  EXPECT_EQ(store.bytes(), kAccBytes);    // but its memory is still held

  EXPECT_EQ(store.Check("new", 10, 10, true).code(), absl::StatusCode::kResourceExhausted);
  auto refused = store.GetOrCreate("new", 10, 10, true);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--accumulator_bytes"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("dropped"), std::string::npos) << refused.status();

  held.reset();  // the call ends: the memory is freed, and its bytes come back
  EXPECT_EQ(store.bytes(), 0u);
  auto accepted = store.GetOrCreate("new", 10, 10, true);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(store.count(), 1u);
  EXPECT_EQ(store.bytes(), kAccBytes);
}

TEST(AccumulatorStoreTest, DroppingTheLastReferenceFreesAtOnce) {
  auto backend = NewCpuBackend(1);
  AccumulatorStore store(backend.get(), kAccBytes, 4);
  ASSERT_TRUE(store.GetOrCreate("a", 10, 10, true).ok());
  ASSERT_TRUE(store.Drop("a").ok());
  EXPECT_EQ(store.bytes(), 0u);
  EXPECT_EQ(store.Drop("a").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store.GetOrCreate("b", 10, 10, true).ok());
}

// The accounting outlives the store: an accumulator let go after the store is gone is safe.
TEST(AccumulatorStoreTest, AnAccumulatorMayOutliveItsStore) {
  auto backend = NewCpuBackend(1);
  std::shared_ptr<Accumulator> held;
  {
    AccumulatorStore store(backend.get(), kAccBytes, 4);
    auto a = store.GetOrCreate("a", 10, 10, true);
    ASSERT_TRUE(a.ok()) << a.status();
    held = std::move(*a);
  }
  held.reset();
}

}  // namespace
}  // namespace lossd
