// SPDX-License-Identifier: Apache-2.0
// Bounds on what a refusal may echo of a request: a shape prints its first dimensions and
// its rank, a client-chosen string its first characters and its length, and a whole status
// message stops near 1 KiB. A message never grows with what the client sent: a 200k-dim
// shape made a 600k-character status, which a client with gRPC's default 16 KiB metadata
// limit received as RESOURCE_EXHAUSTED instead of the refusal. Also the one bound on the size
// of a request's header message. Formats and compares sizes; keeps nothing.
#ifndef LOSSD_ENGINE_MESSAGE_BOUNDS_H_
#define LOSSD_ENGINE_MESSAGE_BOUNDS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace lossd {

// The longest status message lossd sends; longer ones are cut (and say by how much).
inline constexpr size_t kMaxStatusMessageBytes = 1024;
// Dimensions of a shape shown before "...".
inline constexpr size_t kShownDims = 8;
// Characters of a client-chosen string shown before "...".
inline constexpr size_t kShownChars = 64;

// The largest Compute or PutWeights header accepted. A header holds shapes, options and short
// names, never tensor data: a real one is well under 1 KiB, and parsing one of megabytes (a
// shape of millions of dimensions) costs the server tens of MiB per call.
inline constexpr size_t kMaxHeaderBytes = 64 << 10;

// INVALID_ARGUMENT when a header of `bytes` (the serialized `what`, e.g. "the Compute
// header") is over kMaxHeaderBytes.
absl::Status CheckHeaderBytes(size_t bytes, absl::string_view what);

// "[4, 8]"; past kShownDims dimensions "[1, 1, 1, 1, 1, 1, 1, 1, ... (200000 dims)]".
std::string ShapeText(absl::Span<const int64_t> shape);

// `s` itself when at most kShownChars long; else its first kShownChars characters and
// "... (N bytes)".
std::string ClippedText(absl::string_view s);

// `s` with its message cut to kMaxStatusMessageBytes (ending "... (N bytes in all)"); the
// code and a message within the bound are kept as they are.
absl::Status BoundedStatus(const absl::Status& s);

}  // namespace lossd

#endif  // LOSSD_ENGINE_MESSAGE_BOUNDS_H_
