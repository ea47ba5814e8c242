// SPDX-License-Identifier: Apache-2.0
// Derives a call's principal: the opaque owner string the engine keys state ownership on
// (engine/owner.h). Never returns a secret: a token becomes its index in the token
// file. Reads the call's metadata and TLS context only; holds nothing.
#ifndef LOSSD_SERVICE_PRINCIPAL_H_
#define LOSSD_SERVICE_PRINCIPAL_H_

#include <string>

#include <grpcpp/server_context.h>

#include "service/auth.h"

namespace lossd {

// "token:<n>" where bearer tokens are checked (`auth` set; n: the token's line among the
// file's tokens); else "mtls:<identity>" for a client whose certificate the server verified
// (--tls_client_ca; the certificate's subject alternative names or common name); else "",
// under which all state stays anyone's, as without ownership.
std::string CallPrincipal(const grpc::ServerContextBase& ctx, const TokenAuthenticator* auth);

}  // namespace lossd

#endif  // LOSSD_SERVICE_PRINCIPAL_H_
