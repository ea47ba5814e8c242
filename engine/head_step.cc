// SPDX-License-Identifier: Apache-2.0
// The step of a hosted head: a barrier over the step's ranks (Step), the phase it launches on
// the executor (the gradient norm, the optimizer update, the compute copy's refresh), and the
// watchdog that ends barriers whose ranks never all arrive. The update runs under the
// gradient sum's lock, which every Compute on the head holds for its whole run: no Compute
// sees a half-updated W, and a step runs beside Computes of other heads.
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "engine/head_internal.h"
#include "engine/heads.h"

namespace lossd {
namespace {

using StepDone = std::function<void(absl::StatusOr<StepResult>)>;

const char* PhaseName(StepPhase p) {
  switch (p) {
    case StepPhase::kFull: return "STEP_FULL";
    case StepPhase::kReduce: return "STEP_REDUCE";
    case StepPhase::kApply: return "STEP_APPLY";
  }
  return "unknown";
}

std::string Describe(const StepCall& c) {
  return absl::StrCat("(version ", c.version, ", world_size ", c.world_size, ", ",
                      PhaseName(c.phase), ", lr ", c.lr ? absl::StrCat(*c.lr) : "unset",
                      ", clip_coef ", c.clip_coef ? absl::StrCat(*c.clip_coef) : "unset",
                      ", max_norm ", c.max_norm ? absl::StrCat(*c.max_norm) : "unset",
                      ", skip ", c.skip ? "true" : "false", ")");
}

absl::Status CheckCall(const StepCall& c) {
  constexpr uint32_t kMaxWorldSize = 1 << 16;
  if (c.world_size < 1 || c.world_size > kMaxWorldSize || c.rank >= c.world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "step needs 1 <= world_size <= ", kMaxWorldSize, " and rank < world_size, got rank ",
        c.rank, ", world_size ", c.world_size));
  }
  if (c.phase == StepPhase::kReduce && (c.lr || c.clip_coef || c.max_norm || c.skip)) {
    return absl::InvalidArgumentError(
        "STEP_REDUCE only reads the gradient norm: lr, clip_coef, max_norm and skip belong "
        "to STEP_APPLY");
  }
  if (c.lr && !(*c.lr >= 0 && std::isfinite(*c.lr))) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be finite and >= 0, got ", *c.lr));
  }
  if (c.clip_coef && !(*c.clip_coef >= 0 && std::isfinite(*c.clip_coef))) {
    return absl::InvalidArgumentError(
        absl::StrCat("clip_coef must be finite and >= 0, got ", *c.clip_coef));
  }
  if (c.max_norm && !(*c.max_norm > 0 && std::isfinite(*c.max_norm))) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_norm must be finite and > 0, got ", *c.max_norm));
  }
  if (c.clip_coef && c.max_norm) {
    return absl::InvalidArgumentError(
        "give clip_coef (the trainer's own clipping) or max_norm (clip the head alone), not "
        "both");
  }
  return absl::OkStatus();
}

// Zeroes the step's sum and forgets its keys: after an update, a skip, or a dropped step.
absl::Status ClearStep(Backend& b, Head& head) ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu) {
  Accumulator& acc = *head.grad;
  absl::Status s = b.Zero(*acc.dw);
  if (s.ok() && acc.db) s = b.Zero(*acc.db);
  if (!s.ok()) {
    acc.poisoned = true;
    return s;
  }
  SetMicroBatches(acc, 0);
  acc.tokens = 0;
  acc.poisoned = false;
  acc.nonfinite_by.clear();
  ++acc.generation;
  head.reduced_in_place = false;
  head.keys.clear();
  head.step_tokens.store(0);
  return absl::OkStatus();
}

// The summed gradient's L2 norm over W and the bias, accumulated in double.
absl::StatusOr<double> GradNorm(Backend& b, Head& head) ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu) {
  if (head.comm != nullptr) return GroupGradNorm(b, head);
  const Accumulator& acc = *head.grad;
  LOSSD_ASSIGN_OR_RETURN(double ss, b.SumOfSquares(static_cast<const float*>(acc.dw->data()),
                                                   head.w.n));
  if (acc.db) {
    LOSSD_ASSIGN_OR_RETURN(double sb, b.SumOfSquares(static_cast<const float*>(acc.db->data()),
                                                     head.bias.n));
    ss += sb;
  }
  return std::sqrt(ss);
}

