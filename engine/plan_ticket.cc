// SPDX-License-Identifier: Apache-2.0
#include "engine/plan_ticket.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/loss_problem_check.h"
#include "core/status_macros.h"
#include "engine/message_bounds.h"
#include "engine/request_checks.h"

namespace lossd {
namespace {

const TensorDesc& Input(const ComputeSpec& spec, InputSlot s) {
  return spec.inputs[static_cast<int>(s)];
}

// The first thing a backward sends that its ticket already holds (or that no logprob call
// takes), by its header field name; null when there is none.
const char* KeptField(const ComputeSpec& spec) {
  for (int i = 0; i < static_cast<int>(InputSlot::kCount); ++i) {
    const InputSlot s = static_cast<InputSlot>(i);
    if (s == InputSlot::kDlogp || s == InputSlot::kDentropy) continue;
    if (spec.inputs[i].present) return InputSlotName(s);
  }
  if (!spec.weight_handle.empty()) return "weight_handle";
  if (!spec.teacher_weight_handle.empty()) return "teacher_weight_handle";
  if (!spec.head.empty()) return "head";
  if (!spec.head_instance.empty()) return "head_instance";
  return nullptr;
}

// A loss-shaping option the backward sent that differs from the forward's.
absl::Status SameOptions(const ComputeSpec& spec, const Ticket& t) {
  const LossOptions& o = spec.options;
  const LossOptions& k = t.options;
  auto differs = [&](const char* field, auto sent, auto kept) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.options.", field, " ", sent, " differs from the forward's ", kept,
        " kept by ticket '", t.id, "': a backward computes at the forward's options (leave ",
        field, " unset)"));
  };
  if (spec.temperature_set && o.temperature != k.temperature) {
    return differs("temperature", o.temperature, k.temperature);
  }
  if (o.softcap != 0 && o.softcap != k.softcap) return differs("softcap", o.softcap, k.softcap);
  if (spec.ignore_index_set && o.ignore_index != k.ignore_index) {
    return differs("ignore_index", o.ignore_index, k.ignore_index);
  }
  if (o.chunk_rows != 0 && o.chunk_rows != k.chunk_rows) {
    return differs("chunk_rows", o.chunk_rows, k.chunk_rows);
  }
  return absl::OkStatus();
}

// A head's ticket: the backward adds into the step of the forward's version, so the head must
// still be there at that version (the Compute's own checks at admission and at run follow).
absl::Status PlanTicketHead(const ComputeSpec& spec, const Ticket& t, ComputePlan* plan) {
  if (!spec.accumulator.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.accumulator '", ClippedText(spec.accumulator), "': ticket '", t.id,
        "' was taken against head '", t.head_name, "', whose step is the accumulator"));
  }
  if (spec.head_version != 0 && spec.head_version != t.head_version) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.head_version ", spec.head_version, " differs from the version ",
        t.head_version, " that ticket '", t.id, "' was computed against (leave it unset)"));
  }
  std::shared_ptr<Head> head = t.head.lock();
  uint64_t now = 0;
  bool dropped = head == nullptr;
  if (!dropped) {
    absl::MutexLock lock(&head->mu);
    dropped = head->dropped;
    now = head->version;
  }
  if (dropped) {
    return absl::NotFoundError(absl::StrCat("head '", t.head_name, "' of ticket '", t.id,
                                            "' was dropped; resend X as a one-phase call"));
  }
  LOSSD_RETURN_IF_ERROR(CheckNotBroken(*head));  // a group's says which collective failed
  if (now != t.head_version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ticket '", t.id, "' was computed against head '", t.head_name, "' at version ",
        t.head_version, ", and the head is at version ", now, " now: its weights changed, so "
        "this backward would not be the forward's gradient; compute the micro-batch again "
        "against version ", now));
  }
  plan->weights = head->copy;
  plan->head = std::move(head);
  plan->head_version = t.head_version;
  plan->rank = spec.rank;
  plan->micro_batch = spec.micro_batch;
  plan->owner = spec.owner;
  return absl::OkStatus();
}

// Overlap streams X into the compute as it arrives: a backward streams no X, and a forward
// that keeps hands its whole X buffer to its ticket.
absl::Status RefuseOverlap(const ComputeSpec& spec, const char* field) {
  if (!spec.overlap) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "header.overlap with header.", field,
      ": a two-phase log-prob call is not overlapped; send it without overlap"));
}

}  // namespace

