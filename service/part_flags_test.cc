// SPDX-License-Identifier: Apache-2.0
#include "service/part_flags.h"

#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace {

void ExpectRefused(const absl::StatusOr<uint32_t>& r, const std::string& substring) {
  ASSERT_FALSE(r.ok()) << *r;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(substring), std::string::npos) << r.status();
}

// --max_part_bytes=65536 alone refused to start: the default --response_part_bytes (4 MiB)
// was above it.
TEST(PartFlagsTest, TheDefaultResponsePartFollowsASmallerMaxPart) {
  auto r = CheckPartFlags(65536, 4u << 20, /*response_part_given=*/false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, 65536u);
  EXPECT_EQ(*CheckPartFlags(16u << 20, 4u << 20, false), 4u << 20);
  EXPECT_EQ(*CheckPartFlags(1024, 4u << 20, false), 1024u);
}

TEST(PartFlagsTest, GivenValuesAreCheckedNamingTheFlagToChange) {
  EXPECT_EQ(*CheckPartFlags(65536, 65536, true), 65536u);
  EXPECT_EQ(*CheckPartFlags(65536, 1024, true), 1024u);
  ExpectRefused(CheckPartFlags(65536, 4u << 20, true),
                "--response_part_bytes=4194304 exceeds --max_part_bytes=65536: set "
                "--response_part_bytes to at most 65536");
  ExpectRefused(CheckPartFlags(65536, 1023, true),
                "--response_part_bytes must be at least 1024, got 1023");
  ExpectRefused(CheckPartFlags(1023, 4u << 20, false),
                "--max_part_bytes must be in [1024, 1073741824], got 1023");
  ExpectRefused(CheckPartFlags((1u << 30) + 1, 4u << 20, false),
                "--max_part_bytes must be in [1024, 1073741824], got 1073741825");
}

}  // namespace
}  // namespace lossd
