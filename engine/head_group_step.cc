// SPDX-License-Identifier: Apache-2.0
// The parts of a hosted head's step that differ in a group of S members (ZeRO-1): the members
// agree on the step's arguments and pool its counts, reduce-scatter the summed gradient in
// place, and sum the slices' squares into the group's norm, all with the group's collectives
// (engine/head_group.h), in one fixed order on every member. head_step.cc calls these only
// for a head with a communicator; a one-server head never reaches this file.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "engine/head_internal.h"
#include "engine/heads.h"

namespace lossd {
namespace {

// A failed collective leaves the members in unknown states (one may have updated its slice,
// another not): the head refuses every later call on this member, as the others do when
// their collective fails, and only an import into a new group continues the run.
absl::Status Collective(Head& head, absl::Status s) {
  if (s.ok()) return s;
  head.broken.store(true);
  return absl::Status(s.code(), absl::StrCat(
      s.message(), ". ", HeadWhat(head.name), " refuses every call from now on, on every "
      "member of its group; import its last export into a new group (nothing of this step "
      "will be applied twice: the step is not retried)"));
}

// What every member of a step must have alike, and the counts the group sums.
enum Field { kVersion, kPhase, kWorldSize, kLr, kClip, kMaxNorm, kSkip, kOptStep, kReduced,
             kAgreed,  // fields before this one must agree
             kContributions = kAgreed, kTokens, kPoisoned, kFields };

}  // namespace

absl::Status CheckGroupCall(const Head& head, const StepCall& call) {
  const uint32_t S = head.group.size();
  if (call.world_size < S) {
    return absl::FailedPreconditionError(absl::StrCat(
        HeadWhat(head.name), " is served by a group of ", S, " members, and each serves at "
        "least one rank: world_size must be >= ", S, ", got ", call.world_size));
  }
  const uint32_t serves = HeadGroupMemberOf(call.rank, S);
  if (serves != head.group.member) {
    return absl::FailedPreconditionError(absl::StrCat(
        HeadWhat(head.name), " is served by a group of ", S, " members; rank ", call.rank,
        "'s Step goes to member ", serves, " (", head.group.members[serves], ", rank % ", S,
        "), not to member ", head.group.member, " (", head.group.members[head.group.member],
        "): route by HeadInfo.group"));
  }
  return absl::OkStatus();
}

uint32_t RanksHere(const Head& head, uint32_t world_size) {
  if (head.comm == nullptr) return world_size;
  return HeadGroupRanksOf(head.group.member, head.group.size(), world_size);
}

absl::Status AgreeAcrossGroup(Head& head, const StepCall& call, int64_t opt_step,
                              bool has_reduced, StepResult& r, bool& poisoned) {
  std::vector<double> mine(kFields);
  mine[kVersion] = static_cast<double>(call.version);
  mine[kPhase] = static_cast<double>(call.phase);
  mine[kWorldSize] = call.world_size;
  mine[kLr] = call.lr.value_or(-1);  // CheckCall: a set lr, clip or max_norm is >= 0
  mine[kClip] = call.clip_coef ? *call.clip_coef : -1;
  mine[kMaxNorm] = call.max_norm.value_or(-1);
  mine[kSkip] = call.skip;
  mine[kOptStep] = static_cast<double>(opt_step);
  mine[kReduced] = has_reduced;
  mine[kContributions] = static_cast<double>(r.contributions);
  mine[kTokens] = static_cast<double>(r.tokens);
  mine[kPoisoned] = poisoned;
  absl::StatusOr<std::vector<double>> all = head.comm->AllGatherValues(mine);
  LOSSD_RETURN_IF_ERROR(Collective(head, all.status()));
  const uint32_t S = head.group.size();
  double contributions = 0, tokens = 0;
  for (uint32_t m = 0; m < S; ++m) {
    const double* theirs = all->data() + m * kFields;
    for (int f = 0; f < kAgreed; ++f) {
      if (theirs[f] == mine[f]) continue;
      // Every member sees the same table, so every member refuses its ranks alike. Nothing
      // ran: the sums stay for a Step the ranks agree on.
      return absl::FailedPreconditionError(absl::StrCat(
          "the ranks of ", HeadWhat(head.name), "'s group disagree on its Step: member ", m,
          " (", head.group.members[m], ") has version ", theirs[kVersion], ", phase ",
          theirs[kPhase], ", world_size ", theirs[kWorldSize], ", lr ", theirs[kLr],
          ", clip_coef ", theirs[kClip], ", max_norm ", theirs[kMaxNorm], ", skip ",
          theirs[kSkip], ", optimizer step ", theirs[kOptStep], ", reduced ", theirs[kReduced],
          "; member ", head.group.member, " has ", mine[kVersion], ", ", mine[kPhase], ", ",
          mine[kWorldSize], ", ", mine[kLr], ", ", mine[kClip], ", ", mine[kMaxNorm], ", ",
          mine[kSkip], ", ", mine[kOptStep], ", ", mine[kReduced], " (-1: unset). Nothing ran "
          "and the step's gradient sums are kept; call Step again on every rank with the same "
          "arguments"));
    }
    contributions += theirs[kContributions];
    tokens += theirs[kTokens];
    poisoned = poisoned || theirs[kPoisoned] != 0;
  }
  r.contributions = static_cast<uint64_t>(contributions);
  r.tokens = static_cast<int64_t>(tokens);
  return absl::OkStatus();
}

absl::StatusOr<double> GroupGradNorm(Backend& b, Head& head) {
  Accumulator& acc = *head.grad;
  if (!head.reduced_in_place) {
    // From here the sum is no longer this member's own: a retry must not reduce it again.
    head.reduced_in_place = true;
    LOSSD_RETURN_IF_ERROR(Collective(
        head, head.comm->ReduceScatter(static_cast<float*>(acc.dw->data()), head.w.n)));
    if (acc.db) {
      LOSSD_RETURN_IF_ERROR(Collective(
          head, head.comm->ReduceScatter(static_cast<float*>(acc.db->data()), head.bias.n)));
    }
  }
  const HeadSlice w = head.w.slice, bias = head.bias.slice;
  LOSSD_ASSIGN_OR_RETURN(
      double ss, b.SumOfSquares(static_cast<const float*>(acc.dw->data()) + w.lo, w.n()));
  if (acc.db) {
    LOSSD_ASSIGN_OR_RETURN(double sb, b.SumOfSquares(
                                          static_cast<const float*>(acc.db->data()) + bias.lo,
                                          bias.n()));
    ss += sb;
  }
  absl::StatusOr<std::vector<double>> all = head.comm->AllGatherValues({ss});
  LOSSD_RETURN_IF_ERROR(Collective(head, all.status()));
  double total = 0;
  for (double v : *all) total += v;  // member order, the same on every member
  return std::sqrt(total);
}

absl::Status GatherCopy(Head& head) {
  const size_t es = DTypeSize(head.dtype);
  LOSSD_RETURN_IF_ERROR(Collective(head, head.comm->AllGather(head.copy->w->data(), head.w.n, es)));
  if (head.has_bias) {
    LOSSD_RETURN_IF_ERROR(
        Collective(head, head.comm->AllGather(head.copy->bias->data(), head.bias.n, es)));
  }
  return absl::OkStatus();
}

}  // namespace lossd