// torch.nn.utils.clip_grad_norm_'s coefficient, in its fp32 arithmetic:
// clamp(max_norm / (total_norm + 1e-6), max=1).
float ClipCoefOf(double max_norm, double norm) {
  const float c = static_cast<float>(max_norm) / (static_cast<float>(norm) + 1e-6f);
  return c < 1.0f ? c : 1.0f;
}

// One optimizer update of W and the bias, and the compute copy's refresh.
absl::Status Update(Backend& b, Head& head, double lr, float coef, int64_t step)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu) {
  const HeadOptimizer& o = head.optimizer;
  OptimizerParams p;
  p.kind = o.kind;
  p.lr = lr;
  p.momentum = o.momentum;
  p.dampening = o.dampening;
  p.nesterov = o.nesterov;
  p.momentum_initialised = step > 1;
  p.beta1 = o.beta1;
  p.beta2 = o.beta2;
  p.eps = o.eps;
  p.amsgrad = o.amsgrad;
  p.step = step;
  p.grad_scale = coef;
  // This server's slice of each parameter (all of it for a one-server head): the master and
  // the state hold just the slice, the gradient sum and the compute copy the whole tensor.
  auto one = [&](HeadParam& param, const BackendBuffer* grad, BackendBuffer* copy,
                 double weight_decay) {
    OptimizerTensors t;
    t.n = param.slice.n();
    t.param = static_cast<float*>(param.master->data());
    t.grad = static_cast<const float*>(const_cast<BackendBuffer*>(grad)->data()) +
             param.slice.lo;
    for (int i = 0; i < 3; ++i) {
      float* s = param.state[i] ? static_cast<float*>(param.state[i]->data()) : nullptr;
      (i == 0 ? t.state1 : i == 1 ? t.state2 : t.state3) = s;
    }
    t.copy = static_cast<uint8_t*>(copy->data()) + param.slice.lo * DTypeSize(head.dtype);
    t.copy_dtype = head.dtype;
    p.weight_decay = weight_decay;
    return b.OptimizerStep(p, t);
  };
  LOSSD_RETURN_IF_ERROR(one(head.w, head.grad->dw.get(), head.copy->w.get(), o.weight_decay));
  if (head.has_bias) {
    LOSSD_RETURN_IF_ERROR(
        one(head.bias, head.grad->db.get(), head.copy->bias.get(), o.bias_weight_decay));
  }
  if (head.comm != nullptr) return GatherCopy(head);
  return absl::OkStatus();
}

// The apply of a completed barrier (STEP_FULL or STEP_APPLY): skip, refuse (nothing to
// apply, or a sum that is not finite), or update W and clear the step. OK: the version moves.
absl::Status ApplyOrSkip(Backend& b, Head& head, const StepCall& call, double lr,
                         int64_t opt_step, StepResult& r, bool& keep_sum)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu) {
  if (call.skip) return ClearStep(b, head);
  if (r.contributions == 0) {
    // torch's optimizers leave a parameter without a gradient as it is; applying an empty
    // sum would still run weight decay and advance AdamW's step count.
    return absl::FailedPreconditionError(absl::StrCat(
        "the Step of ", HeadWhat(head.name), " version ", r.version, " has no contributions "
        "(no Compute added into it, or its gradients were dropped): nothing was applied, so "
        "W, the optimizer state and the step count are unchanged; redo the step's Computes "
        "at version ", r.version, " and call Step again, or call Step with skip to move past "
        "it"));
  }
  if (!r.finite) {
    keep_sum = true;
    return absl::FailedPreconditionError(absl::StrCat(
        "the summed gradient of ", HeadWhat(head.name), " is not finite (norm ", r.grad_norm,
        "): nothing was applied; call Step with skip (as GradScaler skips an fp16 step) to "
        "drop it"));
  }
  r.clip_coef = call.clip_coef ? *call.clip_coef
                : call.max_norm ? ClipCoefOf(*call.max_norm, r.grad_norm)
                                : 1.0f;
  absl::Status s = Update(b, head, lr, r.clip_coef, opt_step + 1);
  if (!s.ok()) {
    head.broken.store(true);
    return s;
  }
  r.applied = true;
  return ClearStep(b, head);
}

