#include "service/reactor_common.h"

#include "service/log.h"
#include "service/status_util.h"

namespace lossd {
namespace {

void ReleaseOutputs(void* hold) { delete static_cast<SharedOutputs*>(hold); }

}  // namespace

grpc::Slice OutputSlice(const SharedOutputs& outputs, const uint8_t* data, size_t n) {
  // gRPC never writes through a send slice; the cast only satisfies grpc_slice's type.
  return grpc::Slice(const_cast<uint8_t*>(data), n, &ReleaseOutputs,
                     new SharedOutputs(outputs));
}

grpc::Status RecordCall(LossService* service, const grpc::CallbackServerContext& ctx,
                        const char* method, absl::Time started, const absl::Status& s,
                        uint64_t bytes_in, uint64_t bytes_out) {
  grpc::Status g = ToGrpcStatus(s);
  ServerMetrics* m = service->metrics();
  m->CountRequest(method, GrpcCodeName(g.error_code()));
  m->ObservePhase(method, "total", SecondsSince(started));
  LogCall({method, ctx.peer(), GrpcCodeName(g.error_code()), g.error_message(),
           absl::Now() - started, bytes_in, bytes_out});
  return g;
}

}  // namespace lossd
