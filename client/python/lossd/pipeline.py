# SPDX-License-Identifier: Apache-2.0
"""Pipelined gradient accumulation for PyTorch: the head's remote call of micro-batch k runs
while the trunk (the backbone) computes micro-batch k+1's forward and k-1's backward, so the
trainer stops waiting for its head once per micro-batch. The head is the last stage of a
pipeline whose schedule keeps `depth` micro-batches in flight (1F1B with the head remote).

    pipe = lossd.pipeline.Pipeline(head, depth=2, ddp=model)     # head: a RemoteLMHead
    losses = pipe.accumulate(micro_batches, lambda mb: (model(mb["ids"]), mb["labels"]))
    clip_grad_norm_(model.parameters(), head, 1.0); opt.step(); head_opt.step()

The gradients are bit for bit those of the synchronous loop
    for mb in micro_batches:
        hidden, labels = forward(mb)
        loss = head(hidden, labels, loss_scale=s)            # or loss_fn(weight, hidden, labels)
        scaler.scale(loss * s).backward()                     # (without a GradScaler: (loss*s))
with s = loss_scale (default 1/M): each micro-batch's dX enters the trunk's backward as that
loop's autograd hands it on, in the same order (docs/pipelining.md says what differs: the
order the server sums a hosted head's step in). Holds the activations of `depth` micro-batches
(each one's graph lives from its forward to its backward); never more than `depth` head
calls in flight (and the client's max_in_flight). Imports torch.
"""

import collections
import concurrent.futures
import contextlib
import math
import time

import torch

from lossd import errors
from lossd._remote_head import (RemoteLMHead, _head_dtype, _unscaled_dx, eager_options)
from lossd.nn import (CrossEntropyOutput, LossdFusedLinearCrossEntropyLoss, _check_liger_arguments,
                      _forward_outputs, _options, _to_torch, _wants, compute_dtype,
                      mixed_grad_fp32)

DEFAULT_DEPTH = 2


def _to_host(x, t):
    """(x and t on the host, a torch.cuda.Event both copies complete at, or None). CUDA
    tensors are copied into pinned memory without blocking, enqueued before the trunk's next
    forward on the stream, so the call's upload does not wait for that forward to finish."""
    if x.device.type != "cuda" and t.device.type != "cuda":
        return x, t, None
    out = []
    for a in (x, t):
        buf = torch.empty(a.shape, dtype=a.dtype, pin_memory=True)
        buf.copy_(a, non_blocking=True)
        out.append(buf)
    ev = torch.cuda.Event()
    ev.record()
    return out[0], out[1], ev


def upstream_gradient(loss_scale, scaler, device):
    """The gradient `scaler.scale(loss * loss_scale).backward()` brings to the loss (fp32, on
    `device`), computed by that very expression on a stand-in for the loss, so that the
    pipeline scales dX, dW and db by exactly what the synchronous loop's autograd would."""
    stand_in = torch.ones((), dtype=torch.float32, device=device, requires_grad=True)
    out = stand_in * loss_scale
    if scaler is not None and scaler.is_enabled():
        out = scaler.scale(out)
    (g,) = torch.autograd.grad(out, stand_in)
    return g


class _Flight:
    """One micro-batch between its head call's start and its backward."""

    __slots__ = ("index", "future", "finish")

    def __init__(self, index, future, finish):
        self.index, self.future, self.finish = index, future, finish


