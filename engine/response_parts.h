// SPDX-License-Identifier: Apache-2.0
// The data size of the parts a Compute or FetchGradients response is split into, from what
// the request asks for (0: the server's default), checked here once. Knows nothing of gRPC;
// never sends anything.
#ifndef LOSSD_ENGINE_RESPONSE_PARTS_H_
#define LOSSD_ENGINE_RESPONSE_PARTS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace lossd {

// The smallest part a client may ask for: below it each part is mostly message overhead (at
// 1 byte a 128 KiB dW took 131k messages and 18 s to send). Also the floor of the server's
// own --response_part_bytes and --max_part_bytes.
inline constexpr uint32_t kMinResponsePartBytes = 1024;

// `asked` (named `field` in errors) when it is at least kMinResponsePartBytes, capped at
// `max_bytes`; `default_bytes` when it is 0. INVALID_ARGUMENT for 1 to kMinResponsePartBytes-1.
absl::StatusOr<uint32_t> ResponsePartBytes(uint32_t asked, uint32_t default_bytes,
                                           uint32_t max_bytes, absl::string_view field);

}  // namespace lossd

#endif  // LOSSD_ENGINE_RESPONSE_PARTS_H_
