// SPDX-License-Identifier: Apache-2.0
#include "service/part_flags.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/response_parts.h"

namespace lossd {

absl::StatusOr<uint32_t> CheckPartFlags(uint32_t max_part_bytes, uint32_t response_part_bytes,
                                        bool response_part_given) {
  // A part and its framing must fit in one gRPC message, and protobuf parses none of 2 GiB
  // or more.
  constexpr uint32_t kMaxPart = 1u << 30;
  if (max_part_bytes < kMinResponsePartBytes || max_part_bytes > kMaxPart) {
    return absl::InvalidArgumentError(absl::StrCat("--max_part_bytes must be in [",
                                                   kMinResponsePartBytes, ", ", kMaxPart,
                                                   "], got ", max_part_bytes));
  }
  if (!response_part_given) return std::min(response_part_bytes, max_part_bytes);
  if (response_part_bytes < kMinResponsePartBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--response_part_bytes must be at least ",
                                                   kMinResponsePartBytes, ", got ",
                                                   response_part_bytes));
  }
  if (response_part_bytes > max_part_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--response_part_bytes=", response_part_bytes, " exceeds --max_part_bytes=",
        max_part_bytes, ": set --response_part_bytes to at most ", max_part_bytes,
        ", or leave it out (its default follows --max_part_bytes)"));
  }
  return response_part_bytes;
}

}  // namespace lossd