class _HostedStage:
    """A RemoteLMHead's eager Compute (dW/db into the head's step, dX back)."""

    def __init__(self, head, scaler):
        if head.deferred:
            raise errors.FailedPreconditionError(
                "head %r is deferred (deferred=True or reduction 'none'): its Compute waits for "
                "backward's upstream gradient, so it cannot run ahead of it; pipeline an eager "
                "head (reduction 'mean' or 'sum')" % head.name, method="pipeline")
        if scaler is not None and scaler is not head.grad_scaler:
            raise errors.InvalidArgumentError(
                "scaler: a hosted head scales by its own GradScaler (RemoteLMHead(grad_scaler=)"
                "); pass that one, or none", method="pipeline")
        self.head = head

    def submit(self, index, hidden, labels, loss_scale, upstream):
        head = self.head
        if not head.training:
            raise errors.FailedPreconditionError(
                "head %r is in eval mode: the pipeline adds every micro-batch to the head's "
                "step; evaluate with head(hidden, labels) under torch.no_grad()" % head.name,
                method="pipeline")
        _check_labels(hidden, labels)
        cdt = _head_dtype(head, hidden)
        x2 = hidden.detach().reshape(-1, hidden.shape[-1]).to(cdt)
        opts = head.options(cdt)
        wants = _wants(head.reduction, head.return_z_loss, head.return_token_accuracy,
                       head.return_predicted_tokens)
        kw, _ = eager_options(head, opts, loss_scale, cdt, hidden.dtype)
        xh, th, ready = _to_host(x2, labels.reshape(-1))
        fut = head.head_compute_async(xh, th, kw, head.next_key(), ready=ready,
                                      want_dx=hidden.requires_grad, **wants)

        def finish(r):
            out = _forward_outputs(r, head.reduction, labels, head.ignore_index, hidden.device,
                                   hidden.dtype, head.return_z_loss, head.return_token_accuracy,
                                   head.return_predicted_tokens)
            return _output(out, head), [(hidden, _unscaled_dx(head, r, hidden))]

        return _Flight(index, fut, finish)


class _LossStage:
    """lossd.nn's loss on a local weight (and bias): dX, dW and db back, scaled here by the
    upstream gradient as LossdFusedLinearCrossEntropyFunction's backward scales them."""

    def __init__(self, module, weight, bias, scaler):
        if weight is None:
            raise errors.InvalidArgumentError(
                "weight: a LossdFusedLinearCrossEntropyLoss pipelines with its (V, H) weight "
                "(Pipeline(loss, weight=lm_head.weight, bias=...))", method="pipeline")
        rt = module.runtime
        _check_liger_arguments(weight, module.ce_weight, module.softcap, rt)
        if module.reduction == "none":
            raise errors.FailedPreconditionError(
                "reduction 'none': its gradient needs backward's per-token upstream gradient; "
                "pipeline reduction 'mean' or 'sum'", method="pipeline")
        if rt.accumulator is not None:
            raise errors.FailedPreconditionError(
                "the loss has a server accumulator (%r): the pipeline sums dW on the trainer; "
                "make the loss without accumulator=" % rt.accumulator, method="pipeline")
        if module.ce_weight is not None and module.ce_weight.requires_grad:
            raise errors.InvalidArgumentError(
                "ce_weight requires grad, but the loss is not differentiable with respect to "
                "the class weights: pass ce_weight.detach()", method="pipeline")
        self.m, self.weight, self.bias, self.scaler = module, weight, bias, scaler

    def submit(self, index, hidden, labels, loss_scale, upstream):
        m, weight, bias, rt = self.m, self.weight, self.bias, self.m.runtime
        _check_labels(hidden, labels)
        cdt = compute_dtype(hidden)
        x2 = hidden.detach().reshape(-1, hidden.shape[-1]).to(cdt)
        opts = _options(m.ce_weight, m.ignore_index, m.lse_square_scale, m.label_smoothing,
                        m.reduction, m.softcap, m.accum_dtype, cdt, m.chunk_size,
                        m.use_token_scaling)
        needs = (hidden.requires_grad, weight.requires_grad,
                 bias is not None and bias.requires_grad)
        if mixed_grad_fp32(cdt, *[t for t, n in zip((hidden, weight, bias), needs) if n]):
            opts["grad_dtype"] = "fp32"
        if cdt == torch.float16:
            opts["grad_dtype"] = "fp32"  # scaled after the call, as the eager mode does
        wants = _wants(m.reduction, m.return_z_loss, m.return_token_accuracy,
                       m.return_predicted_tokens)
        rt.weight_ref(weight, bias, cdt)  # uploaded here, once: the calls find it cached
        xh, th, ready = _to_host(x2, labels.reshape(-1))

        def call():
            if ready is not None:
                ready.synchronize()
            return rt.compute(xh, weight, th, bias, want_dx=needs[0], want_dw=needs[1],
                              want_db=needs[2], weight_dtype=cdt, **opts, **wants)

        fut = rt.client.call_async(call)

        def finish(r):
            out = _forward_outputs(r, m.reduction, labels, m.ignore_index, hidden.device,
                                   hidden.dtype, m.return_z_loss, m.return_token_accuracy,
                                   m.return_predicted_tokens)
            grads = _scaled_grads(r, needs, upstream, hidden, weight, bias)
            return _output(out, m), list(zip((hidden, weight, bias), grads))

        return _Flight(index, fut, finish)


