// SPDX-License-Identifier: Apache-2.0
#include "client/two_phase_logprob.h"

#include <algorithm>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/pooled_client.h"
#include "client/request_views.h"

namespace lossd {
namespace client {
namespace {

constexpr char kFeature[] = "logprob_two_phase";

bool IsGradient(OutputTensor t) {
  return t == OutputTensor::kDx || t == OutputTensor::kDw || t == OutputTensor::kDb;
}

// The caller's output_into buffers of the forward's outputs (`gradients` false: logp,
// entropy) or of the backward's (true: dx, dw, db). A call refuses buffers of outputs it
// does not return, and the forward's must not be written over by a one-phase backward.
std::map<OutputTensor, OutputBuffer> BuffersOf(const ComputeRequest& call, bool gradients) {
  std::map<OutputTensor, OutputBuffer> out;
  for (const auto& [t, buffer] : call.output_into) {
    if (IsGradient(t) == gradients) out[t] = buffer;
  }
  return out;
}

// What Forward takes: the one-phase logprob call less what the helper sets.
absl::Status CheckCall(const ComputeRequest& call, uint32_t keep_ms) {
  if (call.kind != LossKind::kLogprob) {
    return absl::InvalidArgumentError(absl::StrCat(
        "call.kind is ", LossKindName(call.kind), ": TwoPhaseLogprob runs kind logprob"));
  }
  const std::pair<bool, const char*> helpers[] = {
      {call.dlogp.has_value(), "dlogp"},
      {call.dentropy.has_value(), "dentropy"},
      {call.keep_ms != 0, "keep_ms (TwoPhaseOptions::keep_ms sets it)"},
      {!call.ticket.empty(), "ticket"}};
  for (const auto& [given, field] : helpers) {
    if (given) {
      return absl::InvalidArgumentError(absl::StrCat(
          "call.", field, " is set: the forward's call gives neither upstream gradients "
          "(Backward takes them) nor the two-phase fields (the helper's)"));
    }
  }
  const std::pair<bool, const char*> others[] = {
      {call.class_weights.has_value(), "class_weights"},
      {call.grad_output.has_value(), "grad_output"},
      {call.advantages.has_value(), "advantages"},
      {call.old_logp.has_value(), "old_logp"},
      {call.ref_logp.has_value(), "ref_logp"},
      {call.teacher_x.has_value(), "teacher_x"},
      {call.teacher_w.has_value(), "teacher_w"},
      {call.teacher_bias.has_value(), "teacher_bias"},
      {!call.teacher_weight_handle.empty(), "teacher_weight_handle"},
      {call.teacher_topk_ids.has_value(), "teacher_topk_ids"},
      {call.teacher_topk_logp.has_value(), "teacher_topk_logp"}};
  for (const auto& [given, field] : others) {
    if (given) {
      return absl::InvalidArgumentError(
          absl::StrCat("call.", field, " is set: a logprob call does not take it"));
    }
  }
  if (!call.head.empty() && keep_ms == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "call.head '", call.head, "' with TwoPhaseOptions::keep_ms 0: a head's forward that "
        "keeps nothing would add to its step under the backward's step key; keep the forward, "
        "or send the one-phase call (with dlogp) yourself"));
  }
  return absl::OkStatus();
}

// Codes after which a backward may have succeeded on the server, its reply lost.
bool MayHaveSucceeded(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
      return true;
    default:
      return false;
  }
}

// The status `s` with `text` added to its message.
absl::Status Annotated(const absl::Status& s, const std::string& text) {
  return absl::Status(s.code(), absl::StrCat(s.message(), "; ", text));
}

}  // namespace

TwoPhaseLogprob::TwoPhaseLogprob(ComputeFn compute, FeatureFn feature, TwoPhaseOptions options)
    : compute_(std::move(compute)), feature_(std::move(feature)), options_(std::move(options)) {}

TwoPhaseLogprob::TwoPhaseLogprob(LossClient* client, TwoPhaseOptions options)
    : TwoPhaseLogprob(
          [client](const ComputeRequest& r, const CallOptions& o) { return client->Compute(r, o); },
          // The client asks ServerInfo once and remembers the answer.
          [client](const CallOptions& o) { return client->RequireFeature(kFeature, o); },
          std::move(options)) {}

namespace {

// The pool's feature check: ServerInfo of the rank's replica, asked once (replicas of one
// pool run one version); a failed ask is not remembered.
struct PoolFeature {
  absl::Mutex mu;
  std::optional<absl::Status> answer ABSL_GUARDED_BY(mu);
};

}  // namespace

