// SPDX-License-Identifier: Apache-2.0
#include "service/principal.h"

#include <memory>

#include <grpcpp/security/auth_context.h>

#include "absl/strings/str_cat.h"

namespace lossd {

std::string CallPrincipal(const grpc::ServerContextBase& ctx, const TokenAuthenticator* auth) {
  if (auth != nullptr) {
    const int index = auth->TokenIndex(ctx.client_metadata());
    // Enter has already refused a call without a valid token; -1 cannot own anything.
    return index < 0 ? std::string("token:none") : absl::StrCat("token:", index);
  }
  std::shared_ptr<const grpc::AuthContext> tls = ctx.auth_context();
  if (tls == nullptr || !tls->IsPeerAuthenticated()) return "";
  std::string who = "mtls:";
  bool first = true;
  for (const grpc::string_ref& id : tls->GetPeerIdentity()) {
    absl::StrAppend(&who, first ? "" : ",", absl::string_view(id.data(), id.size()));
    first = false;
  }
  return who;
}

}  // namespace lossd