absl::Status PlanTicketBackward(const ComputeSpec& spec, TicketStore& tickets,
                                ComputePlan* plan, ComputeSpec* effective) {
  LOSSD_RETURN_IF_ERROR(CheckIdLength(spec.ticket, "header.ticket"));
  if (spec.kind != LossKind::kLogprob) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.ticket names a two-phase log-prob forward; this request's kind is ",
        LossKindName(spec.kind), " (set kind logprob)"));
  }
  LOSSD_RETURN_IF_ERROR(RefuseOverlap(spec, "ticket"));
  if (spec.keep_ms != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.keep_ms ", spec.keep_ms, " and header.ticket: a backward keeps nothing (a "
        "forward sets keep_ms, its backward names the ticket)"));
  }
  if (const char* field = KeptField(spec); field != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.", field, " is sent with header.ticket: a backward sends only dlogp and/or "
        "dentropy (X, the targets and the weight are the ticket's)"));
  }
  if (!Input(spec, InputSlot::kDlogp).present && !Input(spec, InputSlot::kDentropy).present) {
    return absl::InvalidArgumentError(
        "header.ticket without header.dlogp or header.dentropy: a backward sends the upstream "
        "gradient of the log-probs and/or the entropy (BT) fp32");
  }
  // The options sent are the kind's (cross-entropy's refused by name) before the ticket's
  // replace them.
  LOSSD_RETURN_IF_ERROR(CheckKindOptions(spec.kind, spec.options, false, false));
  LOSSD_ASSIGN_OR_RETURN(std::shared_ptr<const Ticket> t, tickets.Get(spec.ticket, spec.owner));
  LOSSD_RETURN_IF_ERROR(SameOptions(spec, *t));
  plan->bt = t->bt;
  plan->h = t->h;
  plan->v = t->v;
  plan->dtype = t->dtype;
  plan->target_dtype = t->target_dtype;
  plan->has_bias = t->has_bias;
  plan->weights = t->weights;
  plan->weight_handle = t->weight_handle;
  if (!t->head_name.empty()) LOSSD_RETURN_IF_ERROR(PlanTicketHead(spec, *t, plan));
  *effective = spec;
  const float grad_scale = spec.options.grad_scale;
  effective->options = t->options;
  effective->options.grad_scale = grad_scale;
  plan->ticket = std::move(t);
  return absl::OkStatus();
}

absl::Status CheckKeepFirst(const ComputeSpec& spec) {
  if (spec.keep_ms == 0) return absl::OkStatus();
  if (spec.kind != LossKind::kLogprob) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.keep_ms ", spec.keep_ms, " keeps a two-phase log-prob forward; this request's "
        "kind is ", LossKindName(spec.kind), " (set kind logprob)"));
  }
  return RefuseOverlap(spec, "keep_ms");
}

absl::Status PlanTicketForward(const ComputeSpec& spec, const TicketStore& tickets,
                               ComputePlan* plan) {
  LOSSD_RETURN_IF_ERROR(CheckKeepFirst(spec));
  const char* grad = Input(spec, InputSlot::kDlogp).present      ? "dlogp"
                     : Input(spec, InputSlot::kDentropy).present ? "dentropy"
                                                                 : nullptr;
  if (grad != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.", grad, " is sent with header.keep_ms: a forward that keeps sends no upstream "
        "gradient (send it with the backward that names the ticket, or send it now without "
        "keep_ms as a one-phase call)"));
  }
  const WantedOutputs& w = spec.wanted;
  const char* out = w.dx ? "dx" : w.dw ? "dw" : w.db ? "db" : nullptr;
  if (out != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.outputs.", out, " is asked with header.keep_ms: a forward that keeps returns "
        "no gradient (ask for it in the backward that names the ticket)"));
  }
  if (!spec.accumulator.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "header.accumulator '", ClippedText(spec.accumulator), "' is named with "
        "header.keep_ms: a forward adds nothing (name it in the backward)"));
  }
  if (plan->head != nullptr && (spec.rank != 0 || spec.micro_batch != 0)) {
    return absl::InvalidArgumentError(
        "header.rank and micro_batch are set with header.keep_ms: a forward adds nothing to "
        "the head's step (name them in the backward)");
  }
  const uint64_t bytes = TicketBytes(plan->bt, plan->h, plan->v, plan->dtype,
                                     plan->target_dtype, plan->weights == nullptr,
                                     plan->has_bias);
  LOSSD_RETURN_IF_ERROR(tickets.CheckFits(bytes));
  plan->keep_ms = spec.keep_ms;
  plan->ticket_bytes = bytes;
  plan->owner = spec.owner;  // the ticket's
  return absl::OkStatus();
}

}  // namespace lossd
