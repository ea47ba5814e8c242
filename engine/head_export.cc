// SPDX-License-Identifier: Apache-2.0
// A head's export: byte ranges of the concatenation of its master, optimizer state and
// compute copy (HeadStore::ExportTensors order), copied under the gradient sum's lock, which
// an update holds: every range shows one version, and ranges of another version are refused.
#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/head_internal.h"
#include "engine/heads.h"

namespace lossd {
namespace {

absl::StatusOr<std::pair<uint64_t, uint64_t>> RangeOf(
    const std::vector<std::pair<HeadTensor, uint64_t>>& tensors, const std::string& name,
    uint64_t begin, uint64_t end) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += t.second;
  if (begin == 0 && end == 0) end = total;
  if (begin >= end || end > total) {
    return absl::InvalidArgumentError(absl::StrCat(
        "range [", begin, ", ", end, ") is not a non-empty byte range of ", HeadWhat(name),
        "'s export, which holds ", total, " bytes"));
  }
  return std::make_pair(begin, end);
}

absl::Status CheckVersion(const HeadSummary& s, std::optional<uint64_t> version) {
  if (version && *version != s.version) {
    return absl::FailedPreconditionError(absl::StrCat(
        HeadWhat(s.name), " is at version ", s.version, ", not ", *version, ": a step has "
        "changed it since the export began; export again from the start"));
  }
  return absl::OkStatus();
}

// A group's member holds only its slice of the master and the state: one member's export
// would be a fraction of the head. Gathering an export over the group is not built yet.
absl::Status RefuseGroup(const Head& head) {
  if (head.comm == nullptr) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      HeadWhat(head.name), " is served by a group of ", head.group.size(), " members, each "
      "holding 1/", head.group.size(), " of its master and optimizer state; exporting a "
      "group's head is not supported yet"));
}

}  // namespace

absl::StatusOr<std::pair<uint64_t, uint64_t>> HeadStore::CheckExport(
    const std::string& name, std::optional<uint64_t> version, uint64_t begin, uint64_t end,
    const std::string& caller) {
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, impl_->Get(name, caller));
  LOSSD_RETURN_IF_ERROR(RefuseGroup(*head));
  const HeadSummary s = Impl::Summarize(*head);
  LOSSD_RETURN_IF_ERROR(CheckVersion(s, version));
  return RangeOf(ExportTensors(s), name, begin, end);
}

absl::StatusOr<HeadExportRange> HeadStore::Export(const std::string& name,
                                                  std::optional<uint64_t> version,
                                                  uint64_t begin, uint64_t end,
                                                  const std::string& caller) {
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, impl_->Get(name, caller));
  LOSSD_RETURN_IF_ERROR(RefuseGroup(*head));
  if (head->broken.load()) {
    return absl::FailedPreconditionError(absl::StrCat(
        HeadWhat(name), " failed midway through an update; its state cannot be exported"));
  }
  // The update holds the sum's lock: nothing changes the state while the range is copied.
  absl::MutexLock grad_lock(&head->grad->mu);
  HeadExportRange out;
  out.head = Impl::Summarize(*head);
  LOSSD_RETURN_IF_ERROR(CheckVersion(out.head, version));
  out.tensors = ExportTensors(out.head);
  LOSSD_ASSIGN_OR_RETURN(std::tie(out.begin, out.end), RangeOf(out.tensors, name, begin, end));
  out.data = NewHostBuffer(out.end - out.begin);
  uint64_t at = 0;  // the current tensor's first byte in the concatenation
  for (const auto& [t, bytes] : out.tensors) {
    const uint64_t lo = std::max(at, out.begin), hi = std::min(at + bytes, out.end);
    if (lo < hi) {
      LOSSD_RETURN_IF_ERROR(impl_->backend->CopyFromBackend(
          *HeadBuffer(*head, t), lo - at, out.data.get() + (lo - out.begin), hi - lo));
    }
    at += bytes;
  }
  return out;
}

}  // namespace lossd
