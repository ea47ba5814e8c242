// SPDX-License-Identifier: Apache-2.0
// Views and copies of a caller's request, for the client's helpers that send a call again in
// another form (the pool with its own weight handle, TwoPhaseLogprob's forward and backward):
// every field of ComputeRequest carried over in one place, so a field added to it later is
// not silently dropped by one helper and kept by another.
#ifndef LOSSD_CLIENT_REQUEST_VIEWS_H_
#define LOSSD_CLIENT_REQUEST_VIEWS_H_

#include <optional>

#include "client/client_types.h"
#include "client/host_tensor.h"

namespace lossd {
namespace client {

// A view of t's bytes (t itself where it is one): valid while t's bytes are.
HostTensor ViewOf(const HostTensor& t);
std::optional<HostTensor> ViewOf(const std::optional<HostTensor>& t);

// An owning copy of t's bytes, view or not.
HostTensor CopyOf(const HostTensor& t);

// `r` with every field carried over and every tensor a view of r's (no bytes copied).
ComputeRequest ViewsOf(const ComputeRequest& r);

}  // namespace client
}  // namespace lossd

#endif  // LOSSD_CLIENT_REQUEST_VIEWS_H_
