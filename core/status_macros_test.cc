// SPDX-License-Identifier: Apache-2.0
// The status macros: an error returns at once, an OK status or value goes on.
#include "core/status_macros.h"

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

absl::Status Steps(absl::Status first, int* reached) {
  LOSSD_RETURN_IF_ERROR(first);
  ++*reached;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(bool ok) {
  if (!ok) return absl::NotFoundError("no int");
  return std::make_unique<int>(7);
}

absl::StatusOr<int> Doubled(bool ok) {
  LOSSD_ASSIGN_OR_RETURN(std::unique_ptr<int> p, MakeInt(ok));  // move-only values too
  int twice = 0;
  LOSSD_ASSIGN_OR_RETURN(twice, absl::StatusOr<int>(2 * *p));   // an existing lvalue
  return twice;
}

TEST(StatusMacrosTest, ReturnIfErrorStopsAtTheFirstError) {
  int reached = 0;
  EXPECT_TRUE(Steps(absl::OkStatus(), &reached).ok());
  EXPECT_EQ(reached, 1);
  absl::Status s = Steps(absl::InvalidArgumentError("bad x"), &reached);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "bad x");
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, AssignOrReturnMovesTheValueOrReturnsTheStatus) {
  absl::StatusOr<int> good = Doubled(true);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(*good, 14);
  absl::StatusOr<int> bad = Doubled(false);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bad.status().message(), "no int");
}

}  // namespace
}  // namespace lossd
