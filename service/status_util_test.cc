// SPDX-License-Identifier: Apache-2.0
#include "service/status_util.h"

#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TEST(StatusUtilTest, EveryCodeMapsToItsGrpcTwinWithTheMessage) {
  const std::vector<std::pair<absl::Status, grpc::StatusCode>> cases = {
      {absl::CancelledError("m1"), grpc::StatusCode::CANCELLED},
      {absl::UnknownError("m2"), grpc::StatusCode::UNKNOWN},
      {absl::InvalidArgumentError("m3"), grpc::StatusCode::INVALID_ARGUMENT},
      {absl::DeadlineExceededError("m4"), grpc::StatusCode::DEADLINE_EXCEEDED},
      {absl::NotFoundError("m5"), grpc::StatusCode::NOT_FOUND},
      {absl::AlreadyExistsError("m6"), grpc::StatusCode::ALREADY_EXISTS},
      {absl::PermissionDeniedError("m7"), grpc::StatusCode::PERMISSION_DENIED},
      {absl::ResourceExhaustedError("m8"), grpc::StatusCode::RESOURCE_EXHAUSTED},
      {absl::FailedPreconditionError("m9"), grpc::StatusCode::FAILED_PRECONDITION},
      {absl::AbortedError("m10"), grpc::StatusCode::ABORTED},
      {absl::OutOfRangeError("m11"), grpc::StatusCode::OUT_OF_RANGE},
      {absl::UnimplementedError("m12"), grpc::StatusCode::UNIMPLEMENTED},
      {absl::InternalError("m13"), grpc::StatusCode::INTERNAL},
      {absl::UnavailableError("m14"), grpc::StatusCode::UNAVAILABLE},
      {absl::DataLossError("m15"), grpc::StatusCode::DATA_LOSS},
      {absl::UnauthenticatedError("m16"), grpc::StatusCode::UNAUTHENTICATED},
  };
  for (const auto& [in, want] : cases) {
    grpc::Status out = ToGrpcStatus(in);
    EXPECT_EQ(out.error_code(), want) << in;
    EXPECT_EQ(out.error_message(), std::string(in.message()));
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

// Whatever a message echoes, the wire carries at most about 1 KiB of it: a status travels in
// trailing metadata, which a client with default options refuses past 16 KiB.
TEST(StatusUtilTest, LongMessagesAreCutToTheBound) {
  const grpc::Status out =
      ToGrpcStatus(absl::InvalidArgumentError("x.shape " + std::string(600000, '1')));
  EXPECT_EQ(out.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(out.error_message().size(), 1024u);
  EXPECT_EQ(out.error_message().substr(0, 8), "x.shape ");
  EXPECT_NE(out.error_message().find("... (600008 bytes in all)"), std::string::npos);
}

TEST(StatusUtilTest, CodeNames) {
  EXPECT_STREQ(GrpcCodeName(grpc::StatusCode::OK), "OK");
  EXPECT_STREQ(GrpcCodeName(grpc::StatusCode::INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_STREQ(GrpcCodeName(grpc::StatusCode::RESOURCE_EXHAUSTED), "RESOURCE_EXHAUSTED");
}

}  // namespace
}  // namespace lossd
