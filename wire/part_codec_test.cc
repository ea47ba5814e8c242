// SPDX-License-Identifier: Apache-2.0
// Tests the hand-written stream message codec against protobuf's own encoder and parser.
#include "wire/part_codec.h"

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "lossd/v1/lossd.pb.h"
#include "testing/byte_buffers.h"

namespace lossd {
namespace wire {
namespace {

// The same bytes as a buffer cut into slices at random places (gRPC hands received messages
// over in arbitrary slices).
grpc::ByteBuffer Sliced(const std::string& bytes, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<grpc::Slice> slices;
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t n = std::min<size_t>(bytes.size() - pos, 1 + gen() % 7);
    slices.emplace_back(bytes.data() + pos, n);
    if (gen() % 4 == 0) slices.emplace_back(bytes.data(), 0);  // empty slices happen too
    pos += n;
  }
  if (slices.empty()) slices.emplace_back(bytes.data(), 0);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string RandomData(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen());
  return s;
}

struct PartCase {
  int32_t tensor;
  uint64_t offset;
  size_t size;
};

class EncodePartTest : public ::testing::TestWithParam<PartCase> {};

TEST_P(EncodePartTest, ProtobufParsesWhatWeEncode) {
  const PartCase c = GetParam();
  const std::string data = RandomData(c.size, 1);
  SliceTracker tracker;
  {
    grpc::ByteBuffer b = EncodePart(c.tensor, c.offset, data.data(), data.size(), &tracker);
    const std::string wire = Flatten(b);
    v1::ComputeRequest req;
    ASSERT_TRUE(req.ParseFromString(wire));
    ASSERT_TRUE(req.has_part());
    EXPECT_EQ(req.part().tensor(), c.tensor);
    EXPECT_EQ(req.part().offset(), c.offset);
    EXPECT_EQ(req.part().data(), data);
    // Byte-identical to protobuf's own encoding.
    EXPECT_EQ(wire, req.SerializeAsString());
    v1::PutWeightsRequest put;
    ASSERT_TRUE(put.ParseFromString(wire));
    EXPECT_EQ(put.part().data(), data);

    // And our decoder reads it back from any slicing.
    StreamFrame f;
    ASSERT_TRUE(f.Parse(Sliced(wire, 5)).ok());
    EXPECT_EQ(f.kind(), StreamFrame::Kind::kPart);
    EXPECT_EQ(f.tensor(), c.tensor);
    EXPECT_EQ(f.offset(), c.offset);
    ASSERT_EQ(f.data_size(), data.size());
    std::string got(data.size(), '\xff');
    f.CopyDataTo(reinterpret_cast<uint8_t*>(&got[0]));
    EXPECT_EQ(got, data);
  }
  tracker.WaitUntilReleased();
}

INSTANTIATE_TEST_SUITE_P(Cases, EncodePartTest,
                         ::testing::Values(PartCase{v1::TENSOR_X, 0, 1000},
                                           PartCase{v1::TENSOR_W, 4 << 20, 127},
                                           PartCase{v1::TENSOR_TARGETS, 1ull << 40, 128},
                                           PartCase{v1::TENSOR_BIAS, 5, 0}, PartCase{0, 0, 3},
                                           PartCase{v1::TENSOR_DB, 300, 70000},
                                           PartCase{-1, 9, 17}));

TEST(StreamFrameTest, DecodesProtobufsEncodingFromAnySlicing) {
  v1::ComputeResponse msg;
  msg.mutable_part()->set_tensor(v1::TENSOR_DX);
  msg.mutable_part()->set_offset(123456789);
  msg.mutable_part()->set_data(RandomData(5000, 2));
  const std::string wire = msg.SerializeAsString();
  for (uint32_t seed = 0; seed < 20; ++seed) {
    StreamFrame f;
    ASSERT_TRUE(f.Parse(Sliced(wire, seed)).ok());
    ASSERT_EQ(f.kind(), StreamFrame::Kind::kPart);
    EXPECT_EQ(f.tensor(), v1::TENSOR_DX);
    EXPECT_EQ(f.offset(), 123456789u);
    std::string got(f.data_size(), '\0');
    f.CopyDataTo(reinterpret_cast<uint8_t*>(&got[0]));
    EXPECT_EQ(got, msg.part().data()) << seed;
  }
}

TEST(StreamFrameTest, HeaderBytesParseAsTheSummary) {
  v1::ComputeResponse msg;
  v1::ComputeSummary* s = msg.mutable_summary();
  s->set_loss(2.5f);
  s->set_tokens(77);
  s->add_tensors(v1::TENSOR_DW);
  s->add_specs()->add_shape(9);
  s->set_backend("cuda");
  StreamFrame f;
  ASSERT_TRUE(f.Parse(Sliced(msg.SerializeAsString(), 3)).ok());
  ASSERT_EQ(f.kind(), StreamFrame::Kind::kHeader);
  v1::ComputeSummary back;
  ASSERT_TRUE(back.ParseFromString(f.header_bytes()));
  EXPECT_EQ(back.SerializeAsString(), s->SerializeAsString());
}

TEST(StreamFrameTest, ProtoRulesUnknownFieldsAndLastOneofWins) {
  v1::ComputeResponse head;
  head.mutable_summary()->set_loss(1.0f);
  v1::ComputeResponse part;
  part.mutable_part()->set_tensor(v1::TENSOR_LSE);
  part.mutable_part()->set_data("abcd");
  // Unknown fields: 15 varint, 9 length-delimited, 12 fixed32, 13 fixed64, and unknown ones
  // inside TensorPart too (field 7 varint).
  const std::string unknown = std::string("\x78\x96\x01", 3) + std::string("\x4a\x02hi", 4) +
                              std::string("\x65\x01\x02\x03\x04", 5) +
                              std::string("\x69\x01\x02\x03\x04\x05\x06\x07\x08", 9);
  std::string inner = part.part().SerializeAsString() + std::string("\x38\x05", 2);
  std::string part_wire = std::string("\x12", 1) + static_cast<char>(inner.size()) + inner;
  StreamFrame f;
  ASSERT_TRUE(f.Parse(Sliced(unknown + head.SerializeAsString() + part_wire, 4)).ok());
  ASSERT_EQ(f.kind(), StreamFrame::Kind::kPart);
  EXPECT_EQ(f.tensor(), v1::TENSOR_LSE);
  EXPECT_EQ(f.data_size(), 4u);
  ASSERT_TRUE(f.Parse(Sliced(part_wire + unknown + head.SerializeAsString(), 6)).ok());
  EXPECT_EQ(f.kind(), StreamFrame::Kind::kHeader);
  // An empty message is neither.
  ASSERT_TRUE(f.Parse(Sliced("", 1)).ok());
  EXPECT_EQ(f.kind(), StreamFrame::Kind::kNone);
}

TEST(StreamFrameTest, MalformedMessagesAreRejected) {
  const std::string cases[] = {
      std::string("\x12", 1),                // truncated length
      std::string("\x12\x05\x08\x14", 4),    // part longer than the message
      std::string("\x12\x04\x1a\x09xy", 6),  // data longer than the part
      std::string("\x10\x01", 2),            // oneof member as a varint
      std::string("\x0b", 1),                // group start (not proto3)
      std::string("\x12\x02\x08", 3),        // truncated part field
      std::string("\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01", 11),  // 11-byte varint
      std::string("\x00\x01", 2),                                       // field number 0
  };
  for (const std::string& c : cases) {
    StreamFrame f;
    absl::Status s = f.Parse(Sliced(c, 2));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << testing::PrintToString(c);
  }
}

TEST(SliceTrackerTest, WaitsUntilGrpcReleasesTheSlices) {
  SliceTracker tracker;
  std::string data = "tensor bytes";
  auto buffer =
      std::make_unique<grpc::ByteBuffer>(EncodePart(1, 0, data.data(), data.size(), &tracker));
  std::atomic<bool> released{false};
  std::thread waiter([&] {
    tracker.WaitUntilReleased();
    released = true;
  });
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(released.load());  // the buffer still references `data`
  buffer.reset();
  waiter.join();
  EXPECT_TRUE(released.load());
}

// A part built from a caller's slice: protobuf's bytes, no copy of the data (the slice is the
// one sent), and the slice's release runs once the buffer is gone.
TEST(EncodePartSliceTest, SendsTheGivenSliceAndReleasesIt) {
  std::string data = RandomData(70000, 3);
  int released = 0;
  auto release = [](void* count) { ++*static_cast<int*>(count); };
  {
    grpc::ByteBuffer b = EncodePartSlice(
        v1::TENSOR_DX, 4096, grpc::Slice(&data[0], data.size(), release, &released));
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(b.Dump(&slices).ok());
    ASSERT_EQ(slices.size(), 2u);
    EXPECT_EQ(reinterpret_cast<const char*>(slices[1].begin()), data.data());  // not a copy
    v1::ComputeResponse msg;
    ASSERT_TRUE(msg.ParseFromString(Flatten(b)));
    ASSERT_TRUE(msg.has_part());
    EXPECT_EQ(msg.part().tensor(), v1::TENSOR_DX);
    EXPECT_EQ(msg.part().offset(), 4096u);
    EXPECT_EQ(msg.part().data(), data);
    EXPECT_EQ(Flatten(b), msg.SerializeAsString());
    EXPECT_EQ(released, 0);
  }
  EXPECT_EQ(released, 1);
  // An empty slice gives protobuf's encoding of a part without data.
  v1::ComputeResponse empty;
  ASSERT_TRUE(empty.ParseFromString(Flatten(EncodePartSlice(v1::TENSOR_DB, 7, grpc::Slice()))));
  EXPECT_EQ(empty.part().offset(), 7u);
  EXPECT_TRUE(empty.part().data().empty());
}

// data_pieces() covers the data exactly, in order, pointing into the received slices.
TEST(StreamFrameTest, DataPiecesCoverThePartData) {
  v1::ComputeRequest msg;
  msg.mutable_part()->set_tensor(v1::TENSOR_X);
  msg.mutable_part()->set_data(RandomData(3001, 4));
  const std::string wire = msg.SerializeAsString();
  for (uint32_t seed = 0; seed < 10; ++seed) {
    StreamFrame f;
    ASSERT_TRUE(f.Parse(Sliced(wire, seed)).ok());
    std::string got;
    for (const auto& piece : f.data_pieces()) {
      got.append(reinterpret_cast<const char*>(piece.first), piece.second);
    }
    EXPECT_EQ(got, msg.part().data()) << seed;
    EXPECT_EQ(got.size(), f.data_size());
  }
}

TEST(DecodeMessageTest, ParsesAndRejects) {
  v1::PutWeightsResponse r;
  r.set_handle("h-1");
  r.set_bytes(42);
  v1::PutWeightsResponse back;
  ASSERT_TRUE(DecodeMessage(EncodeMessage(r), &back).ok());
  EXPECT_EQ(back.handle(), "h-1");
  EXPECT_EQ(back.bytes(), 42u);
  EXPECT_EQ(DecodeMessage(Sliced(std::string("\x0a\x09", 2), 1), &back).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace wire
}  // namespace lossd
