// SPDX-License-Identifier: Apache-2.0
#include "service/request_id.h"

#include <cstdint>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace lossd {

absl::StatusOr<std::string> ClientRequestId(const ClientMetadata& metadata) {
  const auto [first, last] = metadata.equal_range(kRequestIdKey);
  if (first == last) return std::string();
  const size_t count = std::distance(first, last);
  if (count > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata x-request-id must come once, got ", count, " values; send one per call"));
  }
  const absl::string_view id(first->second.data(), first->second.size());
  if (id.empty() || id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metadata x-request-id must be 1 to ", kMaxRequestIdBytes, " characters, got ",
        id.size()));
  }
  for (size_t i = 0; i < id.size(); ++i) {
    const unsigned char c = id[i];
    if (c < '!' || c > '~') {
      return absl::InvalidArgumentError(absl::StrFormat(
          "metadata x-request-id must be visible ASCII ('!' to '~'), got byte 0x%02x at "
          "offset %d",
          c, i));
    }
  }
  return std::string(id);
}

std::string NewRequestId() {
  // One generator per thread: absl::BitGen is not thread-safe, and a lock here would be taken
  // by every call.
  thread_local absl::BitGen gen;
  return absl::StrFormat("%016x", absl::Uniform<uint64_t>(gen));
}

std::string BeginRequestId(grpc::CallbackServerContext* ctx) {
  absl::StatusOr<std::string> sent = ClientRequestId(ctx->client_metadata());
  std::string id = sent.ok() && !sent->empty() ? *std::move(sent) : NewRequestId();
  ctx->AddInitialMetadata(kRequestIdKey, id);
  return id;
}

absl::Status CheckRequestId(const ClientMetadata& metadata) {
  return ClientRequestId(metadata).status();
}

}  // namespace lossd
