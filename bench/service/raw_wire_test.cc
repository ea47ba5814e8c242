// SPDX-License-Identifier: Apache-2.0
#include "bench/service/raw_wire.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "lossd/v1/lossd.pb.h"
#include "testing/byte_buffers.h"

namespace lossd {
namespace bench {
namespace {

// Splits serialized bytes into a buffer of several slices at the given cut points, so parsing
// must cross slice boundaries.
grpc::ByteBuffer Chop(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t at = 0;
  cuts.push_back(bytes.size());
  for (size_t c : cuts) {
    slices.emplace_back(bytes.data() + at, c - at);
    at = c;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<uint8_t>(x);
  }
  return v;
}

TEST(EncodeBorrowedPartTest, ProtobufParsesWhatWeEncode) {
  for (const size_t n : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{70000}}) {
    const std::vector<uint8_t> data = Pattern(n, static_cast<uint32_t>(n));
    const uint64_t offset = (uint64_t{1} << 33) + 5;  // needs a multi-byte varint
    const grpc::ByteBuffer b = EncodeBorrowedPart(v1::TENSOR_W, offset, data.data(), n);
    v1::PutWeightsRequest req;
    ASSERT_TRUE(req.ParseFromString(Flatten(b))) << "size " << n;
    ASSERT_TRUE(req.has_part()) << "size " << n;
    EXPECT_EQ(req.part().tensor(), v1::TENSOR_W);
    EXPECT_EQ(req.part().offset(), offset);
    ASSERT_EQ(req.part().data().size(), n);
    EXPECT_EQ(std::memcmp(req.part().data().data(), data.data(), n), 0) << "size " << n;
  }
}

TEST(ReceivedFrameTest, PartAcrossSlicesIsCopiedExactly) {
  const std::vector<uint8_t> data = Pattern(5000, 7);
  v1::FetchGradientsResponse msg;
  msg.mutable_part()->set_tensor(v1::TENSOR_DW);
  msg.mutable_part()->set_offset(123456789);
  msg.mutable_part()->set_data(data.data(), data.size());
  const std::string bytes = msg.SerializeAsString();
  // Cuts inside the tags, inside a varint, and inside the data.
  for (const std::vector<size_t>& cuts :
       std::vector<std::vector<size_t>>{{}, {1}, {2, 3}, {4, 9}, {10, 11, 2000, 4999}}) {
    ReceivedFrame f;
    ASSERT_TRUE(f.Parse(Chop(bytes, cuts)).ok());
    ASSERT_EQ(f.kind(), ReceivedFrame::Kind::kPart);
    EXPECT_EQ(f.tensor(), v1::TENSOR_DW);
    EXPECT_EQ(f.offset(), 123456789u);
    ASSERT_EQ(f.data_size(), data.size());
    std::vector<uint8_t> out(data.size(), 0xFF);
    f.CopyDataTo(out.data());
    size_t mismatches = 0;
    for (size_t i = 0; i < out.size(); ++i) mismatches += out[i] != data[i];
    EXPECT_EQ(mismatches, 0u) << "cuts " << cuts.size();
  }
}

TEST(ReceivedFrameTest, HeaderBytesRoundTrip) {
  v1::FetchGradientsResponse msg;
  msg.mutable_header()->set_micro_batches(4);
  msg.mutable_header()->set_instance("abc");
  msg.mutable_header()->mutable_dw()->add_shape(7);
  ReceivedFrame f;
  ASSERT_TRUE(f.Parse(Chop(msg.SerializeAsString(), {3})).ok());
  ASSERT_EQ(f.kind(), ReceivedFrame::Kind::kHeader);
  v1::GradientsHeader h;
  ASSERT_TRUE(h.ParseFromString(f.header_bytes()));
  EXPECT_EQ(h.micro_batches(), 4u);
  EXPECT_EQ(h.instance(), "abc");
  ASSERT_EQ(h.dw().shape_size(), 1);
  EXPECT_EQ(h.dw().shape(0), 7);
}

TEST(ReceivedFrameTest, TruncatedPartIsRefused) {
  const std::vector<uint8_t> data = Pattern(300, 3);
  v1::FetchGradientsResponse msg;
  msg.mutable_part()->set_tensor(v1::TENSOR_DW);
  msg.mutable_part()->set_data(data.data(), data.size());
  std::string bytes = msg.SerializeAsString();
  bytes.resize(bytes.size() - 10);
  ReceivedFrame f;
  const absl::Status s = f.Parse(Chop(bytes, {5}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("malformed"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace bench
}  // namespace lossd
