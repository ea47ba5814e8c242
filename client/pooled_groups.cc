// SPDX-License-Identifier: Apache-2.0
// PooledClient: hosted heads served by a head group (docs/hosted_head.md "Head groups"). Such a
// head has no one replica: every member holds it, and rank r's Computes and Steps go to
// members[HeadGroupMemberOf(r, S)], a function of the member list only, so every rank's pool
// (C++ or Python) sends a rank to the same member. A member lost (unreachable, restarted)
// takes the head with it: ABORTED naming the member and saying to import the last export into
// a new group; nothing is ever sent to another member instead (a Compute sent twice could be
// added twice), and a member that answers that a rank is another's is an error, not a retry.
#include <algorithm>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/pooled_client.h"
#include "client/rendezvous.h"

namespace lossd {
namespace client {
namespace {

// What ExportHeadTo's layout callback answers for a member that only joins the group's
// gather (its first range of the version): the look is all it needs. ABORTED, a code the
// pool never takes for a lost replica (no probe).
constexpr char kLookOnly[] = "lossd.pool: look only";

}  // namespace

std::optional<PooledClient::GroupRoute> PooledClient::GroupFor(const std::string& head,
                                                               const CallOptions& call) {
  const std::string key = HeadKey(head);
  {
    absl::MutexLock lock(&mu_);
    auto it = groups_.find(head);
    if (it != groups_.end()) return it->second;
    if (placed_.count(key) > 0) return std::nullopt;
  }
  // A head this pool has not met: where is it, and is it a group's? (HeadRoute looks the same
  // way for a one-server head; a group's head is on every member.)
  for (const std::string& e : pool_->Order(key)) {
    if (pool_->IsDown(e)) continue;
    absl::StatusOr<HeadInfo> info = pool_->Client(e)->GetHeadInfo(head, call);
    if (!info.ok()) {
      if (info.status().code() == absl::StatusCode::kNotFound || Lost(e, info.status(), "")) {
        continue;
      }
      break;
    }
    if (info->group.size() > 1) return LearnGroup(head, *info, {});
    Place(key, e, info->instance, "");
    return std::nullopt;
  }
  return std::nullopt;
}

PooledClient::GroupRoute PooledClient::LearnGroup(const std::string& head, const HeadInfo& info,
                                                  std::vector<std::string> instances) {
  absl::MutexLock lock(&mu_);
  GroupRoute& g = groups_[head];
  const bool same = g.group.members == info.group.members && g.group.id == info.group.id;
  if (!instances.empty()) {
    g.instances = std::move(instances);
  } else if (!same) {
    g.instances.assign(info.group.size(), "");
  }
  if (g.instances.size() == info.group.size() && g.instances[info.group.member].empty()) {
    g.instances[info.group.member] = info.instance;
  }
  g.group = info.group;
  placed_.erase(HeadKey(head));  // a group's head has no one replica
  return g;
}

void PooledClient::ForgetGroup(const std::string& head) {
  absl::MutexLock lock(&mu_);
  groups_.erase(head);
}

std::string PooledClient::MemberLostMessage(const std::string& head, const GroupRoute& g,
                                            uint32_t m, const std::string& reason) {
  return absl::StrCat(
      "head '", head, "': member ", m, " (", g.group.members[m], ") of its group '", g.group.id,
      "' ", reason, ", and its slice of the head's master and optimizer state and this step's "
      "gradient sum went with it (a group's head never moves to another member). Import the "
      "head's last export into a new group: rank ", pool_->options().import_rank,
      " calls ImportHead(export) with a HeadGroup of the live members and a new id; then every "
      "rank calls GetHeadInfo and redoes the step from its first micro-batch");
}

template <typename T>
absl::StatusOr<T> PooledClient::OnMember(
    const std::string& head, const GroupRoute& g, uint32_t m, int64_t rank,
    const std::function<absl::StatusOr<T>(LossClient*)>& run) {
  const std::string& e = g.group.members[m];
  const std::vector<std::string> replicas = pool_->endpoints();
  if (std::find(replicas.begin(), replicas.end(), e) == replicas.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "head '", head, "': member ", m, " (", e, ") of its group '", g.group.id,
        "' is not one of this pool's replicas (", absl::StrJoin(replicas, ", "),
        "): create the group with the endpoints as the pool names its replicas"));
  }
  absl::StatusOr<T> res = run(pool_->Client(e));
  if (res.ok()) return res;
  const std::string instance = m < g.instances.size() ? g.instances[m] : "";
  if (std::optional<std::string> lost = Lost(e, res.status(), instance)) {
    const std::string why = MemberLostMessage(head, g, m, *lost);
    pool_->CountLost(true, why);
    return absl::AbortedError(why);
  }
  if (rank >= 0 && res.status().code() == absl::StatusCode::kFailedPrecondition &&
      absl::StrContains(res.status().message(), "go to member")) {
    return absl::FailedPreconditionError(absl::StrCat(
        "head '", head, "': this pool sent rank ", rank, " to member ", m, " (", e, "), members[",
        rank, " % ", g.group.size(), "] of group '", g.group.id, "' as it knows it, and that "
        "member answered: ", res.status().message(), ". The pool's group and the server's "
        "differ (the head was created again as another group, or a routing bug); nothing was "
        "sent to another member (a Compute sent twice may be added twice): call "
        "GetHeadInfo('", head, "') to learn the group again"));
  }
  return res;
}

absl::StatusOr<ComputeResult> PooledClient::ComputeInGroup(const GroupRoute& g,
                                                           const ComputeRequest& r,
                                                           const CallOptions& call) {
  const uint32_t m = HeadGroupMemberOf(r.rank, g.group.size());
  absl::StatusOr<ComputeResult> res = OnMember<ComputeResult>(
      r.head, g, m, r.rank, [&](LossClient* c) { return c->Compute(r, call); });
  if (res.ok()) NoteTicket(*res, g.group.members[m]);
  return res;
}

