// SPDX-License-Identifier: Apache-2.0
// PooledClient::ComputeAsync: the pool's Compute (its routing, retries and moves unchanged)
// run on the pool's own call threads, as LossClient::ComputeAsync runs a client's.
#include <future>
#include <memory>
#include <utility>

#include "client/pooled_client.h"

namespace lossd {
namespace client {

void PooledClient::ComputeAsync(ComputeRequest request, CallOptions call,
                                LossClient::ComputeDone done) {
  // Shared: std::function needs a copyable callable, and an owning request is not cheap to
  // copy.
  auto req = std::make_shared<ComputeRequest>(std::move(request));
  auto fn = std::make_shared<LossClient::ComputeDone>(std::move(done));
  CallQueue::Call c;
  c.run = [this, req, call, fn] { (*fn)(Compute(*req, call)); };
  c.cancel = [fn] {
    (*fn)(absl::CancelledError("the pool was destroyed before this ComputeAsync started"));
  };
  calls_->Add(std::move(c));
}

std::future<absl::StatusOr<ComputeResult>> PooledClient::ComputeAsync(ComputeRequest request,
                                                                      CallOptions call) {
  auto promise = std::make_shared<std::promise<absl::StatusOr<ComputeResult>>>();
  std::future<absl::StatusOr<ComputeResult>> fut = promise->get_future();
  ComputeAsync(std::move(request), std::move(call),
               [promise](absl::StatusOr<ComputeResult> r) { promise->set_value(std::move(r)); });
  return fut;
}

}  // namespace client
}  // namespace lossd
