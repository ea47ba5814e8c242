// The early returns of core/status_macros.h: an error comes back unchanged, an OK value goes on.
#include "core/status_macros.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace lossd {
namespace {

absl::Status PassOn(absl::Status s, int* reached) {
  LOSSD_RETURN_IF_ERROR(s);
  ++*reached;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<int>> MakeInt(bool ok) {
  if (!ok) return absl::NotFoundError("no int");
  return std::make_unique<int>(7);
}

// Declares the target, and assigns an existing one, twice in one scope (two hidden names).
absl::StatusOr<int> Sum(bool first_ok, bool second_ok) {
  LOSSD_ASSIGN_OR_RETURN(auto a, MakeInt(first_ok));  // move-only values move
  std::unique_ptr<int> b;
  LOSSD_ASSIGN_OR_RETURN(b, MakeInt(second_ok));
  return *a + *b;
}

TEST(StatusMacrosTest, ReturnIfErrorReturnsTheErrorUnchanged) {
  int reached = 0;
  const absl::Status s = PassOn(absl::AbortedError("stop here"), &reached);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(s.message(), "stop here");
  EXPECT_EQ(reached, 0);
  EXPECT_TRUE(PassOn(absl::OkStatus(), &reached).ok());
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacrosTest, AssignOrReturnAssignsOrReturnsTheError) {
  absl::StatusOr<int> ok = Sum(true, true);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, 14);
  for (const auto& [first, second] : {std::pair{false, true}, std::pair{true, false}}) {
    absl::StatusOr<int> failed = Sum(first, second);
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(failed.status().message(), "no int");
  }
}

}  // namespace
}  // namespace lossd
