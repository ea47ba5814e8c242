// SPDX-License-Identifier: Apache-2.0
// Engine::Run and what it runs on the executor: the checks that need the bytes (the one
// validation's target range, --check_finite), the backend's Compute into the outputs or into
// an accumulator, and the summary. No gRPC; the caller's done callback gets every outcome.
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/loss_problem_check.h"
#include "core/status_macros.h"
#include "engine/engine.h"
#include "engine/finite_check.h"
#include "engine/overflow_message.h"
#include "engine/request_checks.h"

namespace lossd {
namespace {

double Seconds(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

// The kind's inputs: the per-row fp32 tensors sent (null otherwise) and the teacher, its W
// received inline or the handle's in backend memory.
void SetKindInputs(const ComputePlan& plan, Engine::InputBuffers& in, LossProblem* p) {
  auto f32 = [&](InputSlot s) {
    return reinterpret_cast<const float*>(in[static_cast<int>(s)].get());
  };
  p->kind = plan.kind;
  p->dlogp = f32(InputSlot::kDlogp);
  p->dentropy = f32(InputSlot::kDentropy);
  p->advantages = f32(InputSlot::kAdvantages);
  p->old_logp = f32(InputSlot::kOldLogp);
  p->ref_logp = f32(InputSlot::kRefLogp);
  p->is_ratio = f32(InputSlot::kIsRatio);
  p->policy = plan.policy;
  p->distill = plan.distill;
  if (plan.kind != LossKind::kDistill) return;
  if (plan.teacher_topk > 0) {
    p->teacher_topk = plan.teacher_topk;
    p->teacher_topk_ids = in[static_cast<int>(InputSlot::kTeacherTopkIds)].get();
    p->teacher_topk_id_dtype = plan.teacher_topk_id_dtype;
    p->teacher_topk_logp = f32(InputSlot::kTeacherTopkLogp);
    return;
  }
  p->teacher_h = plan.teacher_h;
  p->teacher_x = in[static_cast<int>(InputSlot::kTeacherX)].get();
  if (plan.teacher_weights) {
    p->teacher_w = plan.teacher_weights->w->data();
    p->teacher_bias = plan.teacher_weights->bias ? plan.teacher_weights->bias->data() : nullptr;
    p->teacher_w_memory = Memory::kBackend;
  } else {
    p->teacher_w = in[static_cast<int>(InputSlot::kTeacherW)].get();
    p->teacher_bias = plan.teacher_has_bias ? in[static_cast<int>(InputSlot::kTeacherBias)].get()
                                            : nullptr;
  }
}

// The problem over the received inputs (or the handle's weights in backend memory).
LossProblem ProblemOf(const ComputePlan& plan, Engine::InputBuffers& in,
                      const OverlapIo& overlap) {
  auto buf = [&](InputSlot s) { return in[static_cast<int>(s)].get(); };
  LossProblem p;
  p.bt = plan.bt;
  p.h = plan.h;
  p.v = plan.v;
  p.dtype = plan.dtype;
  p.x = buf(InputSlot::kX);
  p.targets = buf(InputSlot::kTargets);
  if (plan.ticket) {  // a two-phase backward: the forward's X and targets
    p.x = plan.ticket->x.get();
    p.targets = plan.ticket->targets.get();
  }
  if (plan.weights) {
    p.w = plan.weights->w->data();
    p.bias = plan.weights->bias ? plan.weights->bias->data() : nullptr;
    p.w_memory = Memory::kBackend;
  } else {
    p.w = buf(InputSlot::kW);
    p.bias = plan.has_bias ? buf(InputSlot::kBias) : nullptr;
  }
  p.target_dtype = plan.target_dtype;
  p.class_weights = reinterpret_cast<const float*>(buf(InputSlot::kClassWeights));
  p.grad_output = reinterpret_cast<const float*>(buf(InputSlot::kGradOutput));
  p.options = plan.options;
  p.rows = overlap.rows.get();
  SetKindInputs(plan, in, &p);
  return p;
}

// The --check_finite test of every float input sent inline. Class weights of any sign are
// accepted, as torch's cross_entropy accepts them: mean divides by their sum over the
// non-ignored targets, whatever its sign (see the proto).
absl::Status CheckInputsFinite(const ComputePlan& plan, Engine::InputBuffers& in) {
  auto buf = [&](InputSlot s) { return in[static_cast<int>(s)].get(); };
  // A two-phase backward's X and weight were checked in its forward.
  if (!plan.ticket) {
    LOSSD_RETURN_IF_ERROR(CheckFiniteElements(buf(InputSlot::kX), plan.dtype, 0,
                                              static_cast<uint64_t>(plan.bt) * plan.h, "x",
                                              plan.h));
  }
  if (!plan.weights) {
    LOSSD_RETURN_IF_ERROR(CheckFiniteElements(buf(InputSlot::kW), plan.dtype, 0,
                                              static_cast<uint64_t>(plan.v) * plan.h, "w",
                                              plan.h));
    if (plan.has_bias) {
      LOSSD_RETURN_IF_ERROR(
          CheckFiniteElements(buf(InputSlot::kBias), plan.dtype, 0, plan.v, "bias", 0));
    }
  }
  if (buf(InputSlot::kClassWeights) != nullptr) {
    LOSSD_RETURN_IF_ERROR(CheckFiniteElements(buf(InputSlot::kClassWeights), DType::kF32, 0,
                                              plan.v, "class_weights", 0));
  }
  const InputSlot rows[] = {InputSlot::kGradOutput, InputSlot::kDlogp, InputSlot::kDentropy,
                            InputSlot::kAdvantages, InputSlot::kOldLogp, InputSlot::kRefLogp,
                            InputSlot::kIsRatio};
  for (InputSlot s : rows) {
    if (buf(s) == nullptr) continue;
    LOSSD_RETURN_IF_ERROR(
        CheckFiniteElements(buf(s), DType::kF32, 0, plan.bt, InputSlotName(s), 0));
  }
  if (const auto* rho = reinterpret_cast<const float*>(buf(InputSlot::kIsRatio)); rho != nullptr) {
    for (int64_t i = 0; i < plan.bt; ++i) {  // a ratio: a negative one flips the term's sign
      if (!(rho[i] >= 0.0f)) {
        return absl::InvalidArgumentError(
            absl::StrCat("is_ratio[", i, "] = ", rho[i], " must be >= 0 (a truncated ratio)"));
      }
    }
  }
  // A top-k teacher's log-probs are the one validation's (CheckDistillTopk: counted rows only).
  if (plan.kind != LossKind::kDistill || plan.teacher_topk > 0) return absl::OkStatus();
  const uint64_t ht = static_cast<uint64_t>(plan.teacher_h);
  LOSSD_RETURN_IF_ERROR(CheckFiniteElements(buf(InputSlot::kTeacherX), plan.dtype, 0,
                                            plan.bt * ht, "teacher_x", plan.teacher_h));
  if (plan.teacher_weights) return absl::OkStatus();  // checked when uploaded
  LOSSD_RETURN_IF_ERROR(CheckFiniteElements(buf(InputSlot::kTeacherW), plan.dtype, 0,
                                            plan.v * ht, "teacher_w", plan.teacher_h));
  if (!plan.teacher_has_bias) return absl::OkStatus();
  return CheckFiniteElements(buf(InputSlot::kTeacherBias), plan.dtype, 0, plan.v,
                             "teacher_bias", 0);
}

// What the backend writes for the summary: the scalar loss and z-loss (mean and sum), the
// accuracy and the token count.
struct Scalars {
  float loss = 0, z_loss = 0, accuracy = 0;
  float kl = 0, clip_fraction = 0;  // kPolicy
  int64_t tokens = 0;
};

// Points `out` at the plan's output buffers and at `s`.
void BindOutputs(const ComputePlan& plan, std::vector<HostBuffer>& outputs, Scalars* s,
                 LossOutputs* out) {
  out->grad_dtype = plan.grad_dtype;
  for (size_t i = 0; i < plan.outputs.size(); ++i) {
    BindOutput(plan.outputs[i].slot, outputs[i].get(), out);
  }
  const bool none = plan.options.reduction == Reduction::kNone;
  if (!none) out->loss = &s->loss;
  if (!none && plan.wanted.z_loss) out->z_loss = &s->z_loss;
  // Cheap beside the loss: always computed (cross-entropy's alone).
  if (plan.kind == LossKind::kCrossEntropy) out->accuracy = &s->accuracy;
  if (plan.kind == LossKind::kPolicy) {
    out->kl = &s->kl;
    out->clip_fraction = &s->clip_fraction;
  }
  out->tokens = &s->tokens;
}

// The backend's Compute added into `acc` under its lock: refused while the sum is partial or
// overflowed; any failure leaves it poisoned; a success counts the micro-batch.
void ComputeIntoAccumulator(Backend& backend, const ComputePlan& plan, const LossProblem& p,
                            const LossOutputs& out, const Scalars& s,
                            const std::shared_ptr<Accumulator>& acc, ComputeOutcome* r) {
  absl::MutexLock lock(&acc->mu);
  if (acc->poisoned) {
    r->status = PartialSumError(acc->name);
    return;
  }
  r->status = NonFiniteSumStatus(*acc);
  if (!r->status.ok()) return;
  r->status = backend.Compute(p, out, &r->stats);
  if (r->status.ok() && !LossIsFinite(plan, out)) {
    r->status = absl::InvalidArgumentError(absl::StrCat(
        OverflowMessage(backend, plan, p), " (accumulator '", acc->name, "' received non-finite values "
        "and must be dropped)"));
  }
  if (!r->status.ok()) {
    acc->poisoned = true;
    return;
  }
  SetMicroBatches(*acc, acc->micro_batches + 1);
  acc->tokens += s.tokens;
  ++acc->generation;
  if ((r->stats.nonfinite & (kNonFiniteDw | kNonFiniteDb)) != 0) {
    MarkNonFinite(*acc, r->stats.nonfinite);
  }
  r->accumulated_micro_batches = acc->micro_batches;
  r->added_to = acc;
  r->added_resets = acc->resets;
}

// A Compute on a hosted head: under the step's lock (which the head's update also holds, so
// the copy it reads is whole), the version and the idempotency key decide whether its
// gradient is added. A failure while adding leaves the step's sum partial (Step drops it); a
// call that fails after adding needs nothing undone: its retry, with the same key, is not
// added again.
void ComputeIntoHead(Backend& backend, HeadStore& heads, const ComputePlan& plan,
                     const LossProblem& p, LossOutputs out, const Scalars& s,
                     ComputeOutcome* r) {
  Head& head = *plan.head;
  Accumulator& acc = *head.grad;
  absl::MutexLock lock(&acc.mu);
  if (acc.poisoned) {
    r->status = absl::FailedPreconditionError(absl::StrCat(
        "a Compute failed while adding into head '", head.name, "''s step, so its sum cannot "
        "be trusted: call Step, which drops the step's gradients, and redo the step"));
    return;
  }
  // A non-finite step sum is not refused here (an accumulator's is): an fp16 GradScaler
  // overflow on one rank must not fail the other ranks' Computes; the step's reduce reports
  // it and the ranks skip the step together.
  absl::StatusOr<bool> add =
      heads.CheckAtRun(head, plan.head_version, plan.rank, plan.micro_batch);
  if (!add.ok()) {
    r->status = add.status();
    return;
  }
  if (*add) {
    out.dw_accum = static_cast<float*>(acc.dw->data());
    out.db_accum = acc.db ? static_cast<float*>(acc.db->data()) : nullptr;
    out.accum_memory = Memory::kBackend;
  }
  r->status = ValidateLossOutputs(p, out);
  if (r->status.ok()) r->status = backend.Compute(p, out, &r->stats);
  if (r->status.ok() && !LossIsFinite(plan, out)) {
    r->status = absl::InvalidArgumentError(OverflowMessage(backend, plan, p));
  }
  if (!r->status.ok()) {
    if (*add) acc.poisoned = true;
    return;
  }
  r->head_version = plan.head_version;
  r->head_added = *add;
  if (!*add) return;
  head.keys.insert({plan.rank, plan.micro_batch});
  SetMicroBatches(acc, acc.micro_batches + 1);
  acc.tokens += s.tokens;
  head.step_tokens.fetch_add(s.tokens);
  ++acc.generation;
  if ((r->stats.nonfinite & (kNonFiniteDw | kNonFiniteDb)) != 0) {
    MarkNonFinite(acc, r->stats.nonfinite);
  }
  r->accumulated_micro_batches = acc.micro_batches;
}

// A head's forward that keeps a ticket: computed on the head's copy under the step's lock (so
// the copy it reads is whole) at the version asked, adding nothing to the step.
void ComputeHeadForward(Backend& backend, const ComputePlan& plan, const LossProblem& p,
                        const LossOutputs& out, ComputeOutcome* r) {
  Head& head = *plan.head;
  absl::MutexLock lock(&head.grad->mu);
  {
    absl::MutexLock version_lock(&head.mu);
    if (head.dropped || head.version != plan.head_version) {
      r->status = absl::FailedPreconditionError(absl::StrCat(
          "head '", head.name, "' ", head.dropped ? "was dropped" : "moved on", " while this "
          "forward waited: it asked for version ", plan.head_version, ", the head is at ",
          head.version));
      return;
    }
  }
  r->status = backend.Compute(p, out, &r->stats);
  if (r->status.ok() && !LossIsFinite(plan, out)) {
    r->status = absl::InvalidArgumentError(OverflowMessage(backend, plan, p));
  }
  r->head_version = plan.head_version;
}

// A backward's claim on its ticket: given back unless the backward succeeded (a failed one
// may be retried), consumed if it did.
class TicketClaim {
 public:
  TicketClaim(TicketStore& store, const Ticket& t) : store_(store), t_(t) {}
  ~TicketClaim() {
    if (consumed_) {
      store_.Consume(t_);
    } else {
      store_.Release(t_);
    }
  }
  void Consumed() { consumed_ = true; }

 private:
  TicketStore& store_;
  const Ticket& t_;
  bool consumed_ = false;
};

// The summary: the loss and z-loss (with reduction none, the sum of the per-token values),
// the accuracy and the token count.
void Summarize(const ComputePlan& plan, const LossOutputs& out, const Scalars& s,
               ComputeOutcome* r) {
  if (plan.options.reduction == Reduction::kNone) {
    double sum = 0, zsum = 0;
    const float* l = out.loss;
    for (int64_t i = 0; i < plan.bt; ++i) sum += l[i];
    if (out.z_loss != nullptr) {
      for (int64_t i = 0; i < plan.bt; ++i) zsum += out.z_loss[i];
    }
    r->loss = static_cast<float>(sum);
    r->z_loss = static_cast<float>(zsum);
  } else {
    r->loss = s.loss;
    r->z_loss = s.z_loss;
  }
  r->accuracy = s.accuracy;
  r->kl = s.kl;
  r->clip_fraction = s.clip_fraction;
  r->tokens = s.tokens;
}

}  // namespace

void BindOutput(OutputSlot slot, void* ptr, LossOutputs* out) {
  switch (slot) {
    case OutputSlot::kLoss: out->loss = static_cast<float*>(ptr); break;
    case OutputSlot::kZLoss: out->z_loss = static_cast<float*>(ptr); break;
    case OutputSlot::kLse: out->lse = static_cast<float*>(ptr); break;
    case OutputSlot::kPredictions: out->predictions = static_cast<int64_t*>(ptr); break;
    case OutputSlot::kDx: out->dx = ptr; break;
    case OutputSlot::kDw: out->dw = ptr; break;
    case OutputSlot::kDb: out->db = ptr; break;
    case OutputSlot::kLogp: out->logp = static_cast<float*>(ptr); break;
    case OutputSlot::kEntropy: out->entropy = static_cast<float*>(ptr); break;
    case OutputSlot::kCount: break;
  }
}

void Engine::Run(std::shared_ptr<const ComputePlan> plan, std::shared_ptr<InputBuffers> inputs,
                 std::function<void(ComputeOutcome)> done, absl::Time deadline,
                 bool inputs_checked_finite, OverlapIo overlap,
                 std::function<bool()> cancelled) {
  const absl::Time submitted = absl::Now();
  auto job = [this, plan, inputs, done, submitted, deadline, inputs_checked_finite,
              overlap = std::move(overlap), cancelled = std::move(cancelled)]() {
    const double queued = Seconds(submitted);
    auto not_started = [&](absl::Status why) {
      ComputeOutcome o;
      o.status = std::move(why);
      o.queue_seconds = queued;
      done(std::move(o));
    };
    if (absl::Now() > deadline) {
      return not_started(absl::DeadlineExceededError(absl::StrCat(
          "the deadline passed after ", queued, " s in the compute queue; not started")));
    }
    if (cancelled && cancelled()) {
      return not_started(absl::CancelledError(absl::StrCat(
          "the call was cancelled after ", queued, " s in the compute queue; not started")));
    }
    ComputeOutcome outcome = RunNow(*plan, *inputs, inputs_checked_finite, overlap);
    outcome.queue_seconds = queued;
    done(std::move(outcome));
  };
  if (!plan->head) return executor_.Submit(std::move(job));
  // A Compute of the head's next version waits (off the executor) for the pending step.
  auto resume = [this, job, done, submitted](absl::Status s) {
    if (s.ok()) return executor_.Submit(job);
    ComputeOutcome o;
    o.status = std::move(s);
    o.queue_seconds = Seconds(submitted);
    done(std::move(o));
  };
  absl::StatusOr<bool> now =
      heads_->AdmitCompute(*plan->head, plan->head_version, deadline, resume);
  if (!now.ok()) return resume(now.status());
  if (*now) executor_.Submit(std::move(job));
}

std::vector<HostBuffer> Engine::NewOutputs(const ComputePlan& plan) {
  std::vector<HostBuffer> outputs;
  outputs.reserve(plan.outputs.size());
  for (const OutputDesc& d : plan.outputs) outputs.push_back(NewHostBuffer(d.bytes));
  return outputs;
}

ComputeOutcome Engine::RunNow(const ComputePlan& plan, InputBuffers& in, bool checked_finite,
                              const OverlapIo& overlap) {
  ComputeOutcome r;
  if (overlap.rows != nullptr &&
      (overlap.outputs == nullptr || overlap.outputs->size() != plan.outputs.size() ||
       (options_.check_finite && !checked_finite))) {
    r.status = absl::InternalError(
        "an overlapped compute needs its outputs made beforehand and X checked as it arrives");
    return r;
  }
  // Planning refuses overlap with keep_ms or a ticket (plan_ticket.h); a caller that streams
  // X into a plan made without ComputeSpec::overlap breaks that: the backward would read its
  // ticket's X, and the forward would keep a buffer still being written.
  if (overlap.rows != nullptr && (plan.keep_ms > 0 || plan.ticket)) {
    r.status = absl::InternalError(
        "an overlapped run of a two-phase log-prob plan (keep_ms or ticket), which planning "
        "refuses: the plan was made without ComputeSpec::overlap");
    return r;
  }
  const LossProblem p = ProblemOf(plan, in, overlap);
  // The one validation of the problem (core/loss_problem_check.h), which every backend
  // assumes: the plan has checked all of it but the target range, which needs the bytes.
  r.status = ValidateLossInputs(p);
  if (!r.status.ok()) return r;
  // The other check that needs the bytes: finiteness.
  if (options_.check_finite && !checked_finite) {
    r.status = CheckInputsFinite(plan, in);
    if (!r.status.ok()) return r;
  }

  // A forward that keeps takes its ticket's room before computing (a full store refuses the
  // call before the work); a backward claims its ticket for its run.
  TicketStore::Reservation keep;
  if (plan.keep_ms > 0) {
    absl::StatusOr<TicketStore::Reservation> room = tickets_.Reserve(plan.ticket_bytes);
    if (!room.ok()) {
      r.status = room.status();
      return r;
    }
    keep = std::move(*room);
  }
  std::optional<TicketClaim> claim;
  if (plan.ticket) {
    r.status = tickets_.Claim(*plan.ticket);
    if (!r.status.ok()) return r;
    claim.emplace(tickets_, *plan.ticket);
  }

  LossOutputs out;
  Scalars scalars;
  if (overlap.outputs == nullptr) r.outputs = NewOutputs(plan);
  BindOutputs(plan, overlap.outputs != nullptr ? *overlap.outputs : r.outputs, &scalars, &out);
  std::shared_ptr<Accumulator> acc;
  if (!plan.accumulator.empty()) {
    auto a = accumulators_.GetOrCreate(plan.accumulator, plan.v, plan.h, plan.has_bias,
                                       plan.owner);
    if (!a.ok()) {
      r.status = a.status();
      return r;
    }
    acc = *a;
    out.dw_accum = static_cast<float*>(acc->dw->data());
    out.db_accum = acc->db ? static_cast<float*>(acc->db->data()) : nullptr;
    out.accum_memory = Memory::kBackend;
  }
  // Where the results go, the rest of what a backend assumes (made here, so it holds; a
  // head's are checked once it is known whether the gradient is added).
  if (!plan.head) {
    r.status = ValidateLossOutputs(p, out);
    if (!r.status.ok()) return r;
  }

  if (plan.head && plan.keep_ms > 0) {
    ComputeHeadForward(*backend_, plan, p, out, &r);
    if (!r.status.ok()) return r;
  } else if (plan.head) {
    ComputeIntoHead(*backend_, *heads_, plan, p, out, scalars, &r);
    if (!r.status.ok()) return r;
  } else if (acc) {
    ComputeIntoAccumulator(*backend_, plan, p, out, scalars, acc, &r);
    if (!r.status.ok()) return r;
  } else {
    r.status = backend_->Compute(p, out, &r.stats);
    if (!r.status.ok()) return r;
    // Finite inputs can still push the loss past fp32: refused unless the caller asked for
    // it as computed (a trainer that skips such steps); a sum (accumulator, head) never is.
    if (!plan.allow_nonfinite_loss && !LossIsFinite(plan, out)) {
      r.status = absl::InvalidArgumentError(OverflowMessage(*backend_, plan, p));
      return r;
    }
  }
  if (plan.keep_ms > 0) {
    r.status = KeepTicket(plan, in, std::move(keep), &r);
    if (!r.status.ok()) return r;
  }
  if (claim) claim->Consumed();
  Summarize(plan, out, scalars, &r);
  return r;
}

absl::Status Engine::KeepTicket(const ComputePlan& plan, InputBuffers& in,
                                TicketStore::Reservation room, ComputeOutcome* r) {
  auto t = std::make_unique<Ticket>();
  t->owner = plan.owner;
  t->bt = plan.bt;
  t->h = plan.h;
  t->v = plan.v;
  t->dtype = plan.dtype;
  t->target_dtype = plan.target_dtype;
  t->has_bias = plan.has_bias;
  t->options = plan.options;
  // The request's buffers themselves: no copy (the call sends nothing from them).
  t->x = std::move(in[static_cast<int>(InputSlot::kX)]);
  t->targets = std::move(in[static_cast<int>(InputSlot::kTargets)]);
  t->weight_handle = plan.weight_handle;
  if (plan.head) {
    t->head = plan.head;
    t->head_name = plan.head->name;
    t->head_version = plan.head_version;
  } else if (plan.weights) {
    t->weights = plan.weights;
  } else {
    // Inline W and bias: one copy into backend memory, which every backward then reads.
    auto w = std::make_shared<WeightEntry>();
    w->dtype = plan.dtype;
    w->v = plan.v;
    w->h = plan.h;
    w->owner = plan.owner;
    const uint64_t w_bytes = static_cast<uint64_t>(plan.v) * plan.h * DTypeSize(plan.dtype);
    LOSSD_ASSIGN_OR_RETURN(w->w, backend_->Allocate(w_bytes));
    LOSSD_RETURN_IF_ERROR(
        backend_->CopyToBackend(*w->w, 0, in[static_cast<int>(InputSlot::kW)].get(), w_bytes));
    if (plan.has_bias) {
      const uint64_t b_bytes = plan.v * DTypeSize(plan.dtype);
      LOSSD_ASSIGN_OR_RETURN(w->bias, backend_->Allocate(b_bytes));
      LOSSD_RETURN_IF_ERROR(backend_->CopyToBackend(
          *w->bias, 0, in[static_cast<int>(InputSlot::kBias)].get(), b_bytes));
    }
    t->weights = std::move(w);
  }
  std::shared_ptr<const Ticket> kept =
      tickets_.Insert(std::move(t), std::move(room), plan.keep_ms);
  r->ticket = kept->id;
  r->ticket_expires_unix_ms = kept->expires_ns / 1000000;
  return absl::OkStatus();
}

}  // namespace lossd
