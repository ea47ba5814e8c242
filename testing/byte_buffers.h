// SPDX-License-Identifier: Apache-2.0
// A gRPC byte buffer's bytes as one string, for tests that compare what goes on the wire.
// Test-only; copies, never keeps or changes the buffer.
#ifndef LOSSD_TESTING_BYTE_BUFFERS_H_
#define LOSSD_TESTING_BYTE_BUFFERS_H_

#include <string>

#include "grpcpp/support/byte_buffer.h"

namespace lossd {

// Every slice of `b` in order (EXPECTs that the buffer can be read).
std::string Flatten(const grpc::ByteBuffer& b);

}  // namespace lossd

#endif  // LOSSD_TESTING_BYTE_BUFFERS_H_
