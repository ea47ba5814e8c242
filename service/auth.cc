// SPDX-License-Identifier: Apache-2.0
#include "service/auth.h"

#include <fstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace lossd {

bool ConstantTimeEquals(const char* a, size_t a_len, const std::string& b) {
  // Walk the known token whatever the offered length, so timing reveals neither content nor
  // the position of the first difference.
  volatile unsigned char diff = static_cast<unsigned char>(a_len != b.size());
  for (size_t i = 0; i < b.size(); ++i) {
    const unsigned char x = i < a_len ? static_cast<unsigned char>(a[i]) : 0;
    diff = diff | (x ^ static_cast<unsigned char>(b[i]));
  }
  return diff == 0;
}

absl::StatusOr<TokenAuthenticator> TokenAuthenticator::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read --auth_tokens_file ", path));
  std::vector<std::string> tokens;
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view t = absl::StripAsciiWhitespace(line);
    if (t.empty() || t[0] == '#') continue;
    tokens.emplace_back(t);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--auth_tokens_file ", path, " holds no token"));
  }
  return TokenAuthenticator(std::move(tokens));
}

TokenAuthenticator::TokenAuthenticator(std::vector<std::string> tokens)
    : tokens_(std::move(tokens)) {}

absl::Status TokenAuthenticator::Check(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) {
    return absl::UnauthenticatedError(
        "missing credentials: send the metadata 'authorization: Bearer <token>'");
  }
  absl::string_view value(it->second.data(), it->second.size());
  // The auth scheme is case-insensitive (RFC 7235 section 2.1): "bearer" is "Bearer".
  constexpr absl::string_view kScheme = "Bearer ";
  if (!absl::StartsWithIgnoreCase(value, kScheme)) {
    return absl::UnauthenticatedError("the authorization metadata must be 'Bearer <token>'");
  }
  value.remove_prefix(kScheme.size());
  bool ok = false;
  for (const std::string& t : tokens_) {
    ok |= ConstantTimeEquals(value.data(), value.size(), t);  // no early exit
  }
  if (!ok) return absl::UnauthenticatedError("the bearer token is not valid for this server");
  return absl::OkStatus();
}

int TokenAuthenticator::TokenIndex(
    const std::multimap<grpc::string_ref, grpc::string_ref>& metadata) const {
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return -1;
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, "Bearer ")) return -1;
  int found = -1;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const bool eq = ConstantTimeEquals(value.data(), value.size(), tokens_[i]);
    found = eq && found < 0 ? static_cast<int>(i) : found;  // no early exit
  }
  return found;
}

}  // namespace lossd
