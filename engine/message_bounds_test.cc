// SPDX-License-Identifier: Apache-2.0
#include "engine/message_bounds.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(MessageBoundsTest, ShortShapesAreShownWhole) {
  EXPECT_EQ(ShapeText({}), "[]");
  EXPECT_EQ(ShapeText({4, 8}), "[4, 8]");
  EXPECT_EQ(ShapeText({1, 2, 3, 4, 5, 6, 7, 8}), "[1, 2, 3, 4, 5, 6, 7, 8]");
}

TEST(MessageBoundsTest, LongShapesShowTheirFirstDimsAndRank) {
  std::vector<int64_t> shape(200000, 1);
  shape[0] = 1234567890123;
  const std::string text = ShapeText(shape);
  EXPECT_EQ(text, "[1234567890123, 1, 1, 1, 1, 1, 1, 1, ... (200000 dims)]");
  std::vector<int64_t> nine(9, -9223372036854775807 - 1);
  EXPECT_LE(ShapeText(nine).size(), 8 * 22 + 24u) << ShapeText(nine);
}

TEST(MessageBoundsTest, LongStringsShowTheirStartAndLength) {
  EXPECT_EQ(ClippedText("step-1"), "step-1");
  const std::string s(1 << 20, 'a');
  EXPECT_EQ(ClippedText(s), std::string(64, 'a') + "... (1048576 bytes)");
}

TEST(MessageBoundsTest, StatusMessagesAreCutNearOneKiB) {
  const absl::Status small = absl::InvalidArgumentError("x.shape is wrong");
  EXPECT_EQ(BoundedStatus(small), small);
  const absl::Status exact = absl::NotFoundError(std::string(kMaxStatusMessageBytes, 'm'));
  EXPECT_EQ(BoundedStatus(exact), exact);
  const absl::Status big =
      absl::ResourceExhaustedError("request refused: " + std::string(600000, 'z'));
  const absl::Status cut = BoundedStatus(big);
  EXPECT_EQ(cut.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cut.message().size(), kMaxStatusMessageBytes);
  EXPECT_EQ(cut.message().substr(0, 17), "request refused: ");
  EXPECT_NE(cut.message().find("... (600017 bytes in all)"), std::string::npos) << cut;
}

TEST(MessageBoundsTest, HeadersOverTheBoundAreRefusedWithTheirSize) {
  EXPECT_TRUE(CheckHeaderBytes(kMaxHeaderBytes, "the Compute header").ok());
  const absl::Status s = CheckHeaderBytes(kMaxHeaderBytes + 1, "the Compute header");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("the Compute header is 65537 bytes, more than the 65536 a header "
                             "may have"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace lossd
