// SPDX-License-Identifier: Apache-2.0
#include "engine/owner.h"

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace lossd {

absl::Status CheckOwner(absl::string_view owner, absl::string_view caller,
                        absl::string_view what) {
  if (OwnerAllows(owner, caller)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " belongs to another credential: only the token (or client certificate) that "
      "created it may use, fetch, reset or drop it"));
}

int64_t NowNs() { return absl::GetCurrentTimeNanos(); }

}  // namespace lossd
