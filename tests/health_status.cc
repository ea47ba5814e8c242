// SPDX-License-Identifier: Apache-2.0
#include "tests/health_status.h"

#include <chrono>
#include <string>

#include "absl/status/statusor.h"
#include "client/health_check.h"
#include "grpcpp/client_context.h"
#include "grpcpp/generic/generic_stub.h"

namespace lossd {

int HealthStatus(const std::shared_ptr<grpc::Channel>& channel) {
  // The whole server (an empty service name), as the clients ask.
  grpc::GenericStub generic(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  absl::StatusOr<std::string> status = client::CheckHealth(generic, &ctx, "");
  if (!status.ok()) return -1;
  if (*status == "SERVING") return 1;
  if (*status == "NOT_SERVING") return 2;
  return -1;
}

}  // namespace lossd
