// SPDX-License-Identifier: Apache-2.0
// The one conversion from absl::Status (engine, backends) to grpc::Status (the wire), by an
// explicit switch so that every code maps on purpose.
#ifndef LOSSD_SERVICE_STATUS_UTIL_H_
#define LOSSD_SERVICE_STATUS_UTIL_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace lossd {

// The message is cut to kMaxStatusMessageBytes (engine/message_bounds.h).
grpc::Status ToGrpcStatus(const absl::Status& s);

// The canonical name of a gRPC code ("INVALID_ARGUMENT"), for metrics labels and logs.
const char* GrpcCodeName(grpc::StatusCode code);

}  // namespace lossd

#endif  // LOSSD_SERVICE_STATUS_UTIL_H_
