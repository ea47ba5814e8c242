// SPDX-License-Identifier: Apache-2.0
// What LossClient's own source files share and nobody else sees: the per-connection stubs and
// the unary-call helper. lossd_client.cc holds the tensor calls, lossd_client_heads.cc the
// hosted head's.
#ifndef LOSSD_CLIENT_LOSSD_CLIENT_INTERNAL_H_
#define LOSSD_CLIENT_LOSSD_CLIENT_INTERNAL_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "client/lossd_client.h"
#include "client/stream_call.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "lossd/v1/lossd.grpc.pb.h"

namespace lossd {
namespace client {

struct LossClient::Connection {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<grpc::GenericStub> generic;
  std::unique_ptr<v1::Loss::Stub> stub;
};

namespace internal {

// One unary call on `stub`, on a context that `prepare` sets up (deadline, metadata), with a
// new request id, which an error names (WithRequestId).
template <typename Request, typename Response>
absl::Status CallUnary(v1::Loss::Stub* stub,
                       grpc::Status (v1::Loss::Stub::*method)(grpc::ClientContext*,
                                                              const Request&, Response*),
                       const std::function<void(grpc::ClientContext*)>& prepare,
                       const Request& req, Response* resp) {
  grpc::ClientContext ctx;
  prepare(&ctx);
  const std::string request_id = NewRequestId();
  ctx.AddMetadata(kRequestIdKey, request_id);
  return WithRequestId(FromGrpcStatus((stub->*method)(&ctx, req, resp)), request_id);
}

}  // namespace internal
}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_LOSSD_CLIENT_INTERNAL_H_