TwoPhaseLogprob::TwoPhaseLogprob(PooledClient* pool, TwoPhaseOptions options)
    : TwoPhaseLogprob(
          [pool](const ComputeRequest& r, const CallOptions& o) { return pool->Compute(r, o); },
          [pool, known = std::make_shared<PoolFeature>()](const CallOptions& o) -> absl::Status {
            absl::MutexLock lock(&known->mu);
            if (known->answer.has_value()) return *known->answer;
            absl::StatusOr<ServerInfoResult> info = pool->ServerInfo(o);
            if (!info.ok()) return info.status();
            const std::vector<std::string>& f = info->features;
            known->answer = std::find(f.begin(), f.end(), kFeature) != f.end()
                                ? absl::OkStatus()
                                : absl::UnimplementedError(absl::StrCat(
                                      "the server (version ", info->version,
                                      ") does not list the feature ", kFeature));
            return *known->answer;
          },
          std::move(options)) {}

void TwoPhaseLogprob::Note(uint64_t TwoPhaseCounts::*event, const absl::Status& why) {
  std::string line;
  {
    absl::MutexLock lock(&mu_);
    ++(counts_.*event);
    if (why.ok()) return;
    last_fallback_ = why;
    const bool forward = event == &TwoPhaseCounts::not_kept;
    bool& logged = forward ? logged_not_kept_ : logged_gone_;
    if (logged || !options_.log) return;
    logged = true;
    line = absl::StrCat("lossd two-phase logprob: ",
                        forward ? "a forward was not kept" : "a ticket was gone at backward",
                        " (", why.ToString(), "): ",
                        forward ? "its backward sends X again" : "X sent again as a one-phase call",
                        " (logged once; TwoPhaseLogprob::counts() counts every time)");
  }
  options_.log(line);  // outside the lock: the caller's function may take its own
}

TwoPhaseCounts TwoPhaseLogprob::counts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}

absl::Status TwoPhaseLogprob::last_fallback() const {
  absl::MutexLock lock(&mu_);
  return last_fallback_;
}

absl::StatusOr<std::optional<ComputeResult>> TwoPhaseLogprob::TryKeep(
    ComputeRequest fwd, const CallOptions& opts, absl::Status* not_kept) {
  bool paused;
  {
    absl::MutexLock lock(&mu_);
    paused = Now() < paused_until_;
  }
  if (paused) {
    // Counted, not logged again: the refusal that began the pause was.
    *not_kept = absl::ResourceExhaustedError("paused after the server refused a ticket");
    Note(&TwoPhaseCounts::not_kept);
    return std::nullopt;
  }
  absl::Status feature = feature_(opts);
  if (feature.code() == absl::StatusCode::kUnimplemented) {
    *not_kept = feature;
    Note(&TwoPhaseCounts::not_kept, feature);
    return std::nullopt;
  }
  if (!feature.ok()) return feature;
  fwd.keep_ms = options_.keep_ms;
  absl::StatusOr<ComputeResult> res = compute_(fwd, opts);
  if (res.ok() && !res->ticket.empty()) {
    Note(&TwoPhaseCounts::tickets);
    return std::optional<ComputeResult>(*std::move(res));
  }
  if (res.ok()) {
    // A server that ignored keep_ms: its reply is the forward's all the same.
    *not_kept = absl::InternalError(absl::StrCat(
        "the server answered a forward with keep_ms ", options_.keep_ms, " without a ticket"));
    Note(&TwoPhaseCounts::not_kept, *not_kept);
    return std::optional<ComputeResult>(*std::move(res));
  }
  if (res.status().code() != absl::StatusCode::kResourceExhausted) return res.status();
  // The ticket budget (or, failing again in the forward sent next, the compute's own memory).
  {
    absl::MutexLock lock(&mu_);
    paused_until_ = Now() + options_.pause_after_refusal;
  }
  *not_kept = res.status();
  Note(&TwoPhaseCounts::not_kept, *not_kept);
  return std::nullopt;
}

