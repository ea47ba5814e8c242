// SPDX-License-Identifier: Apache-2.0
// The engine's request checks: each refusal names the client's field, with its shape printed
// bounded, and the ids echoed in messages are bounded too.
#include "engine/request_checks.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace {

TensorDesc Desc(DType dtype, std::vector<int64_t> shape) {
  TensorDesc t;
  t.present = true;
  t.dtype = dtype;
  t.shape = std::move(shape);
  return t;
}

void ExpectRefused(const absl::Status& s, absl::StatusCode code, const std::string& message) {
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_EQ(s.message(), message);
}

TEST(RequestChecksTest, ShapesNeedTheirRankPositiveDimensionsAndABoundedCount) {
  EXPECT_TRUE(CheckShape(Desc(DType::kF32, {4, 8}), "x", 2).ok());
  EXPECT_EQ(NumElements({4, 8}), 32u);
  ExpectRefused(CheckShape(Desc(DType::kF32, {4}), "x", 2), absl::StatusCode::kInvalidArgument,
                "x.shape must have 2 dimensions, got [4]");
  ExpectRefused(CheckShape(Desc(DType::kF32, {4, 0}), "w", 2),
                absl::StatusCode::kInvalidArgument, "w.shape [4, 0] has a dimension <= 0");
  ExpectRefused(CheckShape(Desc(DType::kF32, {1 << 21, 1 << 20}), "w", 2),
                absl::StatusCode::kInvalidArgument, "w.shape [2097152, 1048576] is too large");
}

TEST(RequestChecksTest, FloatDTypesOnly) {
  EXPECT_TRUE(CheckFloatDType(Desc(DType::kBF16, {1}), "x").ok());
  ExpectRefused(CheckFloatDType(Desc(DType::kI64, {1}), "bias"),
                absl::StatusCode::kInvalidArgument,
                "bias.dtype must be bf16, fp16 or fp32, got int64");
}

TEST(RequestChecksTest, IdsLongerThanAnyIssuedAreRefusedWithoutEchoingThem) {
  EXPECT_TRUE(CheckIdLength(std::string(kMaxIdLength, 'a'), "handle").ok());
  ExpectRefused(CheckIdLength(std::string(kMaxIdLength + 1, 'a'), "handle"),
                absl::StatusCode::kInvalidArgument,
                "handle is 129 characters long, more than any issued (128)");
}

TEST(RequestChecksTest, APartialSumIsAFailedPrecondition) {
  ExpectRefused(PartialSumError("acc"), absl::StatusCode::kFailedPrecondition,
                "accumulator 'acc' may hold a partial sum: a micro-batch failed while adding "
                "into it; drop it and redo the step");
}

}  // namespace
}  // namespace lossd
