# SPDX-License-Identifier: Apache-2.0
"""lossd.rl's per-token log-probs and entropy as a torch.autograd.Function, in one phase or
two (docs/rl_clients.md). Imports torch.

A trainer's loss depends on the log-probs non-linearly (PPO's clipped ratio, a KL term), so
their upstream gradient is known only at backward: forward asks the server for logp and
entropy alone, and backward sends dlogp and dentropy for dX, dW and db. Either way the server
computes the logits in each phase (8 BT H V flops in all, against 6 for one call whose
upstream gradients are known in advance); what differs is what travels:

- one-phase (keep_ms 0): backward sends X again (and W, where it is not cached on the
  server) with the upstream gradients.
- two-phase (keep_ms > 0, servers listing "logprob_two_phase"): forward asks the server to
  keep X, the targets and the weight under a ticket for keep_ms; backward sends only dlogp and
  dentropy, naming the ticket (lossd._two_phase).

Where the two-phase form cannot be had, the one-phase call stands in, and the first time on
each runtime that is logged (logger "lossd.rl") with the reason: the server lacks the feature,
or will not keep this forward (its ticket budget is full: RESOURCE_EXHAUSTED; then the
forwards of the next PAUSE_AFTER_REFUSAL_S do not ask), or at backward
the ticket is gone (NOT_FOUND: expired, consumed, unknown; FAILED_PRECONDITION: taken by
another server instance, a restart or another replica). Any other error propagates.
runtime.two_phase_counts counts what happened (see _note).
"""

import logging
import time

import torch

from lossd import errors
from lossd._rl_common import _flat, _fp32, _grad, _grad_dtype, _grad_kw, _once, _runtime
from lossd._two_phase import check_keep_ms
from lossd.nn import _to_torch, compute_dtype

log = logging.getLogger("lossd.rl")

FEATURE = "logprob_two_phase"
DEFAULT_KEEP_MS = 60_000  # long enough for a forward and its backward on a loaded trainer
# After the server would not keep a forward (its ticket budget full), the forwards of the next
# seconds keep nothing: a refusal may come after X arrived, and asking again at once would
# send most of them twice, while the backwards of the tickets held free the budget.
PAUSE_AFTER_REFUSAL_S = 5.0


def _note(runtime, event, why=None):
    """Counts `event` in runtime.two_phase_counts: "tickets" (forwards that took one),
    "two_phase" (backwards by ticket), "not_kept" (forwards that wanted a ticket and got
    none), "gone" (backwards whose ticket was gone) and "one_phase" (backwards that sent X
    again: after "gone", a retained graph's second backward, or a forward without a ticket).
    Logs `why` the first time the runtime counts the event."""
    runtime.two_phase_counts[event] += 1
    if why is not None and event not in runtime.two_phase_logged:
        runtime.two_phase_logged.add(event)
        log.warning("%s (logged once; runtime.two_phase_counts counts every time)", why)


def _keeps(runtime):
    """Whether to ask the runtime's server to keep this forward: it keeps tickets (the
    client asks it once) and did not refuse one in the last PAUSE_AFTER_REFUSAL_S."""
    if time.monotonic() < runtime.two_phase_paused_until:
        return False
    try:
        runtime.client.require_feature(FEATURE, timeout=runtime.timeout)
    except errors.UnimplementedError as e:
        _note(runtime, "not_kept",
              "lossd.rl: the server keeps no two-phase log-prob tickets (%s): each backward "
              "sends X again" % e.message)
        return False
    return True


def _forward(runtime, x, weight, labels, bias, temperature, keep_ms):
    """(ComputeResult of the forward, its ticket or None). W and the bias travel in x's
    dtype (the compute dtype)."""
    kw = dict(kind="logprob", temperature=temperature, want_entropy=True, want_dx=False,
              want_dw=False, want_db=False, weight_dtype=x.dtype)
    if keep_ms and _keeps(runtime):
        try:
            r = runtime.compute(x, weight, labels, bias, keep_ms=keep_ms, **kw)
        except errors.ResourceExhaustedError as e:
            # The ticket budget (or, then failing again below, the compute's own memory).
            runtime.two_phase_paused_until = time.monotonic() + PAUSE_AFTER_REFUSAL_S
            _note(runtime, "not_kept",
                  "lossd.rl: the server would not keep a two-phase ticket (%s): this "
                  "forward's backward sends X again" % e.message)
        else:
            if r.ticket:
                _note(runtime, "tickets")
                return r, r.ticket
            raise errors.ProtocolError("a forward with keep_ms %d came back without a ticket"
                                       % keep_ms, method="Compute")
    return runtime.compute(x, weight, labels, bias, **kw), None


