// SPDX-License-Identifier: Apache-2.0
// What the reactors share at the edge: the zero-copy response slices over output buffers,
// and the end of a call (its status mapped once, counted, timed and logged). Never decides
// anything about a call: the reactors and the engine do.
#ifndef LOSSD_SERVICE_REACTOR_COMMON_H_
#define LOSSD_SERVICE_REACTOR_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "engine/engine.h"
#include "service/loss_service.h"
#include "service/request_id.h"

namespace lossd {

inline double SecondsSince(absl::Time t) { return absl::ToDoubleSeconds(absl::Now() - t); }

// Output buffers shared by a reactor and the response slices that point into them: gRPC
// may hold a sent slice a little after its write completes, so the buffers go back to the
// pool when the last of them is released, never while the transport can still read them.
using SharedOutputs = std::shared_ptr<std::vector<HostBuffer>>;

// A slice over bytes [data, data + n) of one of `outputs`' buffers, no copy.
grpc::Slice OutputSlice(const SharedOutputs& outputs, const uint8_t* data, size_t n);

// The end of one call of `method` that began at `started`: maps `s` to the gRPC status to
// finish with, counts it (lossd_requests_total), observes the call's total time and logs it
// (service/log.h) under its `request_id` (BeginRequestId) with the tensor bytes it took in
// and sent.
grpc::Status RecordCall(LossService* service, const grpc::CallbackServerContext& ctx,
                        const char* method, const std::string& request_id, absl::Time started,
                        const absl::Status& s, uint64_t bytes_in, uint64_t bytes_out);

}  // namespace lossd

#endif  // LOSSD_SERVICE_REACTOR_COMMON_H_