// Everything before the apply: in a group, the members' agreement and pooled counts; then
// the refusal of a sum a failed Compute poisoned, the norm a STEP_REDUCE already found (for its
// STEP_APPLY), or the norm. `keep_sum`: refused with nothing run, so the sum stays.
absl::Status NormOf(Backend& b, Head& head, const StepCall& call, int64_t opt_step,
                    const std::optional<StepResult>& reduced, StepResult& r, bool& keep_sum)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.grad->mu) {
  bool poisoned = head.grad->poisoned;
  if (head.comm != nullptr) {
    // Before anything runs: a disagreement keeps the sum (as one server's refusal does).
    absl::Status s = AgreeAcrossGroup(head, call, opt_step, reduced.has_value(), r, poisoned);
    keep_sum = !s.ok() && !head.broken.load();
    if (!s.ok()) return s;
  }
  if (poisoned) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a Compute failed while adding into ", HeadWhat(head.name), "'s step, so its sum "
        "cannot be trusted: the step's gradients are dropped; redo the step at version ",
        r.version));
  }
  if (call.phase == StepPhase::kApply && reduced) {
    r.grad_norm = reduced->grad_norm;
    r.finite = reduced->finite;
    return absl::OkStatus();
  }
  absl::StatusOr<double> norm = GradNorm(b, head);
  if (!norm.ok()) return norm.status();
  r.grad_norm = *norm;
  r.finite = std::isfinite(*norm);
  return absl::OkStatus();
}

// A call answered without joining the barrier: a retried step's result again, or a refusal.
// `disagrees`: the call names the step with another version, phase or arguments than the
// head or the ranks at its barrier, so those ranks cannot complete the step with this one.
struct Answer {
  absl::StatusOr<StepResult> result;
  bool disagrees = false;
};

std::optional<Answer> AnswerNow(const Head& head, const StepCall& call)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.mu) {
  const std::string what = HeadWhat(head.name);
  if (call.version < head.version) {
    // A retry of the step just completed gets its result again.
    if (head.last && head.last->first.SameArguments(call)) {
      StepResult again = head.last->second;
      again.replayed = true;
      return Answer{again};
    }
    return Answer{absl::FailedPreconditionError(absl::StrCat(
        what, " is at version ", head.version, "; the step of version ", call.version,
        " is over"))};
  }
  if (call.version > head.version) {
    return Answer{absl::FailedPreconditionError(absl::StrCat(
                      what, " is at version ", head.version, ", not ", call.version)),
                  true};
  }
  if (call.phase == StepPhase::kApply && !head.reduced) {
    return Answer{absl::FailedPreconditionError(absl::StrCat(
                      "STEP_APPLY of ", what, " version ", call.version,
                      " before its STEP_REDUCE")),
                  true};
  }
  if (call.phase != StepPhase::kApply && head.reduced) {
    if (call.phase == StepPhase::kReduce) {
      StepResult again = *head.reduced;  // a retried reduce
      again.replayed = true;
      return Answer{again};
    }
    return Answer{absl::FailedPreconditionError(absl::StrCat(
                      "version ", call.version, " of ", what,
                      " has been reduced; finish it with STEP_APPLY")),
                  true};
  }
  if (head.barrier && !head.barrier->first.SameArguments(call)) {
    return Answer{absl::FailedPreconditionError(""), true};  // RefuseEveryRank says how
  }
  for (const auto& [rank, other] : head.disagreeing) {
    if (!other.SameArguments(call)) {
      return Answer{absl::FailedPreconditionError(""), true};  // RefuseEveryRank says how
    }
  }
  return std::nullopt;
}