def _scaled_grads(r, needs, g, hidden, weight, bias):
    """(dX, dW, db) as LossdFusedLinearCrossEntropyFunction.backward returns them for the
    upstream gradient g: times g where g is not 1, then in each tensor's dtype and shape."""
    got = [_to_torch(r.dx, hidden.device) if needs[0] else None,
           _to_torch(r.dw, weight.device) if needs[1] else None,
           _to_torch(r.db, bias.device) if needs[2] else None]
    if not bool(torch.all(g == 1.0)):
        gf = g.to(torch.float32)
        got = [None if d is None else (d.float() * gf.to(d.device)).to(d.dtype) for d in got]
    dx, dw, db = got
    if dx is not None:
        dx = dx.reshape(hidden.shape).to(hidden.dtype)
    if dw is not None:
        dw = dw.to(device=weight.device, dtype=weight.dtype)
    if db is not None:
        db = db.to(device=bias.device, dtype=bias.dtype)
    return dx, dw, db


def _check_labels(hidden, labels):
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise errors.InvalidArgumentError(
            "labels shape %s must be the hidden states' shape %s without its last dimension" % (
                tuple(labels.shape), tuple(hidden.shape)), method="pipeline")


def _output(out, m):
    """The loss (detached) or a CrossEntropyOutput, as the head's forward returns them."""
    loss, z_loss, acc, pred = out
    if not (m.return_z_loss or m.return_token_accuracy or m.return_predicted_tokens):
        return loss
    return CrossEntropyOutput(loss=loss, z_loss=z_loss, token_accuracy=acc,
                              predicted_tokens=pred)


