// SPDX-License-Identifier: Apache-2.0
// The end-to-end tests' health probe: grpc.health.v1.Health/Check for the whole server, as the
// clients ask it (client/health_check.h). It lives here, over client/, so that testing/ (the
// server's harness) needs no client code.
#ifndef LOSSD_TESTS_HEALTH_STATUS_H_
#define LOSSD_TESTS_HEALTH_STATUS_H_

#include <memory>

#include "grpcpp/channel.h"

namespace lossd {

// 1 SERVING, 2 NOT_SERVING, -1 when the call fails (10 s deadline) or the answer is neither.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel);

}  // namespace lossd

#endif  // LOSSD_TESTS_HEALTH_STATUS_H_
