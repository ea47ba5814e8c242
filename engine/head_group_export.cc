// SPDX-License-Identifier: Apache-2.0
// A group's export: every member's ZeRO-1 slices of the master and the optimizer state,
// all-gathered (gloo's allgatherv, engine/head_group.h) into one whole head at one version,
// so the export has the one-server format and any group size can import it. The gather runs
// on a communicator formed for it alone: a member that never comes fails the export, never
// the head's own communicator (whose collectives every step needs in the same order).
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/head_internal.h"
#include "engine/heads.h"

namespace lossd {
namespace {

// The master and state tensors `head` has, with the parameter each belongs to.
std::vector<std::pair<HeadTensor, HeadParam*>> FloatTensors(Head& head) {
  std::vector<std::pair<HeadTensor, HeadParam*>> out;
  for (int i = 0; i < static_cast<int>(HeadTensor::kCopyW); ++i) {
    const HeadTensor t = static_cast<HeadTensor>(i);
    HeadParam* p = (i % 2 == 0) ? &head.w : &head.bias;
    if (p->n > 0 && HeadBuffer(head, t) != nullptr) out.emplace_back(t, p);
  }
  return out;
}

// This member's slices, each at its place in a whole-sized buffer, under the sum's lock (an
// update holds it: the slices and the version are of one step).
absl::StatusOr<std::shared_ptr<GatheredHead>> OwnSlices(HeadStore::Impl& store, Head& head,
                                                        std::optional<uint64_t> version) {
  auto g = std::make_shared<GatheredHead>();
  absl::MutexLock grad_lock(&head.grad->mu);
  {
    absl::MutexLock lock(&head.mu);
    g->version = head.version;
  }
  if (version && *version != g->version) {
    return absl::FailedPreconditionError(absl::StrCat(
        HeadWhat(head.name), " is at version ", g->version, ", not ", *version, ": a step has "
        "changed it since the export began; export again from the start"));
  }
  for (auto& [t, p] : FloatTensors(head)) {
    std::vector<float>& whole = g->tensors[static_cast<int>(t)];
    whole.assign(p->n, 0.0f);
    LOSSD_RETURN_IF_ERROR(store.backend->CopyFromBackend(
        *HeadBuffer(head, t), 0, whole.data() + p->slice.lo, p->slice.n() * sizeof(float)));
  }
  return g;
}

// Says what a failed gather means: the export failed, the head did not.
absl::Status ExportFailed(const Head& head, uint64_t version, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(
      "the export of ", HeadWhat(head.name), " at version ", version, " gathers the slices of "
      "every member of group '", head.group.id, "', so ExportHead must reach every member at "
      "once, at a step boundary (no rank in Step): ", s.message(), ". The head is unchanged; "
      "export again"));
}

}  // namespace

std::vector<std::pair<HeadTensor, uint64_t>> PartTensors(Head& head) {
  std::vector<std::pair<HeadTensor, uint64_t>> out;
  for (auto& [t, p] : FloatTensors(head)) {
    out.emplace_back(t, static_cast<uint64_t>(p->slice.n()) * sizeof(float));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const GatheredHead>> GatherForExport(
    HeadStore::Impl& store, Head& head, std::optional<uint64_t> version) {
  // One gather at a time on this member; the ranges of one export that wait here then find
  // it done.
  absl::MutexLock export_lock(&head.export_mu);
  {
    absl::MutexLock lock(&head.mu);
    if (head.gathered && head.gathered->version == head.version &&
        (!version || *version == head.version)) {
      return head.gathered;
    }
    head.gathered.reset();  // another version's: its memory goes before the new one's comes
  }
  if (!store.options.connect_group) {
    return absl::FailedPreconditionError("this server forms no head groups");
  }
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<GatheredHead> g, OwnSlices(store, head, version));
  // The export's own communicator, under a key prefix of its version: members asked for
  // different versions never meet (and time out), never mix their slices.
  HeadGroup group = head.group;
  group.id = absl::StrCat(head.group.id, "/export/", g->version);
  // The slices are gathered in host memory (the export's), so over the host's transport.
  absl::StatusOr<std::shared_ptr<HeadComm>> comm = store.options.connect_group(group, nullptr);
  if (!comm.ok()) return ExportFailed(head, g->version, comm.status());
  // Every member formed this communicator for the same version (its key prefix), so the
  // slices below are of one step on every member.
  for (auto& [t, p] : FloatTensors(head)) {
    absl::Status s = (*comm)->AllGather(g->tensors[static_cast<int>(t)].data(), p->n,
                                        sizeof(float));
    if (!s.ok()) return ExportFailed(head, g->version, s);
  }
  // Before the communicator goes: a member that closed its connections while a peer still
  // read its last message would fail that peer's gather.
  if (absl::Status s = (*comm)->Barrier(); !s.ok()) return ExportFailed(head, g->version, s);
  absl::MutexLock lock(&head.mu);
  if (head.version != g->version) {
    return absl::FailedPreconditionError(absl::StrCat(
        HeadWhat(head.name), " moved to version ", head.version, " while version ", g->version,
        " was gathered for its export; export again from the start"));
  }
  head.gathered = g;
  return std::shared_ptr<const GatheredHead>(g);
}

}  // namespace lossd