class Pipeline:
    """Gradient accumulation over micro-batches with the head's calls in flight.

    head: a lossd.nn.RemoteLMHead (hosted: each call adds to the head's step on the server,
      keyed by (rank, micro-batch) as its forward does), or a LossdFusedLinearCrossEntropyLoss
      with `weight` (and `bias`): its local (V, H) weight, whose .grad (and the bias's) get dW
      (db) as that loss's backward gives them.
    depth: micro-batches in flight (default 2): the trunk's forward of k+1 runs while k's
      head call is in flight, and k's backward when its dX is back. depth 1 is the
      synchronous loop. Activation memory: `depth` micro-batches' graphs.
    ddp: the torch DistributedDataParallel the trunk runs in, if any: every micro-batch but
      the last runs under its no_sync(), and the last's forward waits for the earlier
      backwards (DDP arms its all-reduce at that forward), so the backbone's gradients are
      all-reduced once, in the last backward.
    scaler: a torch.amp.GradScaler (the loss mode; a hosted head uses its own grad_scaler).
    """

    def __init__(self, head, *, weight=None, bias=None, depth=DEFAULT_DEPTH, ddp=None,
                 scaler=None):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise errors.InvalidArgumentError(
                "depth must be an integer >= 1 (micro-batches in flight), got %r" % (depth,),
                method="pipeline")
        if ddp is not None and not hasattr(ddp, "no_sync"):
            raise errors.InvalidArgumentError(
                "ddp must be a torch DistributedDataParallel (with no_sync()), got %s" %
                type(ddp).__name__, method="pipeline")
        if isinstance(head, RemoteLMHead):
            if weight is not None or bias is not None:
                raise errors.InvalidArgumentError(
                    "weight, bias: a hosted head's parameters live on the server; pass none",
                    method="pipeline")
            self.stage = _HostedStage(head, scaler)
        elif isinstance(head, LossdFusedLinearCrossEntropyLoss):
            self.stage = _LossStage(head, weight, bias, scaler)
        else:
            raise errors.InvalidArgumentError(
                "head must be a lossd.nn.RemoteLMHead or a LossdFusedLinearCrossEntropyLoss, "
                "got %s" % type(head).__name__, method="pipeline")
        self.head, self.depth, self.ddp, self.scaler = head, depth, ddp, scaler
        self.wait_seconds = 0.0  # the last accumulate's time spent waiting for head calls

    def accumulate(self, micro_batches, forward, *, loss_scale=None):
        """Runs forward(mb) -> (hidden (..., H), labels (...)) for each micro-batch, the head's
        call on it, and the backward of both; returns the M losses (detached; or
        CrossEntropyOutput with the head's return_* flags), in order. loss_scale: what each
        micro-batch's loss is multiplied by before backward (default 1/M, the mean).

        On an error (a head call's LossdError, or one of forward's) the calls not started are
        cancelled, those running are waited for, and the error is raised: the step holds part
        of the micro-batches' gradients, as a synchronous loop stopped there would."""
        mbs = list(micro_batches)
        if not mbs:
            raise errors.InvalidArgumentError("micro_batches is empty", method="pipeline")
        s = 1.0 / len(mbs) if loss_scale is None else float(loss_scale)
        if not (s > 0 and math.isfinite(s)):
            raise errors.InvalidArgumentError(
                "loss_scale must be finite and > 0, got %r" % (loss_scale,), method="pipeline")
        if not torch.is_grad_enabled():
            raise errors.FailedPreconditionError(
                "accumulate runs backward: call it with grad enabled (not under no_grad)",
                method="pipeline")
        self.wait_seconds = 0.0
        outputs = [None] * len(mbs)
        pending = collections.deque()
        upstream = None
        try:
            for k, mb in enumerate(mbs):
                last = k == len(mbs) - 1
                if last and self.ddp is not None:
                    while pending:
                        self._land(pending.popleft(), outputs)
                sync = self.ddp.no_sync() if self.ddp is not None and not last else None
                with sync or contextlib.nullcontext():
                    hidden, labels = forward(mb)
                if upstream is None and isinstance(self.stage, _LossStage):
                    upstream = upstream_gradient(s, self.scaler, hidden.device)
                pending.append(self.stage.submit(k, hidden, labels, s, upstream))
                del hidden, labels  # the flight holds them until its backward
                while len(pending) >= self.depth:
                    self._land(pending.popleft(), outputs)
            while pending:
                self._land(pending.popleft(), outputs)
        except BaseException:
            _abandon(pending)
            raise
        return outputs

    def _land(self, flight, outputs):
        """Waits for a flight's head call, then runs its backward."""
        t0 = time.perf_counter()
        r = flight.future.result()
        self.wait_seconds += time.perf_counter() - t0
        out, grads = flight.finish(r)
        flight.finish = None  # drop the graph's references once it has run
        outputs[flight.index] = out
        pairs = [(t, g) for t, g in grads if g is not None and t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _abandon(pending):
    """Cancels the flights not started and waits for the running ones to end (their results
    dropped), so that no call of this step is still running when the error reaches the
    caller."""
    futs = [f.future for f in pending]
    for f in futs:
        f.cancel()
    concurrent.futures.wait(futs)
    pending.clear()


__all__ = ["Pipeline", "upstream_gradient", "DEFAULT_DEPTH"]
