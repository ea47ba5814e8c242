// SPDX-License-Identifier: Apache-2.0
// The client's wire conversions: dtypes both ways, tensor names in messages, and the
// outgoing parts of a tensor (whole elements, in byte order, covering it exactly).
#include "client/client_wire.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace lossd {
namespace client {
namespace {

TEST(ClientWireTest, DTypesRoundTrip) {
  for (DType t : {DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64}) {
    absl::StatusOr<DType> back = FromProto(ToProto(t));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, t);
  }
  EXPECT_EQ(ToProto(DType::kBF16), v1::DTYPE_BF16);
  EXPECT_EQ(ToProto(DType::kI64), v1::DTYPE_INT64);
}

TEST(ClientWireTest, AnUnknownDTypeIsInternalNamingIt) {
  absl::StatusOr<DType> t = FromProto(static_cast<v1::DType>(99));
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(t.status().message(), "server sent an unknown dtype 99");
  EXPECT_FALSE(FromProto(v1::DTYPE_UNSPECIFIED).ok());
}

TEST(ClientWireTest, TensorIdNames) {
  EXPECT_EQ(TensorIdName(static_cast<int32_t>(OutputTensor::kDx)), "dx");
  EXPECT_EQ(TensorIdName(v1::TENSOR_X), "tensor#1");
}

TEST(ClientWireTest, PartsAreWholeElementsInByteOrder) {
  // 7 fp32 values in parts of at most 10 bytes: 8, 8, 8, 4 (never half an element).
  std::vector<float> data(7, 1.0f);
  const HostTensor t = HostTensor::View(DType::kF32, {7}, data.data());
  wire::SliceTracker tracker;
  std::vector<grpc::ByteBuffer> out;
  uint64_t bytes = 0;
  AppendParts(v1::TENSOR_X, t, 10, &tracker, &out, &bytes);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(bytes, 28u);
  std::vector<uint64_t> offsets;
  for (const grpc::ByteBuffer& b : out) {
    wire::StreamFrame f;
    ASSERT_TRUE(f.Parse(b).ok());
    ASSERT_EQ(f.kind(), wire::StreamFrame::Kind::kPart);
    EXPECT_EQ(f.tensor(), v1::TENSOR_X);
    offsets.push_back(f.offset());
  }
  EXPECT_EQ(offsets, (std::vector<uint64_t>{0, 8, 16, 24}));
  // A range [8, 20): the offsets stay offsets into the tensor.
  out.clear();
  AppendRange(v1::TENSOR_W, t, 8, 20, 1 << 20, &tracker, &out, &bytes);
  ASSERT_EQ(out.size(), 1u);
  wire::StreamFrame f;
  ASSERT_TRUE(f.Parse(out[0]).ok());
  EXPECT_EQ(f.offset(), 8u);
  EXPECT_EQ(f.data_size(), 12u);
  EXPECT_EQ(bytes, 40u);
  out.clear();
}

}  // namespace
}  // namespace client
}  // namespace lossd
