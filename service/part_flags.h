// SPDX-License-Identifier: Apache-2.0
// The start-up check of the part-size flags (--max_part_bytes and --response_part_bytes),
// where a default that follows from another flag is made to follow it. Only compares
// numbers; never reads the flags itself.
#ifndef LOSSD_SERVICE_PART_FLAGS_H_
#define LOSSD_SERVICE_PART_FLAGS_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace lossd {

// The --response_part_bytes to serve with. `response_part_given` false (the flag left at its
// default) lets it follow a smaller --max_part_bytes down, so that --max_part_bytes alone is
// enough. INVALID_ARGUMENT, naming the flag to change and the value it may take, for a
// --max_part_bytes outside [1024, 1 GiB] or a given --response_part_bytes outside
// [1024, --max_part_bytes].
absl::StatusOr<uint32_t> CheckPartFlags(uint32_t max_part_bytes, uint32_t response_part_bytes,
                                        bool response_part_given);

}  // namespace lossd

#endif  // LOSSD_SERVICE_PART_FLAGS_H_
