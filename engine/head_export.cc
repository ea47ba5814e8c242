// SPDX-License-Identifier: Apache-2.0
// A head's export: byte ranges of the concatenation of its master, optimizer state and
// compute copy (HeadStore::ExportTensors order), copied under the gradient sum's lock, which
// an update holds: every range shows one version, and ranges of another version are refused.
// A group's head reads its master and state from a gather of every member's slices
// (engine/head_group_export.cc), or, for a member's part, this member's slices alone.
#include <algorithm>
#include <cstring>
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

// Which tensors the export of `head` in `scope` holds. A member's part exists only in a group.
absl::StatusOr<std::vector<std::pair<HeadTensor, uint64_t>>> TensorsOf(
    Head& head, const HeadSummary& s, HeadExportScope scope) {
  if (scope == HeadExportScope::kWhole) return ExportTensors(s);
  if (head.comm == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        HeadWhat(head.name), " is served by this server alone: it has no member's part"));
  }
  return PartTensors(head);
}

}  // namespace

absl::StatusOr<std::pair<uint64_t, uint64_t>> HeadStore::CheckExport(
    const std::string& name, std::optional<uint64_t> version, uint64_t begin, uint64_t end,
    const std::string& caller, HeadExportScope scope) {
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, impl_->Get(name, caller));
  const HeadSummary s = Impl::Summarize(*head);
  LOSSD_RETURN_IF_ERROR(CheckVersion(s, version));
  LOSSD_ASSIGN_OR_RETURN(auto tensors, TensorsOf(*head, s, scope));
  return RangeOf(tensors, name, begin, end);
}

absl::StatusOr<HeadExportRange> HeadStore::Export(const std::string& name,
                                                  std::optional<uint64_t> version,
                                                  uint64_t begin, uint64_t end,
                                                  const std::string& caller,
                                                  HeadExportScope scope) {
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, impl_->Get(name, caller));
  LOSSD_RETURN_IF_ERROR(CheckNotBroken(*head));  // its state cannot be exported
  // A group's whole export reads the master and the state from every member's slices,
  // gathered once per version (a collective: before this member's lock is taken).
  std::shared_ptr<const GatheredHead> gathered;
  if (head->comm != nullptr && scope == HeadExportScope::kWhole) {
    LOSSD_ASSIGN_OR_RETURN(gathered, GatherForExport(*impl_, *head, version));
  }
  // The update holds the sum's lock: nothing changes the state while the range is copied.
  absl::MutexLock grad_lock(&head->grad->mu);
  HeadExportRange out;
  out.head = Impl::Summarize(*head);
  LOSSD_RETURN_IF_ERROR(CheckVersion(out.head, version));
  if (gathered) LOSSD_RETURN_IF_ERROR(CheckVersion(out.head, gathered->version));
  LOSSD_ASSIGN_OR_RETURN(out.tensors, TensorsOf(*head, out.head, scope));
  LOSSD_ASSIGN_OR_RETURN(std::tie(out.begin, out.end), RangeOf(out.tensors, name, begin, end));
  out.data = NewHostBuffer(out.end - out.begin);
  uint64_t at = 0;  // the current tensor's first byte in the concatenation
  for (const auto& [t, bytes] : out.tensors) {
    const uint64_t lo = std::max(at, out.begin), hi = std::min(at + bytes, out.end);
    uint8_t* dst = out.data.get() + (lo - out.begin);
    const std::vector<float>* whole =
        gathered ? &gathered->tensors[static_cast<int>(t)] : nullptr;
    if (lo < hi && whole != nullptr && !whole->empty()) {
      std::memcpy(dst, reinterpret_cast<const uint8_t*>(whole->data()) + (lo - at), hi - lo);
    } else if (lo < hi) {
      LOSSD_RETURN_IF_ERROR(
          impl_->backend->CopyFromBackend(*HeadBuffer(*head, t), lo - at, dst, hi - lo));
    }
    at += bytes;
  }
  return out;
}

}  // namespace lossd
