// SPDX-License-Identifier: Apache-2.0
// PooledClient: the hosted-head calls, each on the head's replica. A Compute into a head is
// in pooled_client.cc (ComputeInto), with the accumulators'; a head group's calls are in
// pooled_groups.cc.
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/pooled_client.h"
#include "client/rendezvous.h"

namespace lossd {
namespace client {

std::string PooledClient::HeadLostMessage(const std::string& head, const Placement& p,
                                          const std::string& reason) {
  return absl::StrCat(
      "head '", head, "' was on replica ", p.endpoint, ", which ", reason,
      ": its step under way is lost, and the pool never sends a Compute into a head again "
      "elsewhere. Rank ", pool_->options().import_rank,
      " imports the head from its last export (ImportHead, which goes to replica ",
      NextAfterLoss(HeadKey(head), p),
      " in every rank's pool; idempotent by head and version, so a second import is "
      "harmless); then every rank calls GetHeadInfo for the version and redoes the step (its "
      "Computes and Step)");
}

absl::StatusOr<PooledClient::Placement> PooledClient::HeadRoute(const std::string& head,
                                                                bool refuse_lost,
                                                                const CallOptions& call) {
  const std::string key = HeadKey(head);
  absl::StatusOr<Placement> p = Route(key, refuse_lost);
  if (!p.ok() || !p->instance.empty()) return p;
  // A head lost on a replica is looked for on the others only, from its home after the loss:
  // the replica that lost it holds at best a stale or second copy.
  std::vector<std::string> look = pool_->Order(key);
  if (!p->previous.empty()) {
    look = HomeOrder(key, p->previous);
    look.pop_back();
  }
  for (const std::string& e : look) {
    if (pool_->IsDown(e)) continue;
    absl::StatusOr<HeadInfo> info = pool_->Client(e)->GetHeadInfo(head, call);
    if (info.ok()) {
      Place(key, e, info->instance, "");
      p->endpoint = e;
      p->instance = info->instance;
      return p;
    }
    // Not there, or that replica is gone: look further. Anything else is the caller's to
    // hear from the call itself.
    if (info.status().code() == absl::StatusCode::kNotFound) continue;
    if (Lost(e, info.status(), "")) continue;
    break;
  }
  // Found nowhere: its home, unless the lookup just found that one unreachable.
  if (pool_->IsDown(p->endpoint)) p->endpoint = FirstFor(key, p->previous);
  return p;
}

absl::StatusOr<CreateHeadResult> PooledClient::CreateOrImport(
    const std::string& head,
    const std::function<absl::StatusOr<CreateHeadResult>(LossClient*)>& create,
    const CallOptions& call) {
  const std::string key = HeadKey(head);
  absl::Status last;
  std::string reason;
  // A whole head (idempotent by version) holds nothing partial: one whose replica is
  // unreachable is created on the home after it. Each try loses one replica (or marks one
  // down), so one try per replica and one more suffice.
  for (size_t tries = 0; tries <= pool_->endpoints().size(); ++tries) {
    absl::StatusOr<Placement> placed = Route(key, false);
    if (!placed.ok()) return placed.status();
    if (!placed->instance.empty()) {
      // Placed here before: this pool may not have met the head's loss yet. A replica that
      // restarted since is empty and would create a second head, beside the one the ranks
      // that met the loss import on the home after it: ask its instance first.
      absl::StatusOr<std::string> now = pool_->Instance(placed->endpoint);
      if (now.ok() && *now != placed->instance) {
        const std::string lost = absl::StrCat("restarted: it is now server instance '", *now,
                                              "', not '", placed->instance, "'");
        (void)MarkLost(key, *placed, HeadLostMessage(head, *placed, lost));
        reason = absl::StrCat("replica ", placed->endpoint, " ", lost);
      }
    }
    // Not placed (or lost): where a replica already holds it (another rank imported it),
    // else its home.
    absl::StatusOr<Placement> p = HeadRoute(head, false, call);
    if (!p.ok()) return p.status();
    absl::StatusOr<CreateHeadResult> res = create(pool_->Client(p->endpoint));
    if (res.ok()) {
      Place(key, p->endpoint, res->head.instance, reason);
      return res;
    }
    std::optional<std::string> lost = Lost(p->endpoint, res.status(), p->instance);
    if (!lost) return res.status();
    last = res.status();
    reason = absl::StrCat("replica ", p->endpoint, " ", *lost);
    // A placed head went with its replica; one not placed yet moves on to the next replica
    // of its order (Order() puts the one just found unreachable last).
    if (!p->instance.empty()) (void)MarkLost(key, *p, HeadLostMessage(head, *p, *lost));
  }
  return last;
}

absl::StatusOr<CreateHeadResult> PooledClient::CreateHead(const CreateHeadRequest& request,
                                                          const CallOptions& call) {
  if (request.group.size() > 1) {
    return CreateInGroup(request.name, request.group,
                         [&](LossClient* c, const HeadGroup& mine) {
                           CreateHeadRequest r = request;
                           r.group = mine;
                           return c->CreateHead(r, call);
                         });
  }
  ForgetGroup(request.name);
  if (request.group.size() == 1) {
    // A group of one is a one-server head, placed on that member.
    CreateHeadRequest r = request;
    r.group = {};
    Place(HeadKey(r.name), request.group.members[0], "", "");
    return CreateOrImport(r.name, [&](LossClient* c) { return c->CreateHead(r, call); }, call);
  }
  return CreateOrImport(
      request.name, [&](LossClient* c) { return c->CreateHead(request, call); }, call);
}

absl::StatusOr<CreateHeadResult> PooledClient::ImportHead(const HeadExport& exported,
                                                          const CallOptions& call) {
  ForgetGroup(exported.spec.name);
  return CreateOrImport(
      exported.spec.name, [&](LossClient* c) { return c->ImportHead(exported, call); }, call);
}

absl::StatusOr<CreateHeadResult> PooledClient::ImportHead(const HeadExport& exported,
                                                          const HeadGroup& group,
                                                          const CallOptions& call) {
  if (group.size() <= 1) return ImportHead(exported, call);
  return CreateInGroup(exported.spec.name, group, [&](LossClient* c, const HeadGroup& mine) {
    return c->ImportHead(exported, mine, call);
  });
}

absl::StatusOr<StepResult> PooledClient::Step(const StepRequest& request,
                                              const CallOptions& call) {
  if (std::optional<GroupRoute> g = GroupFor(request.head, call)) {
    return StepInGroup(*g, request, call);
  }
  const std::string key = HeadKey(request.head);
  absl::StatusOr<Placement> p = HeadRoute(request.head, true, call);
  if (!p.ok()) return p.status();
  absl::StatusOr<StepResult> res = pool_->Client(p->endpoint)->Step(request, call);
  if (res.ok()) {
    Place(key, p->endpoint, res->instance, "", /*keep_lost=*/true);
    return res;
  }
  std::optional<std::string> lost = Lost(p->endpoint, res.status(), p->instance);
  if (!lost) return res.status();
  return MarkLost(key, *p, HeadLostMessage(request.head, *p, *lost));
}

absl::StatusOr<HeadExport> PooledClient::ExportOn(
    const std::string& head, const CallOptions& call,
    const std::function<absl::StatusOr<HeadExport>(LossClient*)>& run) {
  const std::string key = HeadKey(head);
  absl::StatusOr<Placement> p = HeadRoute(head, true, call);
  if (!p.ok()) return p.status();
  absl::StatusOr<HeadExport> res = run(pool_->Client(p->endpoint));
  if (res.ok()) {
    Place(key, p->endpoint, res->instance, "", /*keep_lost=*/true);
    return res;
  }
  std::optional<std::string> lost = Lost(p->endpoint, res.status(), p->instance);
  if (!lost) return res.status();
  return MarkLost(key, *p, HeadLostMessage(head, *p, *lost));
}

absl::StatusOr<HeadExport> PooledClient::ExportHead(const std::string& head,
                                                    const ExportHeadOptions& options,
                                                    const CallOptions& call) {
  if (std::optional<GroupRoute> g = GroupFor(head, call)) {
    return ExportInGroup(head, *g, options, call,
                         [&](LossClient* c, const ExportHeadOptions& o) {
                           return c->ExportHead(head, o, call);
                         });
  }
  return ExportOn(head, call, [&](LossClient* c) { return c->ExportHead(head, options, call); });
}

absl::StatusOr<HeadExport> PooledClient::ExportHeadTo(
    const std::string& head, const std::function<absl::Status(const HeadExport&)>& on_layout,
    const HeadExportSink& sink, const ExportHeadOptions& options, const CallOptions& call) {
  if (std::optional<GroupRoute> g = GroupFor(head, call)) {
    return ExportInGroup(head, *g, options, call,
                         [&](LossClient* c, const ExportHeadOptions& o) {
                           return c->ExportHeadTo(head, on_layout, sink, o, call);
                         });
  }
  return ExportOn(head, call, [&](LossClient* c) {
    return c->ExportHeadTo(head, on_layout, sink, options, call);
  });
}

absl::StatusOr<HeadInfo> PooledClient::GetHeadInfo(const std::string& head,
                                                   const CallOptions& call) {
  if (GroupFor(head, call).has_value()) return InfoInGroup(head, call);
  const std::string key = HeadKey(head);
  // Finding it again (where an import put it) clears a loss.
  absl::StatusOr<Placement> p = HeadRoute(head, false, call);
  if (!p.ok()) return p.status();
  absl::StatusOr<HeadInfo> res = pool_->Client(p->endpoint)->GetHeadInfo(head, call);
  if (res.ok() && res->group.size() > 1) {
    // Created again as a group's head (by another trainer) where this pool placed one
    // server's: route by the group from now on.
    LearnGroup(head, *res, {});
    return res;
  }
  if (res.ok()) {
    Place(key, p->endpoint, res->instance, p->previous.empty() ? "" : "found there again");
    return res;
  }
  if (p->lost && res.status().code() == absl::StatusCode::kNotFound) {
    return absl::NotFoundError(absl::StrCat(
        res.status().message(), " (on replica ", p->endpoint, "; it was lost with replica ",
        p->previous, ": rank ", pool_->options().import_rank,
        " imports it from its last export)"));
  }
  if (p->instance.empty()) return res.status();
  std::optional<std::string> lost = Lost(p->endpoint, res.status(), p->instance);
  if (!lost) return res.status();
  return MarkLost(key, *p, HeadLostMessage(head, *p, *lost));
}

absl::Status PooledClient::DropHead(const std::string& head, const CallOptions& call) {
  if (std::optional<GroupRoute> g = GroupFor(head, call)) return DropInGroup(head, *g, call);
  const std::string key = HeadKey(head);
  absl::StatusOr<Placement> p = Route(key, false);
  if (!p.ok()) return p.status();
  absl::Status s = pool_->Client(p->endpoint)->DropHead(head, call);
  {
    absl::MutexLock lock(&mu_);
    placed_.erase(key);
  }
  return s;
}

}  // namespace client
}  // namespace lossd
