// SPDX-License-Identifier: Apache-2.0
// PooledClient::ComputeAsync: the pool's Compute (its routing, retries and moves unchanged)
// run on the pool's own call threads, as LossClient::ComputeAsync runs a client's.
#include <future>
#include <memory>
#include <utility>

#include "client/call_queue.h"
#include "client/pooled_client.h"

namespace lossd {
namespace client {

void PooledClient::ComputeAsync(ComputeRequest request, CallOptions call,
                                LossClient::ComputeDone done) {
  auto req = std::make_shared<ComputeRequest>(std::move(request));
  AddCall<absl::StatusOr<ComputeResult>>(
      *calls_, [this, req, call] { return Compute(*req, call); }, std::move(done), "pool");
}

std::future<absl::StatusOr<ComputeResult>> PooledClient::ComputeAsync(ComputeRequest request,
                                                                      CallOptions call) {
  auto req = std::make_shared<ComputeRequest>(std::move(request));
  return AddCall<absl::StatusOr<ComputeResult>>(
      *calls_, [this, req, call] { return Compute(*req, call); }, "pool");
}

}  // namespace client
}  // namespace lossd
