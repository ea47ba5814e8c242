// SPDX-License-Identifier: Apache-2.0
// The head store: names, owners, the budget, Info / List / Drop / the idle TTL, the watchdog,
// and the two hooks of the Compute path (admission by version, the idempotency key).
#include "engine/heads.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "engine/head_internal.h"
#include "engine/message_bounds.h"

namespace lossd {

int HeadOptimizer::states() const {
  if (kind == OptimizerKind::kAdamW) return amsgrad ? 3 : 2;
  return momentum != 0 ? 1 : 0;
}

bool HeadOptimizer::operator==(const HeadOptimizer& o) const {
  return kind == o.kind && lr == o.lr && weight_decay == o.weight_decay &&
         bias_weight_decay == o.bias_weight_decay && momentum == o.momentum &&
         dampening == o.dampening && nesterov == o.nesterov && beta1 == o.beta1 &&
         beta2 == o.beta2 && eps == o.eps && amsgrad == o.amsgrad;
}

const char* HeadTensorName(HeadTensor t) {
  switch (t) {
    case HeadTensor::kMasterW: return "master_w";
    case HeadTensor::kMasterBias: return "master_bias";
    case HeadTensor::kExpAvgW: return "exp_avg_w";
    case HeadTensor::kExpAvgBias: return "exp_avg_bias";
    case HeadTensor::kExpAvgSqW: return "exp_avg_sq_w";
    case HeadTensor::kExpAvgSqBias: return "exp_avg_sq_bias";
    case HeadTensor::kMaxExpAvgSqW: return "max_exp_avg_sq_w";
    case HeadTensor::kMaxExpAvgSqBias: return "max_exp_avg_sq_bias";
    case HeadTensor::kCopyW: return "copy_w";
    case HeadTensor::kCopyBias: return "copy_bias";
    case HeadTensor::kCount: break;
  }
  return "unknown";
}

bool StepCall::SameArguments(const StepCall& o) const {
  return head == o.head && version == o.version && world_size == o.world_size &&
         phase == o.phase && lr == o.lr && clip_coef == o.clip_coef && max_norm == o.max_norm &&
         skip == o.skip;
}

absl::Status ValidateHeadName(const std::string& name, absl::string_view field) {
  // The same alphabet and length as accumulator names (and the same message).
  return ValidateAccumulatorName(name, field);
}

std::string HeadWhat(const std::string& name) { return absl::StrCat("head '", name, "'"); }

absl::Status CheckNotBroken(const Head& head) {
  if (!head.broken.load()) return absl::OkStatus();
  const std::string why = head.comm != nullptr ? head.comm->AbortReason() : std::string();
  if (why.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        HeadWhat(head.name), " failed midway through an update and refuses every call; drop "
        "it and import its last export"));
  }
  // A group's member is never reused once a collective failed: the members may disagree on
  // what ran, and a member that comes back starts with nothing.
  return absl::FailedPreconditionError(absl::StrCat(
      HeadWhat(head.name), " of head group '", head.group.id, "' refuses every call: ", why,
      ". Nothing is applied twice: drop it and import its last export into a new group (a new "
      "id, with the members that are up)"));
}

uint64_t HeadBytes(const HeadSpec& spec) {
  const int64_t nw = spec.v * spec.h, nb = spec.has_bias ? spec.v : 0;
  const uint32_t S = spec.group.size(), m = spec.group.member;
  const uint64_t n = static_cast<uint64_t>(nw + nb);
  // This member's slices of the master and the state (all of them for S = 1).
  const uint64_t mine = static_cast<uint64_t>(HeadSliceOf(nw, m, S).n() +
                                              HeadSliceOf(nb, m, S).n());
  // master + state (fp32, this member's slice), the gradient sum (fp32) and the compute copy
  // (whole on every member).
  return mine * (4 + 4 * static_cast<uint64_t>(spec.optimizer.states())) + n * 4 +
         n * DTypeSize(spec.compute_dtype);
}