def _by_ticket(runtime, ticket, kw):
    """The backward naming `ticket`; None where the ticket is gone (send the one-phase
    call)."""
    try:
        r = runtime.client.compute(None, None, None, ticket=ticket, timeout=runtime.timeout, **kw)
    except errors.ClientClosedError:
        raise
    except (errors.NotFoundError, errors.FailedPreconditionError) as e:
        # A FAILED_PRECONDITION that is not the ticket's (a poisoned accumulator, say) is
        # refused again to the one-phase call, and propagates from there.
        _note(runtime, "gone", "lossd.rl: a two-phase ticket was gone at backward (%s): X "
              "sent again as a one-phase call" % e.message)
        return None
    _note(runtime, "two_phase")
    return r


class LossdLogprobFunction(torch.autograd.Function):
    """apply(x (BT, H), weight (V, H), bias or None, labels (BT), temperature, runtime,
    keep_ms=0) -> (logp (BT) fp32, entropy (BT) fp32). keep_ms > 0: the two-phase form (a
    ticket is taken whatever the grad mode; lossd.rl's functions pass 0 where no backward can
    follow). Computed in x's dtype, or under torch.autocast in its dtype (W and the bias cast
    to it, as Liger's chunked GRPO casts W to the hidden dtype); dX, dW and db come back in
    x's, weight's and bias's own dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, labels, temperature, runtime, keep_ms=0):
        ctx.set_materialize_grads(False)
        ctx.cdt = compute_dtype(x)  # autocast is on here (if at all), not in backward
        r, ctx.ticket = _forward(runtime, x.to(ctx.cdt), weight, labels, bias,
                                 float(temperature), check_keep_ms(keep_ms))
        ctx.save_for_backward(x, weight, bias, labels)
        ctx.temperature, ctx.runtime = float(temperature), runtime
        dev = x.device
        return _to_torch(r.logp, dev).clone(), _to_torch(r.entropy, dev).clone()

    @staticmethod
    def backward(ctx, dlogp, dentropy):
        _once()
        x, weight, bias, labels = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        if (dlogp is None and dentropy is None) or not (need_dx or need_dw or need_db):
            return (None,) * 7
        rt = ctx.runtime
        kw = dict(kind="logprob", dlogp=_fp32(dlogp), dentropy=_fp32(dentropy),
                  want_dx=need_dx, want_dw=need_dw, want_db=bool(need_db and bias is not None),
                  grad_dtype=_grad_dtype(ctx.cdt, x if need_dx else None,
                                         weight if need_dw else None, bias if need_db else None),
                  **_grad_kw(rt))
        # A ticket serves one backward: a retained graph's next one sends X.
        ticket, ctx.ticket = ctx.ticket, None
        r = None if ticket is None else _by_ticket(rt, ticket, kw)
        if r is None:
            r = rt.compute(x.to(ctx.cdt), weight, labels, bias, temperature=ctx.temperature,
                           weight_dtype=ctx.cdt, **kw)
            _note(rt, "one_phase")
        held = rt.accumulator is not None  # dW and db went into it
        return (_grad(r.dx, x) if need_dx else None,
                _grad(r.dw, weight) if need_dw and not held else None,
                _grad(r.db, bias) if need_db and bias is not None and not held else None,
                None, None, None, None)


def logprob_entropy(hidden, weight, labels, temperature, bias, runtime, server, keep_ms):
    """(logp, entropy) of hidden's leading shape through LossdLogprobFunction; a ticket only
    where a backward can follow (grad enabled and an input requiring grad)."""
    x2, t1 = _flat(hidden, labels)
    rt = _runtime(runtime, server)
    keep_ms = check_keep_ms(keep_ms)
    if not (torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (x2, weight, bias))):
        keep_ms = 0
    logp, entropy = LossdLogprobFunction.apply(x2, weight, bias, t1, float(temperature), rt,
                                               keep_ms)
    return logp.reshape(hidden.shape[:-1]), entropy.reshape(hidden.shape[:-1])
