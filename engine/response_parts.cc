// SPDX-License-Identifier: Apache-2.0
#include "engine/response_parts.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace lossd {

absl::StatusOr<uint32_t> ResponsePartBytes(uint32_t asked, uint32_t default_bytes,
                                           uint32_t max_bytes, absl::string_view field) {
  if (asked != 0 && asked < kMinResponsePartBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " must be 0 (the server's default, ", default_bytes, ") or at least ",
        kMinResponsePartBytes, ", got ", asked));
  }
  // Larger than the server sends is not an error: the server's limit is the client's to
  // discover (ServerInfo), and a part of that size serves the same purpose.
  return std::max(kMinResponsePartBytes, std::min(asked == 0 ? default_bytes : asked, max_bytes));
}

}  // namespace lossd
