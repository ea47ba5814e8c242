// SPDX-License-Identifier: Apache-2.0
// Server reflection on a ServerBuilder: off unless asked for, and behind the bearer token
// where tokens are checked. Debian's libgrpc++_reflection registers its plugin with every
// ServerBuilder when it is loaded, so "not initialising it" does not turn it off: the plugin
// is taken out of the builder instead. Never touches any other service's calls.
#ifndef LOSSD_SERVICE_REFLECTION_GUARD_H_
#define LOSSD_SERVICE_REFLECTION_GUARD_H_

#include <memory>

#include <grpcpp/server_builder.h>

#include "service/auth.h"

namespace lossd {

// Sets `builder` up so that grpc.reflection.* is served only when `enabled`, and then, when
// `auth` is set, only to calls that carry one of its tokens (UNAUTHENTICATED otherwise, as
// the Loss service; health needs none). `auth` is shared with the interceptor it installs.
void ConfigureReflection(grpc::ServerBuilder* builder, bool enabled,
                         std::shared_ptr<const TokenAuthenticator> auth);

}  // namespace lossd

#endif  // LOSSD_SERVICE_REFLECTION_GUARD_H_
