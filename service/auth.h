// SPDX-License-Identifier: Apache-2.0
// Bearer-token authentication for the Loss service: the client sends
// "authorization: Bearer <token>"; tokens come from a file (one per line, '#' comments).
// Comparison takes the same time whatever the token, and refusals never echo the token.
#ifndef LOSSD_SERVICE_AUTH_H_
#define LOSSD_SERVICE_AUTH_H_

#include <map>
#include <string>
#include <vector>

#include <grpcpp/support/string_ref.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace lossd {

class TokenAuthenticator {
 public:
  // NOT_FOUND / INVALID_ARGUMENT when the file is missing, unreadable or holds no token.
  static absl::StatusOr<TokenAuthenticator> FromFile(const std::string& path);
  explicit TokenAuthenticator(std::vector<std::string> tokens);

  // OK when the metadata carries a known bearer token; UNAUTHENTICATED otherwise.
  absl::Status Check(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;
  // The index in the file of the bearer token the metadata carries, or -1: who owns the state
  // a call creates (service/principal.h), without keeping the token. Same equal-time walk.
  int TokenIndex(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const;

 private:
  std::vector<std::string> tokens_;
};

// Equal-time comparison: the time depends on the lengths only, never on where bytes differ.
bool ConstantTimeEquals(const char* a, size_t a_len, const std::string& b);

}  // namespace lossd

#endif  // LOSSD_SERVICE_AUTH_H_
