// Byte-level helpers for the service benchmark: lossd's streamed messages built and read as
// gRPC byte buffers (a sent part references the caller's bytes, a received part is copied once
// to its destination), one blocking streaming-call runner, and channels that each own a TCP
// connection. Never owns tensor memory, never retries, never parses tensor data.
#ifndef LOSSD_BENCH_SERVICE_RAW_WIRE_H_
#define LOSSD_BENCH_SERVICE_RAW_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"

namespace lossd {
namespace bench {

// Field numbers of every streamed lossd message: oneof {1: header, 2: TensorPart}.
constexpr int kBenchHeaderField = 1;
constexpr int kBenchPartField = 2;

// A message {2: TensorPart{1: tensor, 2: offset, 3: data}}: a small copied prefix and a
// slice that borrows `data` (size bytes) with a no-op release. Nothing tracks when gRPC lets
// go of it, so `data` must stay alive and unchanged for the whole process (the benchmark's
// buffers do).
grpc::ByteBuffer EncodeBorrowedPart(int32_t tensor, uint64_t offset,
                                    const void* data,  // (size) bytes
                                    size_t size);

// A slice over `data` (size bytes, alive and unchanged for the process's life), no copy: a
// borrowed slice with a no-op release, the kind LossClient sends.
grpc::Slice BorrowedSlice(const void* data,  // (size) bytes
                          size_t size);

// Any small message, serialized (one copy).
grpc::ByteBuffer EncodeSmallMessage(const google::protobuf::MessageLite& message);

// A received streamed message: its header bytes, or a part whose data is copied out once.
class ReceivedFrame {
 public:
  enum class Kind { kNone, kHeader, kPart };

  // INVALID_ARGUMENT for bytes that are not a well-formed {1: bytes | 2: TensorPart}.
  absl::Status Parse(const grpc::ByteBuffer& buffer);

  Kind kind() const { return kind_; }
  const std::string& header_bytes() const { return header_; }
  int32_t tensor() const { return tensor_; }
  uint64_t offset() const { return offset_; }
  size_t data_size() const { return data_size_; }
  // Copies the data_size() bytes of the part to dst.
  void CopyDataTo(uint8_t* dst) const;  // (data_size()) bytes

 private:
  Kind kind_ = Kind::kNone;
  std::string header_;
  int32_t tensor_ = 0;
  uint64_t offset_ = 0;
  size_t data_size_ = 0;
  std::vector<grpc::Slice> slices_;                       // keep the pieces alive
  std::vector<std::pair<const uint8_t*, size_t>> data_;  // the part data, in order
};

// Runs one streaming call (client, server or bidi streaming: on the wire all are a stream
// each way) to its end: writes `out` in order, half-closes, and hands each received message
// to `on_message`. Returns the handler's first error (the call is then cancelled) or the
// call's status.
absl::Status RunStream(grpc::GenericStub* stub, const std::string& method,
                       std::vector<grpc::ByteBuffer> out,
                       const std::function<absl::Status(const grpc::ByteBuffer&)>& on_message,
                       absl::Duration deadline);

// `n` channels to `target`, each with its own TCP connection (a local subchannel pool and a
// distinct channel argument; channels with equal arguments would share one), message limits
// raised to 64 MiB.
std::vector<std::shared_ptr<grpc::Channel>> MakeChannels(const std::string& target, int n);

}  // namespace bench
}  // namespace lossd

#endif  // LOSSD_BENCH_SERVICE_RAW_WIRE_H_