BackendBuffer* HeadBuffer(Head& head, HeadTensor t) {
  const int i = static_cast<int>(t);
  if (t == HeadTensor::kCopyW) return head.copy->w.get();
  if (t == HeadTensor::kCopyBias) return head.copy->bias.get();
  HeadParam& p = (i % 2 == 0) ? head.w : head.bias;
  if (i < 2) return p.master.get();
  const int state = i / 2 - 1;  // exp_avg 0, exp_avg_sq 1, max_exp_avg_sq 2
  return p.state[state].get();
}

std::vector<std::pair<HeadTensor, uint64_t>> ExportTensors(const HeadSummary& s) {
  HeadSpec spec = HeadStore::SpecOf(s);
  spec.with_state = true;
  std::vector<std::pair<HeadTensor, uint64_t>> t = HeadStore::ImportTensors(spec);
  const uint64_t copy = static_cast<uint64_t>(s.v) * s.h * DTypeSize(s.dtype);
  t.emplace_back(HeadTensor::kCopyW, copy);
  if (s.has_bias) t.emplace_back(HeadTensor::kCopyBias, s.v * DTypeSize(s.dtype));
  return t;
}

HeadStore::Impl::Impl(Backend* b, Executor* e, Options o)
    : backend(b),
      executor(e),
      options(std::move(o)),
      held(std::make_shared<std::atomic<uint64_t>>(0)),
      watchdog_([this] { WatchdogLoop(); }) {}

HeadStore::Impl::~Impl() { Shutdown(); }

void HeadStore::Impl::Shutdown() {
  {
    absl::MutexLock lock(&watchdog_mu_);
    stop_ = true;
  }
  if (watchdog_.joinable()) watchdog_.join();
}

void HeadStore::Impl::WatchdogLoop() {
  absl::MutexLock lock(&watchdog_mu_);
  // A quarter of a second: barrier timeouts are minutes, parked deadlines seconds.
  while (!watchdog_mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(250))) {
    watchdog_mu_.Unlock();
    Tick(absl::Now());
    watchdog_mu_.Lock();
  }
}

absl::StatusOr<std::shared_ptr<Head>> HeadStore::Impl::Get(const std::string& name,
                                                          const std::string& caller) {
  LOSSD_RETURN_IF_ERROR(ValidateHeadName(name, "head"));
  std::shared_ptr<Head> head;
  {
    absl::MutexLock lock(&mu);
    auto it = map.find(name);
    if (it == map.end()) {
      return absl::NotFoundError(absl::StrCat(
          HeadWhat(name), " not found on this server (instance '", options.instance,
          "'): never created here, dropped, or lost in a restart; create it, or import its "
          "last export"));
    }
    head = it->second;
  }
  LOSSD_RETURN_IF_ERROR(CheckOwner(head->owner, caller, HeadWhat(name)));
  head->last_used_ns.store(NowNs());
  return head;
}

HeadSummary HeadStore::Impl::Summarize(Head& head) {
  HeadSummary s;
  s.name = head.name;
  s.v = head.v;
  s.h = head.h;
  s.has_bias = head.has_bias;
  s.dtype = head.dtype;
  s.optimizer = head.optimizer;
  s.bytes = head.bytes;
  s.contributions = head.grad->listed_micro_batches.load();
  s.last_used_ns = head.last_used_ns.load();
  s.tokens = head.step_tokens.load();
  s.group = head.group;
  absl::MutexLock lock(&head.mu);
  s.version = head.version;
  s.optimizer_step = head.optimizer_step;
  s.ranks_waiting = head.barrier ? static_cast<uint32_t>(head.barrier->waiting.size()) : 0;
  return s;
}

HeadStore::HeadStore(Backend* backend, Executor* executor, Options options)
    : impl_(std::make_unique<Impl>(backend, executor, std::move(options))) {}

HeadStore::~HeadStore() = default;

void HeadStore::Shutdown() { impl_->Shutdown(); }

