// SPDX-License-Identifier: Apache-2.0
// The two-phase log-prob's part of Engine::Plan (plan.cc): the forward that keeps a ticket
// (ComputeSpec::keep_ms) and the backward that names one (ComputeSpec::ticket). Checks what
// each may send and ask for, naming the header field; reads no tensor data and changes no
// state (the ticket is claimed when the backward runs, run.cc).
#ifndef LOSSD_ENGINE_PLAN_TICKET_H_
#define LOSSD_ENGINE_PLAN_TICKET_H_

#include <string>

#include "absl/status/status.h"
#include "engine/compute_plan.h"
#include "engine/tickets.h"

namespace lossd {

// A backward (spec.ticket set), in place of X's and the weight's planning: the ticket is the
// caller's and held (TicketStore::Get's refusals); the kind is logprob; no overlap; no keep_ms;
// none of
// x, w, bias, targets, class_weights, grad_output, weight_handle, head, head_instance or
// another kind's tensors; at least one of dlogp, dentropy; temperature, softcap,
// ignore_index and chunk_rows, where sent, equal to the forward's; for a head's ticket no
// accumulator, a head_version (if sent) equal to the forward's, and the head still at that
// version (FAILED_PRECONDITION naming both versions). Sets the plan's shape, weights, head
// and ticket, and writes to `effective` the spec the rest of the planning reads (the
// ticket's options with the backward's grad_scale).
absl::Status PlanTicketBackward(const ComputeSpec& spec, TicketStore& tickets,
                                ComputePlan* plan, ComputeSpec* effective);

// keep_ms only with kind logprob and without overlap; checked first, before the options of
// another kind.
absl::Status CheckKeepFirst(const ComputeSpec& spec);

// A forward that keeps (spec.keep_ms > 0), once the rest is planned: kind logprob; no dlogp
// or dentropy, no dx, dw or db, no accumulator, and for a head no rank or micro_batch (a
// forward adds nothing to a step); its ticket's bytes within --ticket_bytes. Sets
// plan->keep_ms and plan->ticket_bytes.
absl::Status PlanTicketForward(const ComputeSpec& spec, const TicketStore& tickets,
                               ComputePlan* plan);

}  // namespace lossd

#endif  // LOSSD_ENGINE_PLAN_TICKET_H_