// Refuses a call that disagrees with its step, and with it every rank waiting at the barrier
// (moved into `refused`), at once rather than after --head_step_timeout: none of them can
// complete the step with this rank. Nothing ran, so W, the optimizer state, the step's
// gradient sum and a STEP_REDUCE already done are kept for a Step the ranks agree on. With
// no rank waiting, the call is remembered, so the next rank to arrive with other arguments
// is refused at once too, naming it; that rank has then heard of it, so it is forgotten (a
// retry of both ranks with new, agreed arguments must not be refused for it).
absl::Status RefuseEveryRank(Head& head, const StepCall& call, const absl::Status& reason,
                             std::vector<StepDone>& refused)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(head.mu) {
  std::string others;
  if (head.barrier) {
    std::vector<uint32_t> ranks;
    for (auto& [rank, d] : head.barrier->waiting) {
      ranks.push_back(rank);
      refused.push_back(std::move(d));
    }
    others = absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "),
                          " called it with ", Describe(head.barrier->first),
                          " and waited at its barrier");
    head.barrier.reset();
  } else {
    for (auto it = head.disagreeing.begin(); it != head.disagreeing.end(); ++it) {
      if (it->second.SameArguments(call)) continue;
      others = absl::StrCat("rank ", it->first, " called it with ", Describe(it->second),
                            " and was refused");
      head.disagreeing.erase(it);
      break;
    }
  }
  const bool plain = reason.message().empty();  // only the arguments differ
  if (others.empty()) {  // no other rank of the step has called yet
    head.disagreeing[call.rank] = call;
    return plain ? absl::FailedPreconditionError("every rank of a step must agree") : reason;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", call.rank, " called Step of ", HeadWhat(head.name), " with ", Describe(call),
      ", but ", others, plain ? "" : absl::StrCat(" (", reason.message(), ")"),
      ": every rank of a step must agree, so every rank waiting for it is refused. Nothing "
      "ran: W, the optimizer state and the step's gradient sum are kept (", HeadWhat(head.name),
      " is at version ", head.version, "); call Step again on every rank with the same "
      "arguments"));
}

}  // namespace

void HeadStore::Step(const StepCall& call, const std::string& caller, StepDone done) {
  if (absl::Status s = CheckCall(call); !s.ok()) return done(s);
  auto got = impl_->Get(call.head, caller);
  if (!got.ok()) return done(got.status());
  std::shared_ptr<Head> head = *std::move(got);
  if (absl::Status s = CheckNotBroken(*head); !s.ok()) return done(s);
  if (head->comm != nullptr) {
    if (absl::Status s = CheckGroupCall(*head, call); !s.ok()) return done(s);
  }
  StepDone superseded;
  std::vector<StepDone> waiters, refused;
  std::optional<Answer> answer;
  {
    absl::MutexLock lock(&head->mu);
    head->disagreeing.erase(call.rank);  // this rank's latest call is the one that counts
    answer = AnswerNow(*head, call);
    if (answer && answer->disagrees) {
      answer->result = RefuseEveryRank(*head, call, answer->result.status(), refused);
    }
    if (!answer) {
      if (!head->barrier) head->barrier = Head::Barrier{call, absl::Now(), {}};
      auto& waiting = head->barrier->waiting;
      if (auto it = waiting.find(call.rank); it != waiting.end()) {
        superseded = std::move(it->second);
      }
      waiting[call.rank] = std::move(done);
      if (waiting.size() == RanksHere(*head, call.world_size)) {
        head->sealed = true;
        for (auto& [rank, d] : waiting) waiters.push_back(std::move(d));
        head->barrier.reset();
      }
    }
  }
  if (answer) {
    for (auto& d : refused) d(answer->result.status());
    return done(std::move(answer->result));
  }
  if (superseded) {
    superseded(absl::AbortedError(absl::StrCat("superseded by a later Step call of rank ",
                                               call.rank)));
  }
  if (!waiters.empty()) impl_->LaunchPhase(head, call, std::move(waiters));
}

