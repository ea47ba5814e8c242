// SPDX-License-Identifier: Apache-2.0
// The standard gRPC health check (grpc.health.v1.Health/Check) over a generic call, so the
// client needs no generated health stubs. Encodes and parses the two one-field messages by
// hand; never blocks past the context's deadline.
#ifndef LOSSD_CLIENT_HEALTH_CHECK_H_
#define LOSSD_CLIENT_HEALTH_CHECK_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"

namespace lossd {
namespace client {

// HealthCheckRequest{service} as bytes (field 1, a string; empty for the whole server).
std::string EncodeHealthCheckRequest(absl::string_view service);
// The status name of a HealthCheckResponse ("SERVING", "NOT_SERVING", "SERVICE_UNKNOWN",
// "UNKNOWN"); INTERNAL for bytes that are not one.
absl::StatusOr<std::string> DecodeHealthCheckResponse(absl::string_view bytes);

// Check on `stub`'s channel, with the caller's context (deadline, metadata). The status
// name, or the call's error (NOT_FOUND from a server that does not know `service`).
absl::StatusOr<std::string> CheckHealth(grpc::GenericStub& stub, grpc::ClientContext* ctx,
                                        absl::string_view service);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_HEALTH_CHECK_H_