HeadSpec HeadStore::SpecOf(const HeadSummary& s) {
  HeadSpec spec;
  spec.name = s.name;
  spec.v = s.v;
  spec.h = s.h;
  spec.has_bias = s.has_bias;
  spec.master_dtype = DType::kF32;
  spec.compute_dtype = s.dtype;
  spec.optimizer = s.optimizer;
  spec.version = s.version;
  spec.optimizer_step = s.optimizer_step;
  spec.with_state = s.optimizer.states() > 0;
  return spec;
}

absl::StatusOr<HeadSummary> HeadStore::Info(const std::string& name, const std::string& caller) {
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, impl_->Get(name, caller));
  return Impl::Summarize(*head);
}

absl::Status HeadStore::CheckInstance(const std::string& name, const std::string& named,
                                      absl::string_view field, const std::string& caller) {
  const std::string& instance = impl_->options.instance;
  if (named.empty() || named == instance) return absl::OkStatus();
  const std::string what = HeadWhat(ClippedText(name));
  const std::string wrong = absl::StrCat(field, " '", ClippedText(named),
                                         "' is not this server (instance '", instance, "'): ");
  std::shared_ptr<Head> head;
  {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->map.find(name);
    if (it != impl_->map.end() && OwnerAllows(it->second->owner, caller)) head = it->second;
  }
  if (head != nullptr && head->exported_by == named) {
    // A server restarted with --head_export_dir: the caller's head came back with it.
    return absl::FailedPreconditionError(absl::StrCat(
        wrong, what, " is here: this server imported it as it started, from the export "
        "instance '", named, "' wrote as it stopped (--head_export_dir), at version ",
        head->imported_version, ". Nothing needs importing: call HeadInfo (head_info) for its "
        "instance and version, and name instance '", instance, "' from now on"));
  }
  if (head != nullptr) {
    uint64_t version;
    {
      absl::MutexLock lock(&head->mu);
      version = head->version;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        wrong, what, " lived on server instance '", ClippedText(named), "'; a head of that "
        "name is here (version ", version, "), created or imported since: call HeadInfo "
        "(head_info) to check that it is the one you mean"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      wrong, what, " lives on server instance '", ClippedText(named), "' (another replica, or "
      "this server before a restart, which loses every head it had not exported); create or "
      "import the head here"));
}

absl::Status HeadStore::Drop(const std::string& name, const std::string& caller) {
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<Head> head, impl_->Get(name, caller));
  {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->map.find(name);
    if (it == impl_->map.end() || it->second != head) return absl::OkStatus();  // raced a drop
    impl_->map.erase(it);
  }
  std::vector<std::function<void(absl::StatusOr<StepResult>)>> waiters;
  std::vector<Head::Parked> parked;
  {
    absl::MutexLock lock(&head->mu);
    head->dropped = true;
    if (head->barrier) {
      for (auto& [rank, done] : head->barrier->waiting) waiters.push_back(std::move(done));
      head->barrier.reset();
    }
    parked.swap(head->parked);
  }
  const absl::Status why = absl::NotFoundError(absl::StrCat(HeadWhat(name), " was dropped"));
  for (auto& done : waiters) done(why);
  for (auto& p : parked) p.resume(why);
  return absl::OkStatus();
}

std::vector<std::pair<std::string, std::string>> HeadStore::Owners() const {
  std::vector<std::pair<std::string, std::string>> out;
  absl::MutexLock lock(&impl_->mu);
  for (const auto& [name, head] : impl_->map) out.emplace_back(name, head->owner);
  std::sort(out.begin(), out.end());  // the map's order is not stable; the log's is
  return out;
}

