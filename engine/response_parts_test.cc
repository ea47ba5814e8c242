// SPDX-License-Identifier: Apache-2.0
#include "engine/response_parts.h"

#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(ResponsePartsTest, ZeroIsTheDefaultAndLargeIsCapped) {
  EXPECT_EQ(*ResponsePartBytes(0, 4096, 1 << 20, "f"), 4096u);
  EXPECT_EQ(*ResponsePartBytes(1024, 4096, 1 << 20, "f"), 1024u);
  EXPECT_EQ(*ResponsePartBytes(5000, 4096, 1 << 20, "f"), 5000u);
  EXPECT_EQ(*ResponsePartBytes(1u << 30, 4096, 1 << 20, "f"), 1u << 20);
}

TEST(ResponsePartsTest, BelowTheFloorIsRefusedNamingTheFieldAndTheValues) {
  for (uint32_t asked : {1u, 13u, 1023u}) {
    auto n = ResponsePartBytes(asked, 4096, 1 << 20, "header.response_part_bytes");
    ASSERT_FALSE(n.ok()) << asked;
    EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(n.status().message().find(
                  "header.response_part_bytes must be 0 (the server's default, 4096) or at "
                  "least 1024, got " + std::to_string(asked)),
              std::string::npos)
        << n.status();
  }
}

}  // namespace
}  // namespace lossd
