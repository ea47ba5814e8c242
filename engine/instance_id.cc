// SPDX-License-Identifier: Apache-2.0
#include "engine/instance_id.h"

#include <cstdint>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace lossd {

constexpr size_t kInstanceIdLength = 8;

std::string NewInstanceId() {
  std::random_device rd;
  return absl::StrFormat("%08x", static_cast<uint32_t>(rd()));
}

bool IsInstanceId(absl::string_view s) {
  if (s.size() != kInstanceIdLength) return false;
  for (char c : s) {
    if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return false;
  }
  return true;
}

absl::string_view HandleInstance(absl::string_view handle) {
  if (!absl::ConsumePrefix(&handle, "w-")) return {};
  if (handle.size() <= kInstanceIdLength + 1 || handle[kInstanceIdLength] != '-') return {};
  const absl::string_view instance = handle.substr(0, kInstanceIdLength);
  const absl::string_view number = handle.substr(kInstanceIdLength + 1);
  uint64_t n = 0;
  // Only the number as the cache writes it: "w-0123abcd-01" or "w-0123abcd-+1" never was.
  if (!IsInstanceId(instance) || !absl::ascii_isdigit(number[0]) ||
      !absl::SimpleAtoi(number, &n) || n == 0 || absl::StrCat(n) != number) {
    return {};
  }
  return instance;
}

}  // namespace lossd
