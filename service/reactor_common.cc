// SPDX-License-Identifier: Apache-2.0
#include "service/reactor_common.h"

#include <string>

#include "service/log.h"
#include "service/status_util.h"

namespace lossd {
namespace {

void ReleaseOutputs(void* hold) { delete static_cast<SharedOutputs*>(hold); }

// Whom the refusal log's limit counts a failed call against: its principal where the server
// knows one (a valid token, a verified certificate), else its host (the peer without the
// port, so that one client's many connections are one caller).
std::string LogCaller(LossService* service, const grpc::CallbackServerContext& ctx) {
  std::string principal = service->Principal(&ctx);
  if (!principal.empty() && principal != "token:none") return principal;
  std::string peer = ctx.peer();
  const size_t colon = peer.rfind(':');
  if (colon != std::string::npos && colon > peer.find(':')) peer.resize(colon);
  return peer;
}

}  // namespace

grpc::Slice OutputSlice(const SharedOutputs& outputs, const uint8_t* data, size_t n) {
  // gRPC never writes through a send slice; the cast only satisfies grpc_slice's type.
  return grpc::Slice(const_cast<uint8_t*>(data), n, &ReleaseOutputs,
                     new SharedOutputs(outputs));
}

grpc::Status RecordCall(LossService* service, const grpc::CallbackServerContext& ctx,
                        const char* method, const std::string& request_id, absl::Time started,
                        const absl::Status& s, uint64_t bytes_in, uint64_t bytes_out) {
  grpc::Status g = ToGrpcStatus(s);
  ServerMetrics* m = service->metrics();
  m->CountRequest(method, GrpcCodeName(g.error_code()));
  m->ObservePhase(method, "total", SecondsSince(started));
  const std::string caller = g.ok() ? std::string() : LogCaller(service, ctx);
  LogCall({method, request_id, ctx.peer(), caller, GrpcCodeName(g.error_code()), g.error_message(),
           absl::Now() - started, bytes_in, bytes_out});
  return g;
}

}  // namespace lossd