absl::StatusOr<LogprobForward> TwoPhaseLogprob::Forward(const ComputeRequest& call,
                                                        const CallOptions& opts) {
  if (absl::Status s = CheckCall(call, options_.keep_ms); !s.ok()) return s;
  ComputeRequest fwd = ViewsOf(call);
  // The forward asks for no gradient and adds nothing: the backward does.
  fwd.want.dx = fwd.want.dw = fwd.want.db = false;
  fwd.grad_dtype.reset();
  fwd.accumulator.clear();
  fwd.rank = 0;
  fwd.micro_batch = 0;
  fwd.output_into = BuffersOf(call, false);

  LogprobForward kept;
  absl::Status not_kept;  // why this forward keeps nothing (OK: it was not asked to)
  std::optional<ComputeResult> reply;
  if (options_.keep_ms > 0) {
    absl::StatusOr<std::optional<ComputeResult>> tried = TryKeep(fwd, opts, &not_kept);
    if (!tried.ok()) return tried.status();
    reply = *std::move(tried);
  }
  if (reply.has_value()) kept.ticket_ = reply->ticket;
  if (kept.ticket_.empty() && !call.head.empty()) {
    return Annotated(not_kept, absl::StrCat(
        "head '", call.head, "': a head's forward that keeps nothing would add to its step "
        "under the backward's step key, so TwoPhaseLogprob sends none; send the one-phase "
        "call (with dlogp) yourself"));
  }
  if (!reply.has_value()) {
    absl::StatusOr<ComputeResult> res = compute_(fwd, opts);
    if (!res.ok()) return res.status();
    reply = *std::move(res);
  }
  kept.result_ = *std::move(reply);
  kept.call_ = ViewsOf(call);
  if (options_.keep_inputs == KeepInputs::kCopy) {
    kept.call_.x = CopyOf(call.x);
    kept.call_.targets = CopyOf(call.targets);
    if (call.w.has_value()) kept.call_.w = CopyOf(*call.w);
    if (call.bias.has_value()) kept.call_.bias = CopyOf(*call.bias);
  }
  kept.call_.output_into = BuffersOf(call, true);
  return kept;
}

absl::StatusOr<ComputeResult> TwoPhaseLogprob::Backward(LogprobForward& forward,
                                                        const LogprobGradients& grads,
                                                        const CallOptions& opts) {
  if (!grads.dlogp.has_value() && !grads.dentropy.has_value()) {
    return absl::InvalidArgumentError(
        "Backward needs grads.dlogp and/or grads.dentropy, (BT) fp32");
  }
  const ComputeRequest& call = forward.call_;
  if (!forward.ticket_.empty()) {
    ComputeRequest b;
    b.kind = LossKind::kLogprob;
    b.ticket = forward.ticket_;
    b.dlogp = ViewOf(grads.dlogp);
    b.dentropy = ViewOf(grads.dentropy);
    b.options = call.options;  // the forward's own values, which a backward may repeat
    b.grad_dtype = call.grad_dtype;
    b.want = call.want;
    b.accumulator = call.accumulator;
    b.rank = call.rank;
    b.micro_batch = call.micro_batch;
    b.output_into = call.output_into;
    absl::StatusOr<ComputeResult> res = compute_(b, opts);
    if (res.ok()) {
      // A success consumed the ticket, so no earlier attempt did (nor added).
      forward.ticket_.clear();
      forward.unsure_ = absl::OkStatus();
      Note(&TwoPhaseCounts::two_phase);
      return res;
    }
    const absl::StatusCode code = res.status().code();
    if (code != absl::StatusCode::kNotFound && code != absl::StatusCode::kFailedPrecondition) {
      if (MayHaveSucceeded(code)) forward.unsure_ = res.status();
      return res.status();
    }
    forward.ticket_.clear();
    if (forward.unsure_.ok() || call.accumulator.empty()) {
      Note(&TwoPhaseCounts::gone, res.status());
    }
  }
  // A head's step key makes its one-phase call idempotent; an accumulator's sum has none.
  if (!forward.unsure_.ok() && !call.accumulator.empty()) {
    return absl::AbortedError(absl::StrCat(
        "an earlier backward of this forward into accumulator '", call.accumulator,
        "' ended unsure (", forward.unsure_.ToString(), ": the server may have added it "
        "before its reply was lost), and no ticket can tell (gone, most likely consumed by "
        "it): a one-phase call could add the micro-batch twice; redo the step (drop the "
        "accumulator)"));
  }
  return OnePhase(forward, grads, opts);
}

absl::StatusOr<ComputeResult> TwoPhaseLogprob::OnePhase(LogprobForward& forward,
                                                        const LogprobGradients& grads,
                                                        const CallOptions& opts) {
  ComputeRequest one = ViewsOf(forward.call_);
  one.dlogp = ViewOf(grads.dlogp);
  one.dentropy = ViewOf(grads.dentropy);
  absl::StatusOr<ComputeResult> res = compute_(one, opts);
  if (res.ok()) {
    Note(&TwoPhaseCounts::one_phase);
  } else if (MayHaveSucceeded(res.status().code())) {
    forward.unsure_ = res.status();  // a Backward again must not add it twice either
  }
  return res;
}

}  // namespace client
}  // namespace lossd
