// SPDX-License-Identifier: Apache-2.0
// A call's request id: the client's `x-request-id` metadata where it sent one (checked), else
// one the server makes. The server sends it back in the response's initial metadata and names
// it in every log line about the call, so that a client's error and the server's line match.
// Never decides anything about the call but the refusal of a malformed id.
#ifndef LOSSD_SERVICE_REQUEST_ID_H_
#define LOSSD_SERVICE_REQUEST_ID_H_

#include <cstddef>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace lossd {

inline constexpr char kRequestIdKey[] = "x-request-id";
// Long enough for a UUID, a W3C trace id or a client's own prefix; it goes in every log line.
inline constexpr size_t kMaxRequestIdBytes = 128;

using ClientMetadata = std::multimap<grpc::string_ref, grpc::string_ref>;

// The client's id: "" where it sent none; else it must come once and be 1 to 128 visible
// ASCII characters ('!' to '~': no spaces, nothing a log line or a header could split on),
// or INVALID_ARGUMENT naming x-request-id and what is wrong with it.
absl::StatusOr<std::string> ClientRequestId(const ClientMetadata& metadata);

// 16 random lowercase hex digits (64 bits: unique enough to find one call in a day's log).
std::string NewRequestId();

// The call's id (the client's valid one, else a new one), added to `ctx`'s initial metadata.
// Call it once, where the call begins, before anything is sent. A malformed client id is
// replaced here (the refusal's log line needs an id too) and refused by CheckRequestId.
std::string BeginRequestId(grpc::CallbackServerContext* ctx);

// OK, or the INVALID_ARGUMENT of ClientRequestId: the call is refused with it.
absl::Status CheckRequestId(const ClientMetadata& metadata);

}  // namespace lossd

#endif  // LOSSD_SERVICE_REQUEST_ID_H_
