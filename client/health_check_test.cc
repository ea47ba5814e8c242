// SPDX-License-Identifier: Apache-2.0
#include "client/health_check.h"

#include <string>

#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

TEST(HealthCheckTest, RequestBytes) {
  EXPECT_EQ(EncodeHealthCheckRequest(""), "");
  EXPECT_EQ(EncodeHealthCheckRequest("lossd.v1.Loss"), std::string("\x0a\x0dlossd.v1.Loss"));
}

TEST(HealthCheckTest, ResponseStatuses) {
  EXPECT_EQ(*DecodeHealthCheckResponse(""), "UNKNOWN");
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x01", 2)), "SERVING");
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x02", 2)), "NOT_SERVING");
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x03", 2)), "SERVICE_UNKNOWN");
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x08\x07", 2)), "status 7");
  // An unknown field before the status is skipped.
  EXPECT_EQ(*DecodeHealthCheckResponse(std::string("\x12\x02hi\x08\x01", 6)), "SERVING");
}

TEST(HealthCheckTest, MalformedResponsesAreInternal) {
  for (const std::string& bad : {std::string("\x08", 1), std::string("\x12\x05hi", 4),
                                 std::string("\x08\xff\xff", 3)}) {
    EXPECT_EQ(DecodeHealthCheckResponse(bad).status().code(), absl::StatusCode::kInternal)
        << testing::PrintToString(bad);
  }
}

}  // namespace
}  // namespace client
}  // namespace lossd