absl::StatusOr<StepResult> PooledClient::StepInGroup(const GroupRoute& g, const StepRequest& r,
                                                     const CallOptions& call) {
  return OnMember<StepResult>(r.head, g, HeadGroupMemberOf(r.rank, g.group.size()), r.rank,
                              [&](LossClient* c) { return c->Step(r, call); });
}

absl::StatusOr<HeadInfo> PooledClient::InfoInGroup(const std::string& head,
                                                   const CallOptions& call) {
  // Learnt again from where the head is now (after an import into a new group, the new one),
  // then asked of the member this rank's Computes go to.
  ForgetGroup(head);
  std::optional<GroupRoute> g = GroupFor(head, call);
  if (!g.has_value()) return GetHeadInfo(head, call);
  absl::StatusOr<HeadInfo> info = OnMember<HeadInfo>(
      head, *g, HeadGroupMemberOf(pool_->options().rank, g->group.size()), -1,
      [&](LossClient* c) { return c->GetHeadInfo(head, call); });
  if (info.ok() && info->group.size() > 1) LearnGroup(head, *info, {});
  return info;
}

absl::StatusOr<HeadExport> PooledClient::ExportInGroup(
    const std::string& head, const GroupRoute& g, const ExportHeadOptions& options,
    const CallOptions& call,
    const std::function<absl::StatusOr<HeadExport>(LossClient*, const ExportHeadOptions&)>& run) {
  // Every member gathers the others' slices for the export's version at its first range of
  // it, so each is asked at once: member 0 streams the export, the others take a look (one
  // range) of the same version.
  ExportHeadOptions pinned = options;
  if (!pinned.version.has_value()) {
    absl::StatusOr<HeadInfo> info = OnMember<HeadInfo>(
        head, g, 0, -1, [&](LossClient* c) { return c->GetHeadInfo(head, call); });
    if (!info.ok()) return info.status();
    pinned.version = info->version;
  }
  std::vector<absl::Status> looks(g.group.size());
  std::vector<std::thread> threads;
  for (uint32_t m = 1; m < g.group.size(); ++m) {
    threads.emplace_back([&, m] {
      ExportHeadOptions look;
      look.version = pinned.version;
      absl::StatusOr<HeadExport> r = OnMember<HeadExport>(head, g, m, -1, [&](LossClient* c) {
        return c->ExportHeadTo(
            head, [](const HeadExport&) { return absl::AbortedError(kLookOnly); },
            [](HeadTensor, uint64_t, const uint8_t*, size_t) { return absl::OkStatus(); },
            look, call);
      });
      looks[m] = r.ok() || r.status().message() == kLookOnly ? absl::OkStatus() : r.status();
    });
  }
  absl::StatusOr<HeadExport> res =
      OnMember<HeadExport>(head, g, 0, -1, [&](LossClient* c) { return run(c, pinned); });
  for (std::thread& t : threads) t.join();
  if (!res.ok()) return res;
  for (uint32_t m = 1; m < g.group.size(); ++m) {
    if (!looks[m].ok()) {
      return absl::Status(looks[m].code(), absl::StrCat("head '", head, "': member ", m, " (",
                                                        g.group.members[m], ") in the export: ",
                                                        looks[m].message()));
    }
  }
  return res;
}

absl::StatusOr<CreateHeadResult> PooledClient::CreateInGroup(
    const std::string& head, const HeadGroup& group,
    const std::function<absl::StatusOr<CreateHeadResult>(LossClient*, const HeadGroup&)>&
        create) {
  const std::vector<std::string> replicas = pool_->endpoints();
  for (size_t m = 0; m < group.size(); ++m) {
    if (std::find(replicas.begin(), replicas.end(), group.members[m]) == replicas.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group.members[", m, "] '", group.members[m], "' is not one of this pool's replicas (",
          absl::StrJoin(replicas, ", "), "): name the members as the pool names its replicas"));
    }
  }
  if (group.id.empty()) {
    return absl::InvalidArgumentError(
        "group.id is empty: a group needs an id of its own (a new one for every group)");
  }
  // Each member's call returns once every member has joined: all at once.
  std::vector<absl::StatusOr<CreateHeadResult>> out(group.size(),
                                                    absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (uint32_t m = 0; m < group.size(); ++m) {
    threads.emplace_back([&, m] {
      HeadGroup mine = group;
      mine.member = m;
      out[m] = create(pool_->Client(group.members[m]), mine);
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::string> instances;
  for (uint32_t m = 0; m < group.size(); ++m) {
    if (!out[m].ok()) {
      return absl::Status(out[m].status().code(),
                          absl::StrCat("head '", head, "': creating it as group '", group.id,
                                       "' failed on member ", m, " (", group.members[m],
                                       "): ", out[m].status().message()));
    }
    instances.push_back(out[m]->head.instance);
  }
  LearnGroup(head, out[0]->head, std::move(instances));
  return out[0];
}

absl::Status PooledClient::DropInGroup(const std::string& head, const GroupRoute& g,
                                       const CallOptions& call) {
  // Every member holds the head; one that does not answer holds nothing to free.
  absl::Status first;
  for (const std::string& e : g.group.members) {
    if (pool_->IsDown(e)) continue;
    absl::Status s = pool_->Client(e)->DropHead(head, call);
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound &&
        s.code() != absl::StatusCode::kUnavailable && first.ok()) {
      first = s;
    }
  }
  ForgetGroup(head);
  return first;
}

}  // namespace client
}  // namespace lossd
