// SPDX-License-Identifier: Apache-2.0
// Encodes and decodes lossd's streamed messages (ComputeRequest/Response, PutWeightsRequest,
// FetchGradientsResponse: a oneof of a header at field 1 and a TensorPart at field 2) directly
// as gRPC byte buffers. A sent part references the caller's bytes without a copy; a received
// part is parsed in place, so its data is copied once, straight to where it belongs.
// Never owns tensor memory and never parses tensor data.
#ifndef LOSSD_WIRE_PART_CODEC_H_
#define LOSSD_WIRE_PART_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace lossd {
namespace wire {

// Field numbers shared by every streamed lossd message.
constexpr int kStreamHeaderField = 1;
constexpr int kStreamPartField = 2;

// Counts slices that reference caller memory and are still held by gRPC. gRPC may keep a
// reference to a sent slice after the write completes (until the transport has written it and
// the stream is torn down), so a call must not return, and the memory must not be reused,
// before WaitUntilReleased().
class SliceTracker {
 public:
  SliceTracker() = default;
  SliceTracker(const SliceTracker&) = delete;
  SliceTracker& operator=(const SliceTracker&) = delete;
  ~SliceTracker() { WaitUntilReleased(); }

  // A slice over `data` (size bytes, caller-owned, left unmodified) whose release is counted.
  grpc::Slice Wrap(const void* data, size_t size);
  void WaitUntilReleased();

 private:
  static void Release(void* self);

  absl::Mutex mu_;
  int64_t live_ ABSL_GUARDED_BY(mu_) = 0;
};

// One streamed message {oneof kind: field 2 = TensorPart{tensor, offset, data}}: a small
// copied slice with the tags and lengths, then `data` itself (size bytes, caller memory,
// tracked), no copy. A null tracker borrows `data` untracked: it must then stay alive and
// unchanged for the rest of the process (benchmarks with fixed buffers).
grpc::ByteBuffer EncodePart(int32_t tensor_id, uint64_t offset, const void* data, size_t size,
                            SliceTracker* tracker);
// The same with the data given as a slice (the caller decides how its memory is kept alive,
// e.g. a slice whose release drops a reference to the buffer it points into).
grpc::ByteBuffer EncodePartSlice(int32_t tensor_id, uint64_t offset, grpc::Slice data);

// Any small message (a header, a unary request), serialized and copied.
grpc::ByteBuffer EncodeMessage(const google::protobuf::MessageLite& message);

// Parses a whole received message into a typed one (headers, unary responses).
absl::Status DecodeMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message);

// A received streamed message, parsed without copying its part data.
class StreamFrame {
 public:
  enum class Kind { kNone, kHeader, kPart };

  Kind kind() const { return kind_; }
  // kHeader: the header message's serialized bytes (small).
  const std::string& header_bytes() const { return header_; }
  // kPart:
  int32_t tensor() const { return tensor_; }
  uint64_t offset() const { return offset_; }
  size_t data_size() const { return data_size_; }
  // Copies the part's data_size() bytes to dst.
  void CopyDataTo(uint8_t* dst) const;  // (data_size()) bytes
  // Where the part's data lies: pieces of the received slices, in order, adding up to
  // data_size() bytes. Valid until the next Parse or the frame's destruction.
  const std::vector<std::pair<const uint8_t*, size_t>>& data_pieces() const { return data_; }
  // The first field number Parse skipped as unknown (0: none), and whether it was inside the
  // TensorPart (else in the stream message itself). A server refuses such a frame (see
  // wire/unknown_fields.h); a client skips what a newer server adds.
  uint64_t unknown_field() const { return unknown_field_; }
  bool unknown_in_part() const { return unknown_in_part_; }

  // Parses `buffer`, keeping references to its slices. Proto3 rules: fields in any order,
  // unknown fields skipped, the last oneof member wins. INVALID_ARGUMENT for bytes that are
  // not a well-formed message.
  absl::Status Parse(const grpc::ByteBuffer& buffer);

 private:
  friend class FrameReader;

  Kind kind_ = Kind::kNone;
  std::string header_;
  int32_t tensor_ = 0;
  uint64_t offset_ = 0;
  size_t data_size_ = 0;
  uint64_t unknown_field_ = 0;
  bool unknown_in_part_ = false;
  std::vector<grpc::Slice> slices_;
  std::vector<std::pair<const uint8_t*, size_t>> data_;  // pieces of the part data, in order
};

}  // namespace wire
}  // namespace lossd

#endif  // LOSSD_WIRE_PART_CODEC_H_
