// PooledClient: the hosted-head calls, each on the head's replica. A Compute into a head is
// in pooled_client.cc (ComputeInto), with the accumulators'.
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/pooled_client.h"
#include "client/rendezvous.h"

namespace lossd {
namespace client {

std::string PooledClient::HeadLostMessage(const std::string& head, const std::string& endpoint,
                                          const std::string& reason) const {
  return absl::StrCat(
      "head '", head, "' was on replica ", endpoint, ", which ", reason,
      ": its step under way is lost, and the pool never sends a Compute into a head again "
      "elsewhere. Rank ", pool_->options().import_rank,
      " imports the head from its last export (ImportHead: idempotent by head and version, so "
      "a second import is harmless); then every rank calls GetHeadInfo for the version and "
      "redoes the step (its Computes and Step)");
}

absl::StatusOr<PooledClient::Placement> PooledClient::HeadRoute(const std::string& head,
                                                                bool refuse_lost,
                                                                const CallOptions& call) {
  const std::string key = HeadKey(head);
  absl::StatusOr<Placement> p = Route(key, refuse_lost);
  if (!p.ok() || !p->instance.empty()) return p;
  for (const std::string& e : pool_->Order(key)) {
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
  return p;
}

absl::StatusOr<CreateHeadResult> PooledClient::CreateOrImport(
    const std::string& head,
    const std::function<absl::StatusOr<CreateHeadResult>(LossClient*)>& create) {
  const std::string key = HeadKey(head);
  absl::StatusOr<Placement> p = Route(key, false);
  if (!p.ok()) return p.status();
  std::vector<std::string> candidates = {p->endpoint};
  for (std::string& e : pool_->Order(key)) {
    if (e != p->endpoint) candidates.push_back(std::move(e));
  }
  // A whole head (idempotent by version) holds nothing partial: one whose replica is
  // unreachable is created on the next.
  absl::Status last;
  std::string reason;
  for (const std::string& e : candidates) {
    absl::StatusOr<CreateHeadResult> res = create(pool_->Client(e));
    if (res.ok()) {
      Place(key, e, res->head.instance, reason);
      return res;
    }
    std::optional<std::string> lost = Lost(e, res.status(), "");
    if (!lost) return res.status();
    last = res.status();
    reason = absl::StrCat("replica ", e, " ", *lost);
  }
  return last;
}

absl::StatusOr<CreateHeadResult> PooledClient::CreateHead(const CreateHeadRequest& request,
                                                          const CallOptions& call) {
  return CreateOrImport(request.name,
                        [&](LossClient* c) { return c->CreateHead(request, call); });
}

absl::StatusOr<CreateHeadResult> PooledClient::ImportHead(const HeadExport& exported,
                                                          const CallOptions& call) {
  return CreateOrImport(exported.spec.name,
                        [&](LossClient* c) { return c->ImportHead(exported, call); });
}

absl::StatusOr<StepResult> PooledClient::Step(const StepRequest& request,
                                              const CallOptions& call) {
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
  return MarkLost(key, *p, HeadLostMessage(request.head, p->endpoint, *lost));
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
  return MarkLost(key, *p, HeadLostMessage(head, p->endpoint, *lost));
}

absl::StatusOr<HeadExport> PooledClient::ExportHead(const std::string& head,
                                                    const ExportHeadOptions& options,
                                                    const CallOptions& call) {
  return ExportOn(head, call, [&](LossClient* c) { return c->ExportHead(head, options, call); });
}

absl::StatusOr<HeadExport> PooledClient::ExportHeadTo(
    const std::string& head, const std::function<absl::Status(const HeadExport&)>& on_layout,
    const HeadExportSink& sink, const ExportHeadOptions& options, const CallOptions& call) {
  return ExportOn(head, call, [&](LossClient* c) {
    return c->ExportHeadTo(head, on_layout, sink, options, call);
  });
}

absl::StatusOr<HeadInfo> PooledClient::GetHeadInfo(const std::string& head,
                                                   const CallOptions& call) {
  const std::string key = HeadKey(head);
  // Finding it again (where an import put it) clears a loss.
  absl::StatusOr<Placement> p = HeadRoute(head, false, call);
  if (!p.ok()) return p.status();
  absl::StatusOr<HeadInfo> res = pool_->Client(p->endpoint)->GetHeadInfo(head, call);
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
  return MarkLost(key, *p, HeadLostMessage(head, p->endpoint, *lost));
}

absl::Status PooledClient::DropHead(const std::string& head, const CallOptions& call) {
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
