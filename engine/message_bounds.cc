// SPDX-License-Identifier: Apache-2.0
#include "engine/message_bounds.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace lossd {

absl::Status CheckHeaderBytes(size_t bytes, absl::string_view what) {
  if (bytes <= kMaxHeaderBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      what, " is ", bytes, " bytes, more than the ", kMaxHeaderBytes,
      " a header may have (it holds shapes, options and names; tensors go in parts)"));
}

std::string ShapeText(absl::Span<const int64_t> shape) {
  if (shape.size() <= kShownDims) return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  return absl::StrCat("[", absl::StrJoin(shape.subspan(0, kShownDims), ", "), ", ... (",
                      shape.size(), " dims)]");
}

std::string ClippedText(absl::string_view s) {
  if (s.size() <= kShownChars) return std::string(s);
  return absl::StrCat(s.substr(0, kShownChars), "... (", s.size(), " bytes)");
}

absl::Status BoundedStatus(const absl::Status& s) {
  if (s.message().size() <= kMaxStatusMessageBytes) return s;
  const std::string tail = absl::StrCat("... (", s.message().size(), " bytes in all)");
  return absl::Status(s.code(), absl::StrCat(s.message().substr(0, kMaxStatusMessageBytes -
                                                                       tail.size()),
                                             tail));
}

}  // namespace lossd