std::vector<StateInfo> HeadStore::List(const std::string& caller) const {
  std::vector<std::shared_ptr<Head>> heads;
  {
    absl::MutexLock lock(&impl_->mu);
    for (const auto& [name, head] : impl_->map) {
      if (OwnerAllows(head->owner, caller)) heads.push_back(head);
    }
  }
  std::vector<StateInfo> out;
  for (const auto& head : heads) {
    HeadSummary s = Impl::Summarize(*head);
    StateInfo info;
    info.kind = StateInfo::Kind::kHead;
    info.name = s.name;
    info.bytes = s.bytes;
    info.last_used_ns = s.last_used_ns;
    info.micro_batches = s.contributions;
    info.version = s.version;
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<std::string> HeadStore::DropIdle(int64_t before_ns) {
  std::vector<std::pair<std::string, std::string>> idle;  // name, owner
  {
    absl::MutexLock lock(&impl_->mu);
    for (const auto& [name, head] : impl_->map) {
      if (head->last_used_ns.load() < before_ns) idle.emplace_back(name, head->owner);
    }
  }
  std::vector<std::string> lines;
  for (const auto& [name, owner] : idle) {
    if (Drop(name, owner).ok()) {
      lines.push_back(absl::StrCat(HeadWhat(name), " dropped: idle past the TTL"));
    }
  }
  return lines;
}

size_t HeadStore::count() const {
  absl::MutexLock lock(&impl_->mu);
  return impl_->map.size();
}

uint64_t HeadStore::bytes() const { return impl_->held->load(); }

absl::StatusOr<std::shared_ptr<Head>> HeadStore::Get(const std::string& name,
                                                     const std::string& caller) {
  return impl_->Get(name, caller);
}

namespace {

absl::Status VersionError(const Head& head, uint64_t asked, uint64_t current,
                          absl::string_view why) {
  return absl::FailedPreconditionError(absl::StrCat(
      HeadWhat(head.name), " is at version ", current, ", and this Compute names version ",
      asked, ": ", why));
}

}  // namespace

absl::StatusOr<bool> HeadStore::AdmitCompute(Head& head, uint64_t version, absl::Time deadline,
                                             std::function<void(absl::Status)> resume) {
  absl::MutexLock lock(&head.mu);
  if (head.dropped) return absl::NotFoundError(absl::StrCat(HeadWhat(head.name), " was dropped"));
  if (version < head.version) {
    return VersionError(head, version, head.version,
                        "its step has been applied; compute against the current version");
  }
  if (version == head.version) {
    if (head.sealed) {
      return VersionError(head, version, head.version,
                          "every rank has called Step for it, so its sum is closed; compute "
                          "against the next version");
    }
    return true;
  }
  if (version == head.version + 1 && (head.barrier || head.sealed)) {
    head.parked.push_back(Head::Parked{version, deadline, std::move(resume)});
    return false;
  }
  return VersionError(head, version, head.version,
                      "a version not reached yet (call Step for the current one first)");
}

absl::StatusOr<bool> HeadStore::CheckAtRun(Head& head, uint64_t version, uint32_t rank,
                                           uint64_t micro_batch) {
  {
    absl::MutexLock lock(&head.mu);
    if (head.dropped) {
      return absl::NotFoundError(absl::StrCat(HeadWhat(head.name), " was dropped"));
    }
    if (version != head.version || head.sealed) {
      return VersionError(head, version, head.version,
                          head.sealed ? "its step is closed (every rank has called Step)"
                                      : "its step was applied while this Compute waited");
    }
  }
  if (head.comm != nullptr) {
    // A rank's Computes go to one member only: a retry sent to another would add twice.
    const uint32_t S = head.group.size();
    const uint32_t serves = HeadGroupMemberOf(rank, S);
    if (serves != head.group.member) {
      return absl::FailedPreconditionError(absl::StrCat(
          HeadWhat(head.name), " is served by a group of ", S, " members; rank ", rank,
          "'s Computes and Steps go to member ", serves, " (", head.group.members[serves],
          ", rank % ", S, "), not to member ", head.group.member, " (",
          head.group.members[head.group.member], "): route by HeadInfo.group"));
    }
  }
  if (head.keys.contains({rank, micro_batch})) return false;
  // A step holds one key per micro-batch of every rank; this bounds what a client can make
  // the server remember.
  constexpr size_t kMaxKeysPerStep = 1 << 20;
  if (head.keys.size() >= kMaxKeysPerStep) {
    return absl::ResourceExhaustedError(absl::StrCat(
        HeadWhat(head.name), " holds ", head.keys.size(), " Computes in this step, the most "
        "one step may hold; call Step"));
  }
  return true;
}

}  // namespace lossd