void HeadStore::Impl::LaunchPhase(std::shared_ptr<Head> head, StepCall call,
                                  std::vector<StepDone> waiters) {
  Backend* b = backend;
  executor->Submit([b, head, call, waiters = std::move(waiters)]() {
    const absl::Time start = absl::Now();
    absl::StatusOr<StepResult> out;
    std::vector<Head::Parked> resume;
    {
      absl::MutexLock grad_lock(&head->grad->mu);
      StepResult r;
      r.contributions = head->grad->micro_batches;
      r.tokens = head->grad->tokens;
      absl::Status s;
      bool keep_sum = false;  // a refused apply leaves the sum for a skip
      std::optional<StepResult> reduced;
      int64_t opt_step;
      double lr;
      {
        absl::MutexLock lock(&head->mu);
        reduced = head->reduced;
        opt_step = head->optimizer_step;
        lr = call.lr.value_or(head->optimizer.lr);
        r.version = head->version;
      }
      s = NormOf(*b, *head, call, opt_step, reduced, r, keep_sum);
      bool applied_or_skipped = false;
      if (s.ok() && call.phase != StepPhase::kReduce) {
        s = ApplyOrSkip(*b, *head, call, lr, opt_step, r, keep_sum);
        applied_or_skipped = s.ok();
      } else if (!s.ok() && !head->broken.load() && !keep_sum) {
        ClearStep(*b, *head).IgnoreError();  // a dropped step: the poisoned sum goes
      }
      r.step_seconds = absl::ToDoubleSeconds(absl::Now() - start);
      absl::MutexLock lock(&head->mu);
      if (s.ok() && call.phase == StepPhase::kReduce) {
        head->reduced = r;  // sealed until the apply
      } else {
        if (applied_or_skipped) {
          ++head->version;
          head->disagreeing.clear();  // calls of the version that is over
          head->gathered.reset();     // a group export's gather of the version that is over
          if (r.applied) ++head->optimizer_step;
          r.version = head->version;
          head->last = std::make_pair(call, r);
        }
        head->reduced.reset();
        if (!keep_sum) head->sealed = false;
        // Computes that waited for this version run now; if it did not move, they cannot
        // (but a refused apply keeps them: a skip may still complete the step).
        if (!keep_sum) resume.swap(head->parked);
      }
      out = s.ok() ? absl::StatusOr<StepResult>(r) : absl::StatusOr<StepResult>(s);
    }
    for (auto& p : resume) {
      p.resume(out.ok() ? absl::OkStatus()
                        : absl::FailedPreconditionError(absl::StrCat(
                              "the step this Compute waited for failed: ", out.status().message())));
    }
    for (auto& done : waiters) done(out);
  });
}

void HeadStore::Impl::Tick(absl::Time now) {
  std::vector<std::shared_ptr<Head>> heads;
  {
    absl::MutexLock lock(&mu);
    for (const auto& [name, head] : map) heads.push_back(head);
  }
  for (const auto& head : heads) {
    std::vector<StepDone> timed_out;
    std::vector<Head::Parked> expired;
    std::string missing;
    bool drop_step = false;
    {
      absl::MutexLock lock(&head->mu);
      if (head->barrier && now - head->barrier->opened > options.step_timeout) {
        std::vector<uint32_t> absent;
        const uint32_t S = head->group.size();
        for (uint32_t r = 0; r < head->barrier->first.world_size && absent.size() < 16; ++r) {
          // A group member's barrier waits only for the ranks it serves.
          if (head->comm != nullptr && HeadGroupMemberOf(r, S) != head->group.member) continue;
          if (head->barrier->waiting.count(r) == 0) absent.push_back(r);
        }
        missing = absl::StrJoin(absent, ", ");
        for (auto& [rank, d] : head->barrier->waiting) timed_out.push_back(std::move(d));
        head->barrier.reset();
        head->sealed = true;  // no Compute adds until the sum is dropped (below)
        drop_step = true;
      }
      for (auto it = head->parked.begin(); it != head->parked.end();) {
        if (drop_step || now > it->deadline) {
          expired.push_back(std::move(*it));
          it = head->parked.erase(it);
        } else {
          ++it;
        }
      }
    }
    const std::string why = absl::StrCat(
        "the Step barrier of ", HeadWhat(head->name), " timed out after ",
        absl::FormatDuration(options.step_timeout), " (--head_step_timeout) waiting for ranks ",
        missing, ": the step's gradients are dropped and W is unchanged; redo the step");
    // The sum is dropped before anyone is told, so a rank that retries finds it gone.
    if (drop_step) {
      Backend* b = backend;
      executor->Submit([b, head] {
        absl::MutexLock grad_lock(&head->grad->mu);
        ClearStep(*b, *head).IgnoreError();
        absl::MutexLock lock(&head->mu);
        head->reduced.reset();
        head->sealed = false;
      });
    }
    for (auto& done : timed_out) done(absl::DeadlineExceededError(why));
    for (auto& p : expired) {
      p.resume(drop_step ? absl::FailedPreconditionError(why)
                         : absl::DeadlineExceededError(
                               "the deadline passed while this Compute waited for the step of "
                               "the previous version"));
    }
  }
}

}  // namespace lossd
