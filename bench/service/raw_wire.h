// SPDX-License-Identifier: Apache-2.0
// Byte-level helpers for the service benchmark: lossd's streamed messages as gRPC byte buffers
// (the client library's framing: a sent part references the caller's bytes, a received part is
// copied once to its destination), one blocking streaming-call runner, and channels that each
// own a TCP connection. Never owns tensor memory, never retries, never parses tensor data.
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
#include "wire/part_codec.h"
#include "grpcpp/support/byte_buffer.h"

namespace lossd {
namespace bench {

// The framing is the client library's (wire/part_codec.h): parts that borrow the caller's
// bytes, small messages, and received frames parsed without copying their data.
using ReceivedFrame = wire::StreamFrame;
constexpr int kBenchHeaderField = wire::kStreamHeaderField;
constexpr int kBenchPartField = wire::kStreamPartField;

// A part borrowing `data` (size bytes) for the rest of the process: the benchmark's buffers
// live that long, so nothing tracks when gRPC lets go of them.
inline grpc::ByteBuffer EncodeBorrowedPart(int32_t tensor, uint64_t offset,
                                           const void* data,  // (size) bytes
                                           size_t size) {
  return wire::EncodePart(tensor, offset, data, size, /*tracker=*/nullptr);
}

inline grpc::ByteBuffer EncodeSmallMessage(const google::protobuf::MessageLite& message) {
  return wire::EncodeMessage(message);
}

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
